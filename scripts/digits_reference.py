"""How much the digits table's numbers move when nothing but the draw changes.

Context for the digits quality table (docs/benchmarks.md), not a change to it: the table
scores 500 samples from one fixed noise (`DigitsEvaluation`). This script scores

- real training digits: `--subsets` random draws of 500 training digits (50 per class, the
  table's labels i mod 10), each against the same held-out split with the same classifier:
  the FID, precision and recall that real handwriting gets at this sample count;
- a model sampled from other noise: `--teacher DIR` (a diffusers DiT directory, Euler at
  `--teacher-steps`) and/or `--student DIR` (an exported student, the few-step sampler at
  `--student-steps` with evenly spaced levels, as the digits recipe trains), each at
  `--seeds` noise seeds 1, 2, ... (seed 1 is the table's own noise: its row is the table's).

It prints one line per draw and the mean, standard deviation, minimum and maximum per row:

    python scripts/digits_reference.py --subsets 20 --teacher builtin:digits_teacher --seeds 10
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from verl_dmd.adapters import get_adapter
from verl_dmd.adapters.base import ModelSource
from verl_dmd.algorithms.sampling import euler_sample, even_schedule, few_step_sample, renoise_draws
from verl_dmd.assets import resolve_model_path
from verl_dmd.data.digits import NUM_CLASSES, load_digits_splits
from verl_dmd.eval.digits_classifier import train_digits_classifier
from verl_dmd.eval.digits_report import DigitsEvaluation

METRICS = ("fid", "accuracy", "precision", "recall", "memorisation")


def real_subset(train, labels: torch.Tensor, seed: int) -> torch.Tensor:
    """Training digits for `labels` (one per label, without repeats within a class), drawn with `seed`."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.empty(len(labels), *train.images.shape[1:])
    for digit in range(NUM_CLASSES):
        slots = (labels == digit).nonzero().flatten()
        pool = (train.labels == digit).nonzero().flatten()
        if len(pool) < len(slots):
            raise ValueError(f"class {digit}: {len(slots)} samples asked, the training split has {len(pool)}")
        images[slots] = train.images[pool[torch.randperm(len(pool), generator=generator)[: len(slots)]]]
    return images


def load_model(path: str):
    adapter = get_adapter("dit")()
    try:
        path = resolve_model_path(path)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    if not Path(path).is_dir():
        raise SystemExit(f"model directory {path!r} does not exist; fix: give a diffusers DiT directory")
    elif (Path(path) / "diffusers").is_dir():  # an export directory: its diffusers model
        path = str(Path(path) / "diffusers")
    return adapter, adapter.build_model(ModelSource(path=path)).eval()


def summary(name: str, rows: list[dict]) -> str:
    parts = []
    for key in METRICS:
        values = [r[key] for r in rows]
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        parts.append(
            f"{key} {statistics.mean(values):.3f} sd {sd:.3f} [{min(values):.3f}, {max(values):.3f}]"
        )
    return f"{name} ({len(rows)} draws): " + "; ".join(parts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--subsets", type=int, default=20, help="random draws of real training digits (0: none)"
    )
    parser.add_argument("--teacher", default=None, help="a diffusers DiT directory or builtin:digits_teacher")
    parser.add_argument("--teacher-steps", type=int, default=32)
    parser.add_argument("--student", default=None, help="an exported student directory")
    parser.add_argument("--student-steps", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--seeds", type=int, default=10, help="noise seeds per model (1, 2, ...)")
    parser.add_argument("--num-samples", type=int, default=500)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    train, holdout = load_digits_splits(seed=0)
    classifier = train_digits_classifier(train, seed=0)

    def evaluation(seed: int) -> DigitsEvaluation:
        """Seed 1 is the table's own noise and re-noising (noise seed 1, re-noise seed 2)."""
        renoise = 2 if seed == 1 else 1000 + seed
        return DigitsEvaluation(
            classifier, holdout, train, num_samples=args.num_samples, noise_seed=seed, renoise_seed=renoise
        )

    def score(name: str, evaluation_: DigitsEvaluation, images: torch.Tensor) -> dict:
        row = evaluation_.row(name, "", 0, images)
        values = {key: getattr(row, key) for key in METRICS}
        print(f"  {name}: " + " ".join(f"{k} {v:.3f}" for k, v in values.items()), flush=True)
        return values

    summaries = []
    if args.subsets:
        base = evaluation(1)
        rows = [
            score(f"real subset {s}", base, real_subset(train, base.labels, s)) for s in range(args.subsets)
        ]
        summaries.append(summary(f"real training digits, {args.num_samples} per draw", rows))
    for kind, path in (("teacher", args.teacher), ("student", args.student)):
        if path is None:
            continue
        adapter, model = load_model(path)
        for steps in [args.teacher_steps] if kind == "teacher" else args.student_steps:
            rows = []
            for seed in range(1, args.seeds + 1):
                ev = evaluation(seed)
                cond = {"class_labels": ev.labels}
                with torch.no_grad():
                    if kind == "teacher":
                        images = euler_sample(adapter, model, ev.noise, cond, steps)
                    else:
                        schedule = even_schedule(steps)
                        draws = renoise_draws(ev.noise.shape, steps, ev.renoise_generator())
                        images = few_step_sample(adapter, model, ev.noise, cond, schedule, draws)
                rows.append(score(f"{kind} {steps}-step seed {seed}", ev, images))
            summaries.append(summary(f"{kind} {path} at {steps} steps", rows))
    print("\n".join(summaries))
    return 0


if __name__ == "__main__":
    sys.exit(main())
