"""The digits feature classifier: class accuracy of samples and features for digits-FID."""

from __future__ import annotations

import torch
from torch import nn

from verl_dmd.data.digits import NUM_CLASSES, DigitsSplit, to_pixel_range
from verl_dmd.eval.fid import feature_statistics, frechet_distance
from verl_dmd.seeding import fixed_generator, fixed_global_torch

FEATURE_DIM = 64


class DigitsClassifier(nn.Module):
    """A small CNN on 8x8 digits; `features` is its penultimate layer (FEATURE_DIM wide).

    It reads pixels in 0..16 (the dataset's own range), so samples are clamped to
    that range first, as any image would be before display.
    """

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(64 * 4 * 4, FEATURE_DIM),
            nn.ReLU(),
        )
        self.head = nn.Linear(FEATURE_DIM, NUM_CLASSES)

    def features(self, images: torch.Tensor) -> torch.Tensor:
        return self.body(to_pixel_range(images) / 16.0)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))


def train_digits_classifier(train: DigitsSplit, *, seed: int = 0, epochs: int = 30, batch_size: int = 64):
    """Deterministic training on the training split (seconds on a CPU); returns the model in eval mode.

    The classifier is the instrument behind every digits-FID: its draws are the fixed ones of `seed`
    (`seeding.fixed_generator`), and its init and training run on a forked global RNG, so the caller's
    random state is left as it was."""
    order_stream = fixed_generator(seed)
    with fixed_global_torch(seed):
        model = DigitsClassifier()
        optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
        for _ in range(epochs):
            order = torch.randperm(len(train), generator=order_stream)
            for start in range(0, len(train), batch_size):
                idx = order[start : start + batch_size]
                loss = nn.functional.cross_entropy(model(train.images[idx]), train.labels[idx])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
    return model.eval()


@torch.no_grad()
def digits_quality(
    classifier: DigitsClassifier, samples: torch.Tensor, labels: torch.Tensor, reference: DigitsSplit
) -> dict[str, float]:
    """digits-FID of `samples` against `reference` in classifier features, and the share of
    samples the classifier assigns to the class they were generated for."""
    sample_features = classifier.features(samples)
    accuracy = (classifier.head(sample_features).argmax(dim=1) == labels).double().mean().item()
    fid = frechet_distance(
        *feature_statistics(sample_features), *feature_statistics(classifier.features(reference.images))
    )
    return {"fid": fid, "accuracy": accuracy}
