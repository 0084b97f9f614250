"""The digits quality table: teacher at several Euler step counts next to the distilled roles.

Every row samples the same labels (``i mod 10``) from the same starting noise,
writes the samples to ``<out>/samples/<name>.npz`` and ``<name>.png`` (one class per
column), and scores them against the held-out split: digits-FID and class accuracy
(`digits_quality`), k-NN precision and recall (k = 5) in the classifier's feature space,
and the memorisation ratio in pixel space against the training split
(`verl_dmd.eval.neighbours`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from verl_dmd.data.digits import IMAGE_SHAPE, NUM_CLASSES, DigitsSplit, to_pixel_range
from verl_dmd.eval.digits_classifier import DigitsClassifier, digits_quality
from verl_dmd.eval.images import save_grid, save_samples
from verl_dmd.eval.neighbours import memorisation_ratio, precision_recall
from verl_dmd.seeding import fixed_generator

TEACHER_STEPS = (1, 2, 4, 8, 32)
NEIGHBOURS_K = 5
"""k of the k-NN precision and recall."""


@dataclass(frozen=True)
class QualityRow:
    model: str
    """teacher, student or student_ema."""
    sampler: str
    """euler (the teacher's ODE) or few-step (x0 prediction, re-noise)."""
    steps: int
    fid: float
    accuracy: float
    precision: float
    """Share of samples inside the held-out digits' k-NN support (classifier features)."""
    recall: float
    """Share of held-out digits inside the samples' k-NN support (classifier features)."""
    memorisation: float
    """Median pixel distance of the samples to their nearest training digit over the same median of the
    held-out digits: about 1 for novel samples, near 0 for copies of the training set."""
    samples: Path | None = None


@dataclass
class DigitsEvaluation:
    """Fixed labels and noise, the classifier and the reference split, shared by every row.

    The noise is the instrument's own: drawn from the constants `noise_seed` and `renoise_seed`
    (`seeding.fixed_generator`), so every row of every digits table in docs/benchmarks.md was sampled
    from the same starting noise and re-noising.
    """

    classifier: DigitsClassifier
    holdout: DigitsSplit
    train: DigitsSplit
    """The split the teacher trained on (the memorisation ratio's reference)."""
    num_samples: int = 500
    noise_seed: int = 1
    renoise_seed: int = 2
    out_dir: Path | None = None

    def __post_init__(self) -> None:
        if self.num_samples < NUM_CLASSES:
            raise ValueError(f"num_samples = {self.num_samples}: need at least one sample per class (10)")
        self.labels = torch.arange(self.num_samples) % NUM_CLASSES
        self.noise = torch.randn(self.num_samples, *IMAGE_SHAPE, generator=fixed_generator(self.noise_seed))
        with torch.no_grad():
            self._holdout_features = self.classifier.features(self.holdout.images)

    def renoise_generator(self) -> torch.Generator:
        """Fresh noise for few-step samplers, the same stream for every row."""
        return fixed_generator(self.renoise_seed)

    def row(self, model: str, sampler: str, steps: int, images: torch.Tensor) -> QualityRow:
        """Score `images` (sampled for `self.labels` from `self.noise`) and, with `out_dir`, save them."""
        if images.shape != self.noise.shape:
            raise ValueError(
                f"{model} produced samples of shape {tuple(images.shape)}, not {self.noise.shape}"
            )
        quality = digits_quality(self.classifier, images, self.labels, self.holdout)
        with torch.no_grad():
            features = self.classifier.features(images)
        neighbours = precision_recall(self._holdout_features, features, k=NEIGHBOURS_K)
        memorisation = memorisation_ratio(
            to_pixel_range(images), to_pixel_range(self.train.images), to_pixel_range(self.holdout.images)
        )
        path = None
        if self.out_dir is not None:
            name = f"{model}_{steps}step"
            path = save_samples(
                self.out_dir / "samples" / f"{name}.npz",
                images,
                self.labels,
                steps=steps,
                fid=quality["fid"],
                accuracy=quality["accuracy"],
                precision=neighbours["precision"],
                recall=neighbours["recall"],
                memorisation=memorisation,
            )
            # labels are i mod 10, so rows of 10 put one class in each column
            save_grid(path.with_suffix(".png"), images[: NUM_CLASSES * 10], nrow=NUM_CLASSES)
        return QualityRow(
            model,
            sampler,
            steps,
            quality["fid"],
            quality["accuracy"],
            neighbours["precision"],
            neighbours["recall"],
            memorisation,
            path,
        )


def format_table(rows: Iterable[QualityRow]) -> str:
    """A markdown table of the rows, in order."""
    lines = [
        "| model | sampler | steps | digits-FID | class accuracy | precision | recall | memorisation |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.model} | {r.sampler} | {r.steps} | {r.fid:.2f} | {r.accuracy:.3f} | {r.precision:.3f} "
        f"| {r.recall:.3f} | {r.memorisation:.3f} |"
        for r in rows
    ]
    return "\n".join(lines)
