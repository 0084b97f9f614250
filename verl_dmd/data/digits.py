"""The embedded digits data: scikit-learn's bundled 8x8 digits, split and scaled; nothing is downloaded."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

NUM_CLASSES = 10
IMAGE_SHAPE = (1, 8, 8)
PIXEL_MAX = 16.0  # scikit-learn's digits hold integers 0..16


@dataclass(frozen=True)
class DigitsSplit:
    """Images (N, 1, 8, 8) float32 in [-1, 1] and labels (N,) int64."""

    images: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return int(self.labels.shape[0])


def to_model_range(pixels: np.ndarray | torch.Tensor) -> torch.Tensor:
    """0..16 pixel values -> [-1, 1] (what the flow models see)."""
    return torch.as_tensor(pixels, dtype=torch.float32) / (PIXEL_MAX / 2) - 1.0


def to_pixel_range(images: torch.Tensor) -> torch.Tensor:
    """[-1, 1] -> 0..16, clamped (for pictures and the classifier, which was trained on this range)."""
    return ((images.float() + 1.0) * (PIXEL_MAX / 2)).clamp(0.0, PIXEL_MAX)


def load_digits_splits(holdout_fraction: float = 0.2, seed: int = 0) -> tuple[DigitsSplit, DigitsSplit]:
    """(train, holdout): a deterministic split stratified by class.

    The teacher and the feature classifier train on `train`; quality metrics
    compare samples against `holdout`, which neither has seen.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    if not 0.0 < holdout_fraction < 1.0:
        raise ValueError(f"holdout_fraction = {holdout_fraction!r}: must be in (0, 1)")
    digits = load_digits()
    index = np.arange(len(digits.target))
    train_idx, holdout_idx = train_test_split(
        index, test_size=holdout_fraction, random_state=seed, stratify=digits.target
    )

    def split(idx: np.ndarray) -> DigitsSplit:
        idx = np.sort(idx)
        images = to_model_range(digits.images[idx]).reshape(-1, *IMAGE_SHAPE)
        return DigitsSplit(images=images, labels=torch.as_tensor(digits.target[idx], dtype=torch.int64))

    return split(train_idx), split(holdout_idx)
