"""How widely a set of digits samples spreads within each class, against real handwriting.

A diagnostic for the digits table (docs/benchmarks.md), not a change to it: the table's recall says
that a model misses real variety; this says by how much its samples spread. For each `.npz` the
validator writes (`<output_dir>/samples/<role>_<n>step.npz`: images in [-1, 1], labels) it prints

- spread: the within-class pixel variance (unbiased, summed over the 64 pixels, on the dataset's 0..16
  scale, averaged over the 10 classes), and that spread over the held-out digits' (1.0: as wide as real
  handwriting; below 1: under-dispersed, as mode-seeking distillation tends to be);
- background: the share of pixels below 0.5 (of 16), the dataset's blank paper;

after the same figures for the held-out and training splits. Images are clamped to 0..16 first, as
the table's classifier reads them:

    python scripts/digits_spread.py outputs/digits_dmd2/samples/teacher_32step.npz \
        outputs/digits_dmd2/samples/student_ema_1step.npz
"""

from __future__ import annotations

import argparse
import sys
import zipfile

import numpy as np
import torch

from verl_dmd.data.digits import IMAGE_SHAPE, NUM_CLASSES, load_digits_splits, to_pixel_range


def fail(message: str) -> None:
    raise SystemExit(f"digits_spread: {message}")


def spread(images: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
    """(mean over classes of the summed per-pixel variance, unbiased (ddof 1), share of pixels below 0.5),
    float64, on images already on the 0..16 scale; every class needs two samples or more."""
    flat = images.reshape(len(images), -1).astype(np.float64)
    per_class = [flat[labels == digit].var(axis=0, ddof=1).sum() for digit in range(NUM_CLASSES)]
    return float(np.mean(per_class)), float((flat < 0.5).mean())


def load_samples(path: str) -> tuple[np.ndarray, np.ndarray]:
    """The images (on the 0..16 scale) and labels of a validator `.npz`, or a one-line exit."""
    fix = "fix: give a samples .npz the validator wrote (<output_dir>/samples/<role>_<n>step.npz)"
    try:
        data = np.load(path, allow_pickle=False)
        if not isinstance(data, np.lib.npyio.NpzFile):
            fail(f"{path!r} holds one array (a .npy), not an .npz of images and labels; {fix}")
        with data:
            if "images" not in data or "labels" not in data:
                fail(f"{path!r} holds {sorted(data.keys())}, not images and labels; {fix}")
            images, labels = data["images"], data["labels"]
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as error:
        fail(f"{path!r} is not a readable .npz ({error}); {fix}")
    if images.ndim != 4 or tuple(images.shape[1:]) != tuple(IMAGE_SHAPE) or labels.shape != images.shape[:1]:
        fail(f"{path!r}: images {images.shape} and labels {labels.shape}, expected (N, "
             f"{', '.join(map(str, IMAGE_SHAPE))}) and (N,); {fix}")  # fmt: skip
    if not np.issubdtype(images.dtype, np.floating):
        fail(f"{path!r}: images of dtype {images.dtype}, expected floating point in [-1, 1]; {fix}")
    if not np.issubdtype(labels.dtype, np.integer) or labels.size == 0:
        fail(f"{path!r}: labels of dtype {labels.dtype} and {labels.size} samples, expected integers; {fix}")
    if labels.min() < 0 or labels.max() >= NUM_CLASSES:
        fail(f"{path!r}: labels must be integers in [0, {NUM_CLASSES}); {fix}")
    counts = np.bincount(labels, minlength=NUM_CLASSES)
    if counts.min() < 2:
        few = [digit for digit in range(NUM_CLASSES) if counts[digit] < 2]
        fail(f"{path!r}: class(es) {few} have fewer than 2 samples, so their spread is undefined; {fix}")
    if not np.isfinite(images).all():
        fail(f"{path!r}: images hold non-finite values; {fix}")
    return to_pixel_range(torch.from_numpy(images.astype(np.float32))).numpy(), labels


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("samples", nargs="+", help="validator .npz files")
    args = parser.parse_args(argv)
    loaded = [(path, *load_samples(path)) for path in args.samples]  # every file checked before printing
    train, holdout = load_digits_splits(seed=0)
    rows = [("held-out digits", *to_numpy(holdout)), ("training digits", *to_numpy(train)), *loaded]
    reference, _ = spread(*rows[0][1:])
    width = max(len(name) for name, _, _ in rows)
    print(f"{'samples':<{width}}  {'spread':>8} {'/ held-out':>10} {'background':>10}")
    for name, images, labels in rows:
        value, background = spread(images, labels)
        print(f"{name:<{width}}  {value:8.1f} {value / reference:10.3f} {background:10.3f}")
    return 0


def to_numpy(split) -> tuple[np.ndarray, np.ndarray]:
    return to_pixel_range(split.images).numpy(), split.labels.numpy()


if __name__ == "__main__":
    sys.exit(main())
