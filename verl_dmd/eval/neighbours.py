"""Nearest-neighbour measures of a sample set that one FID number cannot show.

- `precision_recall`: k-NN precision and recall (Kynkaanniemi et al., 2019). Each set's
  support is estimated as the union of balls around its points whose radius is the
  distance to the point's k-th nearest neighbour within its own set. Precision is the
  share of samples that fall inside the real support (are the samples realistic?);
  recall the share of real points that fall inside the samples' support (is all of the
  real data covered?). A collapsed generator keeps precision and loses recall.
- `memorisation_ratio`: the median distance of samples to their nearest training
  image over the same median for held-out real images. Held-out images are new
  handwriting of the same distribution, so a ratio near 1 means samples are as
  novel as real data; well below 1 means the samples copy the training set.

Distances are Euclidean and computed in float64; every function is a pure function
of its inputs.
"""

from __future__ import annotations

import numpy as np
import torch


def _as_points(points: torch.Tensor | np.ndarray, name: str) -> torch.Tensor:
    tensor = torch.as_tensor(
        np.asarray(points.detach().cpu() if isinstance(points, torch.Tensor) else points)
    )
    if tensor.ndim < 2 or tensor.shape[0] == 0:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}: need (N, ...) with N >= 1")
    return tensor.reshape(tensor.shape[0], -1).to(torch.float64)


def pairwise_distances(a: torch.Tensor | np.ndarray, b: torch.Tensor | np.ndarray) -> torch.Tensor:
    """(N, M) Euclidean distances between the rows of `a` and `b` (flattened), in float64.

    From the differences, not the ||a||^2 - 2ab + ||b||^2 expansion, so a point's distance
    to an identical point is exactly 0 (the memorisation check relies on it)."""
    a, b = _as_points(a, "a"), _as_points(b, "b")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"points of width {a.shape[1]} and {b.shape[1]}: both sets need the same width")
    rows = [
        torch.linalg.vector_norm(a[i : i + 256, None, :] - b[None], dim=-1) for i in range(0, len(a), 256)
    ]
    return torch.cat(rows)


def knn_radii(points: torch.Tensor | np.ndarray, k: int) -> torch.Tensor:
    """Distance of each point to its k-th nearest neighbour among the other points of its set."""
    distances = pairwise_distances(points, points)
    if not 1 <= k < distances.shape[0]:
        raise ValueError(f"k = {k}: need 1 <= k < the number of points ({distances.shape[0]})")
    # the point itself is its own 0th neighbour (distance 0): the k-th smallest after it
    return distances.kthvalue(k + 1, dim=1).values


def _coverage(queries: torch.Tensor, support: torch.Tensor, radii: torch.Tensor) -> float:
    """Share of `queries` within radius[j] of some support point j."""
    inside = pairwise_distances(queries, support) <= radii[None, :]
    return float(inside.any(dim=1).double().mean())


def precision_recall(real, samples, *, k: int = 5) -> dict[str, float]:
    """k-NN precision and recall of `samples` against `real` (features or images, flattened)."""
    real, samples = _as_points(real, "real"), _as_points(samples, "samples")
    return {
        "precision": _coverage(samples, real, knn_radii(real, k)),
        "recall": _coverage(real, samples, knn_radii(samples, k)),
    }


def nearest_distances(queries, reference) -> torch.Tensor:
    """Distance of each query to its nearest point of `reference`."""
    return pairwise_distances(queries, reference).min(dim=1).values


def memorisation_ratio(samples, train, holdout) -> float:
    """median nearest-training distance of the samples / the same median of held-out real images."""
    held = float(nearest_distances(holdout, train).median())
    if held == 0.0:
        raise ValueError("the held-out images contain a copy of a training image more than half the time")
    return float(nearest_distances(samples, train).median()) / held
