"""How much the digits table's numbers move when nothing but the draw changes.

Context for the digits quality table (docs/benchmarks.md), not a change to it: the table
scores 500 samples from one fixed noise (`DigitsEvaluation`). This script scores

- real training digits: `--subsets` random draws of 500 training digits (50 per class, the
  table's labels i mod 10), each against the same held-out split with the same classifier:
  the FID, precision and recall that real handwriting gets at this sample count;
- a model sampled from other noise: `--teacher DIR` (a diffusers DiT directory, Euler at
  `--teacher-steps`) and/or `--student DIR` (an exported student, the few-step sampler at
  `--student-steps` with the levels the validator uses: the trained ones from the export's
  `export.json` at the trained step count, evenly spaced ones otherwise), each at `--seeds`
  noise seeds 1, 2, ... (seed 1 is the table's own noise and re-noising: its row is the
  table's; the others draw from streams that cannot meet it). The real draws overlap (50 of
  about 143 training digits per class), so their spread is somewhat below that of independent
  sets of new handwriting.

It prints one line per draw and the mean, standard deviation, minimum and maximum per row:

    python scripts/digits_reference.py --subsets 20 --teacher builtin:digits_teacher --seeds 10
"""

from __future__ import annotations

import argparse
import json
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


NOISE_SEED_BASE, RENOISE_SEED_BASE = 10_000, 20_000
"""Seeds 2, 3, ... draw their noise from NOISE_SEED_BASE + seed and their re-noising from RENOISE_SEED_BASE +
seed: streams that cannot meet the table's own (noise 1, re-noise 2) or each other's."""


def fail(message: str) -> None:
    raise SystemExit(f"digits_reference: {message}")


def model_directory(path: str, kind: str) -> tuple[str, dict | None]:
    """The diffusers directory of `path` (a DiT directory, `builtin:<name>`, or an export directory:
    a role directory, its global_step_N or the export root, holding exactly one `diffusers/`), and the
    export's `export.json` when there is one."""
    try:
        path = resolve_model_path(path)
    except ValueError as error:
        fail(f"--{kind}: {error}")
    root = Path(path)
    if not root.is_dir():
        fail(f"--{kind} {path!r} does not exist; fix: give a diffusers DiT directory or an export directory")
    if (root / "config.json").is_file():
        return str(root), None
    found = sorted(p.parent for p in root.glob("**/diffusers/config.json"))
    if len(found) != 1:
        what = "no diffusers/config.json" if not found else f"{len(found)} diffusers/ folders"
        fail(
            f"--{kind} {path!r}: {what} under it; fix: give a diffusers DiT directory or one exported role "
            "(<output_dir>/export/global_step_N/<role>, written with export.formats containing diffusers)"
        )
    manifest = found[0].parent / "export.json"
    return str(found[0]), json.loads(manifest.read_text()) if manifest.is_file() else None


def student_schedule(steps: int, export: dict | None) -> torch.Tensor:
    """The levels the validator samples a student at: its trained ones (export.json) at the trained step
    count, evenly spaced ones (shift 1) otherwise; refused where the trained ones show another shift."""
    trained = (export or {}).get("dmd2_config", {}).get("denoising_timesteps")
    if trained is None:
        return even_schedule(steps)
    levels = torch.tensor([t / 1000.0 for t in trained] + [0.0], dtype=torch.float32)
    if len(trained) == steps:
        return levels
    if not torch.allclose(levels, even_schedule(len(trained)), atol=1e-6):
        fail(
            f"--student-steps {steps}: the student was trained at levels {levels.tolist()} (not evenly "
            f"spaced), so its {steps}-step levels are unknown here; fix: ask for {len(trained)} steps"
        )
    return even_schedule(steps)


def summary(name: str, rows: list[dict]) -> str:
    parts = []
    for key in METRICS:
        values = [r[key] for r in rows]
        spread = f" sd {statistics.stdev(values):.3f}" if len(values) > 1 else ""
        parts.append(f"{key} {statistics.mean(values):.3f}{spread} [{min(values):.3f}, {max(values):.3f}]")
    return f"{name} ({len(rows)} draws): " + "; ".join(parts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--subsets", type=int, default=20, help="random draws of real training digits (0: none)"
    )
    parser.add_argument("--teacher", default=None, help="a diffusers DiT directory or builtin:digits_teacher")
    parser.add_argument("--teacher-steps", type=int, default=32)
    parser.add_argument("--student", default=None, help="an exported student (role) directory")
    parser.add_argument("--student-steps", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--seeds", type=int, default=10, help="noise seeds per model (1, 2, ...)")
    parser.add_argument("--num-samples", type=int, default=500)
    args = parser.parse_args(argv)
    if args.subsets < 0:
        fail(f"--subsets {args.subsets}: must be 0 (none) or more")
    if (args.teacher or args.student) and args.seeds < 1:
        fail(f"--seeds {args.seeds}: must be 1 or more")
    if min(args.teacher_steps, *args.student_steps) < 1:
        fail(f"--teacher-steps / --student-steps: step counts must be 1 or more, got "
             f"{args.teacher_steps} / {args.student_steps}")  # fmt: skip
    if not args.subsets and not (args.teacher or args.student):
        fail("nothing to measure; fix: give --subsets > 0, --teacher or --student")
    torch.set_num_threads(2)
    train, holdout = load_digits_splits(seed=0)
    per_class = min(int((train.labels == c).sum()) for c in range(NUM_CLASSES))
    if not NUM_CLASSES <= args.num_samples <= per_class * NUM_CLASSES:
        fail(f"--num-samples {args.num_samples}: must be in [{NUM_CLASSES}, {per_class * NUM_CLASSES}] (at most "
             f"{per_class} training digits per class without repeats)")  # fmt: skip
    # Both paths resolved before the adapter's imports (diffusers: seconds), then both models loaded before
    # any scoring: a bad path fails in about the time the script takes to start.
    directories = {
        kind: model_directory(path, kind)
        for kind, path in (("teacher", args.teacher), ("student", args.student))
        if path is not None
    }
    models = {}
    adapter = get_adapter("dit")() if directories else None
    for kind, path in (("teacher", args.teacher), ("student", args.student)):
        if path is not None:
            directory, export = directories[kind]
            try:
                model = adapter.build_model(ModelSource(path=directory)).eval()
            except (OSError, ValueError) as error:
                fail(f"--{kind} {directory!r}: not a loadable diffusers DiT ({error})")
            steps = [args.teacher_steps] if kind == "teacher" else args.student_steps
            schedules = {n: student_schedule(n, export) for n in steps} if kind == "student" else {}
            models[kind] = (path, model, steps, schedules)
    classifier = train_digits_classifier(train, seed=0)

    def evaluation(seed: int) -> DigitsEvaluation:
        """Seed 1 is the table's own noise and re-noising (noise seed 1, re-noise seed 2)."""
        noise, renoise = (1, 2) if seed == 1 else (NOISE_SEED_BASE + seed, RENOISE_SEED_BASE + seed)
        return DigitsEvaluation(
            classifier, holdout, train, num_samples=args.num_samples, noise_seed=noise, renoise_seed=renoise
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
    for kind, (path, model, step_counts, schedules) in models.items():
        for steps in step_counts:
            rows = []
            for seed in range(1, args.seeds + 1):
                ev = evaluation(seed)
                cond = {"class_labels": ev.labels}
                with torch.no_grad():
                    if kind == "teacher":
                        images = euler_sample(adapter, model, ev.noise, cond, steps)
                    else:
                        draws = renoise_draws(ev.noise.shape, steps, ev.renoise_generator())
                        images = few_step_sample(adapter, model, ev.noise, cond, schedules[steps], draws)
                rows.append(score(f"{kind} {steps}-step seed {seed}", ev, images))
            summaries.append(summary(f"{kind} {path} at {steps} steps", rows))
    print("\n".join(summaries))
    return 0


if __name__ == "__main__":
    sys.exit(main())
