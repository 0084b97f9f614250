"""Frechet distance between two Gaussians fitted to feature sets (the FID formula), in float64."""

from __future__ import annotations

import numpy as np
import torch


def feature_statistics(features: torch.Tensor | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and (unbiased) covariance of (N, D) features, as float64 arrays."""
    array = np.asarray(
        features.detach().cpu() if isinstance(features, torch.Tensor) else features, np.float64
    )
    if array.ndim != 2 or array.shape[0] < 2:
        raise ValueError(f"features have shape {array.shape}: need (N, D) with N >= 2")
    return array.mean(axis=0), np.cov(array, rowvar=False)


def _sqrt_psd(matrix: np.ndarray) -> np.ndarray:
    values, vectors = np.linalg.eigh((matrix + matrix.T) / 2)
    return (vectors * np.sqrt(np.clip(values, 0.0, None))) @ vectors.T


def frechet_distance(mu1: np.ndarray, sigma1: np.ndarray, mu2: np.ndarray, sigma2: np.ndarray) -> float:
    """||mu1 - mu2||^2 + Tr(S1 + S2 - 2 (S1 S2)^(1/2)).

    Tr((S1 S2)^(1/2)) is computed as Tr((A S2 A)^(1/2)) with A = S1^(1/2): A S2 A is
    symmetric positive semi-definite, so its square root comes from an
    eigendecomposition with no complex round-off (unlike a general sqrtm).
    """
    mu1, mu2 = np.asarray(mu1, np.float64), np.asarray(mu2, np.float64)
    sigma1, sigma2 = np.asarray(sigma1, np.float64), np.asarray(sigma2, np.float64)
    if mu1.shape != mu2.shape or sigma1.shape != sigma2.shape or sigma1.shape != (mu1.size, mu1.size):
        raise ValueError(
            f"shapes disagree: mu {mu1.shape} vs {mu2.shape}, sigma {sigma1.shape} vs {sigma2.shape}"
        )
    root = _sqrt_psd(sigma1)
    middle = root @ sigma2 @ root
    trace_sqrt = float(np.sqrt(np.clip(np.linalg.eigvalsh((middle + middle.T) / 2), 0.0, None)).sum())
    diff = mu1 - mu2
    return float(diff @ diff + np.trace(sigma1) + np.trace(sigma2) - 2.0 * trace_sqrt)
