"""Train the digits teacher: a class-conditional DiT flow-matching model on the digits training split.

Deterministic for a given seed and thread count (set here to 2); a few minutes on a 2-core CPU.
Writes a diffusers model directory (config.json + diffusion_pytorch_model.safetensors)
that recipes load through `model.teacher.path`, and prints the teacher's digits
quality at several Euler step counts:

    python scripts/train_digits_teacher.py --out outputs/digits_teacher --steps 3000

With those arguments it reproduces the teacher shipped as ``builtin:digits_teacher``
(verl_dmd/assets/digits_teacher) byte for byte on the development machine; another
CPU may differ in the last bits of floating-point reductions.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from verl_dmd import losses
from verl_dmd.adapters import get_adapter
from verl_dmd.adapters.base import ModelSource
from verl_dmd.adapters.diffusers_transformers import set_label_dropout
from verl_dmd.algorithms.sampling import euler_sample
from verl_dmd.data.digits import NUM_CLASSES, load_digits_splits
from verl_dmd.eval.digits_classifier import train_digits_classifier
from verl_dmd.eval.digits_report import TEACHER_STEPS, DigitsEvaluation

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
TEACHER_LABEL_DROPOUT = 0.1


def train(args) -> torch.nn.Module:
    torch.manual_seed(args.seed)
    adapter = get_adapter("dit")()
    model = adapter.build_model(ModelSource(config=TEACHER_CONFIG)).train()
    # The adapter turns DiT's label dropout off; the teacher needs it to learn the unconditional
    # (null-class) prediction that classifier-free guidance uses.
    set_label_dropout(model, TEACHER_LABEL_DROPOUT)
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
        loss = losses.fake_score_loss(velocity, losses.prediction_target("velocity", x0, eps))
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
    parser.add_argument("--steps", type=int, default=3000)
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
    evaluation = DigitsEvaluation(
        train_digits_classifier(train_split, seed=args.seed),
        holdout,
        train_split,
        num_samples=args.eval_samples,
    )
    cond = {"class_labels": evaluation.labels}
    null = {"class_labels": torch.full_like(evaluation.labels, adapter.null_class(model))}
    print("guidance  steps  digits-FID  accuracy  precision  recall  memorisation")
    for guidance in args.guidance:
        for steps in TEACHER_STEPS:
            images = euler_sample(
                adapter, model, evaluation.noise, cond, steps, guidance=guidance, uncond=null
            )
            row = evaluation.row("teacher", "euler", steps, images)
            print(
                f"{guidance:8.1f} {steps:6d} {row.fid:11.2f} {row.accuracy:9.3f} {row.precision:10.3f} "
                f"{row.recall:7.3f} {row.memorisation:13.3f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
