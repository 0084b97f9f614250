"""Digits data split, Frechet distance against an independent scipy reference, and the feature classifier."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg
import torch

from verl_dmd.data.digits import load_digits_splits, to_model_range, to_pixel_range
from verl_dmd.eval.digits_classifier import digits_quality, train_digits_classifier
from verl_dmd.eval.fid import feature_statistics, frechet_distance


def scipy_frechet(mu1, s1, mu2, s2):
    """The textbook formula with a general matrix square root (independent of our eigh route)."""
    covmean = scipy.linalg.sqrtm(s1 @ s2).real
    return float(((mu1 - mu2) ** 2).sum() + np.trace(s1 + s2 - 2 * covmean))


def test_split_is_deterministic_stratified_and_scaled():
    """1797 images split 1437/360, every class in both, values in [-1, 1], same split twice."""
    train, holdout = load_digits_splits()
    assert (len(train), len(holdout)) == (1437, 360)
    assert train.images.shape[1:] == (1, 8, 8) and train.images.dtype == torch.float32
    assert train.images.min() == -1.0 and train.images.max() == 1.0
    assert set(holdout.labels.tolist()) == set(range(10))
    again, _ = load_digits_splits()
    assert torch.equal(again.images, train.images) and torch.equal(again.labels, train.labels)
    assert torch.equal(
        to_pixel_range(to_model_range(np.array([0.0, 8.0, 16.0]))), torch.tensor([0.0, 8.0, 16.0])
    )


def test_frechet_distance_matches_scipy_reference():
    """Random correlated Gaussians: our eigh-based value equals scipy's sqrtm formula (rel. 1e-6)."""
    rng = np.random.default_rng(0)
    for dim in (3, 16):
        a, b = rng.normal(size=(200, dim)), rng.normal(size=(200, dim)) @ rng.normal(size=(dim, dim)) + 0.5
        stats_a, stats_b = feature_statistics(a), feature_statistics(b)
        ours, reference = frechet_distance(*stats_a, *stats_b), scipy_frechet(*stats_a, *stats_b)
        assert abs(ours - reference) / reference < 1e-6


def test_frechet_distance_properties():
    """Zero for identical statistics, symmetric, and a pure mean shift d adds |d|^2."""
    rng = np.random.default_rng(1)
    mu, sigma = feature_statistics(rng.normal(size=(100, 5)))
    assert abs(frechet_distance(mu, sigma, mu, sigma)) < 1e-9
    other = feature_statistics(rng.normal(size=(100, 5)) * 2)
    assert frechet_distance(mu, sigma, *other) == pytest.approx(frechet_distance(*other, mu, sigma), rel=1e-9)
    shift = np.arange(5.0)
    assert frechet_distance(mu, sigma, mu + shift, sigma) == pytest.approx(float(shift @ shift), rel=1e-9)
    with pytest.raises(ValueError, match="shape"):
        feature_statistics(np.zeros(4))


@pytest.fixture(scope="module")
def classifier_and_data():
    train, holdout = load_digits_splits()
    return train_digits_classifier(train), train, holdout


def test_classifier_is_accurate_on_holdout(classifier_and_data):
    """The feature classifier is good enough to judge samples: >= 95% on unseen digits."""
    classifier, _, holdout = classifier_and_data
    with torch.no_grad():
        accuracy = (classifier(holdout.images).argmax(1) == holdout.labels).double().mean().item()
    assert accuracy >= 0.95


def test_digits_fid_separates_real_from_noise(classifier_and_data):
    """Real training digits score a small FID and high accuracy against the holdout; noise does not."""
    classifier, train, holdout = classifier_and_data
    real = digits_quality(classifier, train.images[:360], train.labels[:360], holdout)
    noise = digits_quality(classifier, torch.randn(360, 1, 8, 8).clamp(-1, 1), train.labels[:360], holdout)
    assert real["accuracy"] >= 0.95 and noise["accuracy"] < 0.5
    assert noise["fid"] > 20 * real["fid"]
