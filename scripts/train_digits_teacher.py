"""Train the digits teacher: a class-conditional DiT flow-matching model on the digits training split.

Deterministic for a given seed and thread count (set here to 2); a few minutes on a 2-core CPU.
Writes a diffusers model directory (config.json + diffusion_pytorch_model.safetensors)
that recipes load through `model.teacher.path`, and prints the teacher's digits
quality at several Euler step counts:

    python scripts/train_digits_teacher.py --out outputs/digits_teacher --steps 4000
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch

from verl_dmd import losses
from verl_dmd.adapters import get_adapter
from verl_dmd.adapters.base import ModelSource
from verl_dmd.data.digits import NUM_CLASSES, load_digits_splits
from verl_dmd.eval.digits_classifier import digits_quality, train_digits_classifier

TEACHER_CONFIG = {
    "sample_size": 8,
    "patch_size": 2,
    "in_channels": 1,
    "out_channels": 1,
    "num_layers": 4,
    "num_attention_heads": 4,
    "attention_head_dim": 16,
    "num_embeds_ada_norm": NUM_CLASSES,
    "norm_type": "ada_norm_zero",
}


@torch.no_grad()
def euler_sample(
    adapter, model, labels: torch.Tensor, steps: int, guidance: float, generator
) -> torch.Tensor:
    """Euler integration of the velocity field from sigma=1 (noise) to 0 with classifier-free guidance."""
    x = torch.randn(labels.shape[0], 1, 8, 8, generator=generator)
    null = torch.full_like(labels, adapter.null_class(model))
    sigmas = torch.linspace(1.0, 0.0, steps + 1)
    for sigma, next_sigma in itertools.pairwise(sigmas):
        level = sigma.expand(labels.shape[0])
        v_cond = adapter.predict(model, x, level, {"class_labels": labels})
        velocity = v_cond
        if guidance != 1.0:
            v_uncond = adapter.predict(model, x, level, {"class_labels": null})
            velocity = losses.classifier_free_guidance(v_uncond, v_cond, guidance)
        x = x + (next_sigma - sigma) * velocity
    return x


def train(args) -> torch.nn.Module:
    torch.manual_seed(args.seed)
    adapter = get_adapter("dit")()
    model = adapter.build_model(ModelSource(config=TEACHER_CONFIG)).train()
    data, _ = load_digits_splits(seed=args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(args.seed)
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        idx = torch.randint(len(data), (args.batch_size,), generator=generator)
        x0, labels = data.images[idx], data.labels[idx]
        eps = torch.randn(x0.shape, generator=generator)
        sigma = torch.rand(args.batch_size, generator=generator)
        x_t = losses.add_noise(x0, eps, sigma)
        # DiT drops 10% of labels to its null class in train mode: the teacher learns CFG.
        velocity = adapter.predict(model, x_t, sigma, {"class_labels": labels})
        loss = losses.fake_score_loss(velocity, x0, eps)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        for group in optimizer.param_groups:  # cosine decay to 10%
            group["lr"] = args.lr * (
                0.1 + 0.9 * 0.5 * (1 + torch.cos(torch.tensor(step / args.steps * 3.14159265)).item())
            )
        if step % max(1, args.steps // 20) == 0 or step == 1:
            print(
                f"step {step:5d}/{args.steps} loss {loss.item():.4f} {time.perf_counter() - started:6.1f}s",
                flush=True,
            )
    return model.eval()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--guidance", type=float, nargs="+", default=[1.0, 2.0])
    parser.add_argument("--eval-samples", type=int, default=1000)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    model = train(args)
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    print(f"teacher saved to {args.out}")

    adapter = get_adapter("dit")()
    train_split, holdout = load_digits_splits(seed=args.seed)
    classifier = train_digits_classifier(train_split, seed=args.seed)
    labels = torch.arange(args.eval_samples) % NUM_CLASSES
    print("guidance  steps  digits-FID  accuracy")
    for guidance in args.guidance:
        for steps in (1, 2, 4, 8, 32):
            samples = euler_sample(adapter, model, labels, steps, guidance, torch.Generator().manual_seed(1))
            quality = digits_quality(classifier, samples, labels, holdout)
            print(f"{guidance:8.1f} {steps:6d} {quality['fid']:11.2f} {quality['accuracy']:9.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
