"""The embedded digits data: scikit-learn's bundled 8x8 digits, split and scaled; nothing is downloaded."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from verl_dmd.seeding import generator

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


PAIR_KEYS = ("noise", "target", "cond.class_labels")


def check_pairs(pairs: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """Paired data as the stream needs it, or a one-line error naming `source`, the key and the fix."""
    fix = "fix: regenerate it (delete the file) or point data.regression_pairs_path at a digits pairs file"
    missing = [k for k in PAIR_KEYS if k not in pairs]
    if missing:
        raise ValueError(f"regression pairs {source}: missing {', '.join(missing)}; {fix}")
    count = pairs["noise"].shape[0]
    for key in PAIR_KEYS:
        value = pairs[key]
        shape = (count,) if key.startswith("cond.") else (count, *IMAGE_SHAPE)
        if tuple(value.shape) != shape or count == 0:
            raise ValueError(
                f"regression pairs {source}: {key} has shape {tuple(value.shape)}, not {shape}; {fix}"
            )
        if value.is_floating_point() and not torch.isfinite(value).all():
            raise ValueError(f"regression pairs {source}: {key} holds non-finite values; {fix}")
    labels = pairs["cond.class_labels"]
    if labels.is_floating_point() or labels.min() < 0 or labels.max() >= NUM_CLASSES:
        raise ValueError(f"regression pairs {source}: cond.class_labels must be integers in [0, 10); {fix}")
    return {k: pairs[k] for k in PAIR_KEYS}


class DigitsConditionStream:
    """The digits distillation data: class labels with their starting noise, resumable and world-size free.

    DMD2 needs conditions, not images: the student turns noise into samples and the
    teacher judges them. The conditions are the training split's labels (so classes
    keep their natural frequencies) in an order shuffled afresh each epoch. Sample
    number ``p`` of the stream (counting from 0 over all ranks) is fully determined by
    (seed, p): its label is entry ``p mod N`` of epoch ``p // N``'s permutation and its
    noise is drawn from a generator seeded from (seed, p). A batch of ``size`` per rank
    on ``world`` ranks covers positions ``[position, position + size * world)``, rank r
    the r-th slice; the state is that one position, so resuming at any world size
    continues the same stream. With `pairs` (regression) or `real` (GAN) each sample
    also carries one pair / one real digit, each from its own per-epoch permutation.
    """

    def __init__(
        self,
        labels: torch.Tensor,
        *,
        null_class: int,
        seed: int,
        pairs: dict[str, torch.Tensor] | None = None,
        real: DigitsSplit | None = None,
    ) -> None:
        if labels.ndim != 1 or labels.numel() == 0:
            raise ValueError(f"labels of shape {tuple(labels.shape)}: expected a non-empty 1-d tensor")
        self.labels = labels.to(torch.int64)
        self.null_class = int(null_class)
        self.seed = int(seed)
        if self.seed < 0:
            raise ValueError(f"seed = {seed!r}: must be >= 0")
        self.position = 0
        self.pairs = pairs
        self.real = real
        self._orders: dict[str, tuple[int, torch.Tensor]] = {}

    @property
    def epoch(self) -> int:
        return self.position // self.labels.numel()

    def _index(self, stream: str, position: int, size: int) -> int:
        """Entry `position mod size` of epoch `position // size`'s permutation of range(size)."""
        epoch, offset = divmod(position, size)
        cached = self._orders.get(stream)
        if cached is None or cached[0] != epoch:
            cached = (epoch, torch.randperm(size, generator=generator(self.seed, stream, epoch)))
            self._orders[stream] = cached
        return int(cached[1][offset])

    def _label(self, position: int) -> int:
        return int(self.labels[self._index("labels", position, self.labels.numel())])

    def _noise(self, position: int) -> torch.Tensor:
        return torch.randn(IMAGE_SHAPE, generator=generator(self.seed, "noise", position))

    def next_batch(self, size: int, *, rank: int = 0, world_size: int = 1) -> dict[str, torch.Tensor]:
        """This rank's `size` samples of the next global batch; every rank advances by size * world_size."""
        if size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"size={size}, rank={rank}, world_size={world_size}: need size, world_size >= 1")
        first = self.position + rank * size
        positions = range(first, first + size)
        labels = torch.tensor([self._label(p) for p in positions], dtype=torch.int64)
        self.position += size * world_size
        batch = {
            "noise": torch.stack([self._noise(p) for p in positions]),
            "cond.class_labels": labels,
            "uncond.class_labels": torch.full_like(labels, self.null_class),
        }
        if self.pairs is not None:
            count = self.pairs["noise"].shape[0]
            index = torch.tensor([self._index("pairs", p, count) for p in positions])
            batch.update({f"regression.{k}": v[index] for k, v in self.pairs.items()})
        if self.real is not None:
            index = torch.tensor([self._index("real", p, len(self.real)) for p in positions])
            batch["real.x0"] = self.real.images[index]
            batch["real.cond.class_labels"] = self.real.labels[index]
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position, "seed": self.seed, "num_labels": int(self.labels.numel())}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key in ("seed", "num_labels"):
            mine = self.state_dict()[key]
            if int(state[key]) != mine:
                raise ValueError(
                    f"digits data state {key} = {state[key]!r} does not match this stream's {mine!r}; fix: "
                    "resume with the data settings the checkpoint was written with"
                )
        position = int(state["position"])
        if position < 0:
            raise ValueError(f"digits data state position = {position}: must be >= 0")
        self.position = position
