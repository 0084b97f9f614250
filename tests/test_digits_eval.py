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


# ---------------------------------------------------------------- nearest-neighbour measures (issue 21)


def reference_precision_recall(real: np.ndarray, fake: np.ndarray, k: int) -> tuple[float, float]:
    """Kynkaanniemi et al.'s definition written out with loops over points, in float64 numpy."""

    def radii(points):
        return np.array([np.sort(np.sqrt(((points - p) ** 2).sum(1)))[k] for p in points])

    def covered(queries, support, r):
        return np.mean([np.any(np.sqrt(((support - q) ** 2).sum(1)) <= r) for q in queries])

    return covered(fake, real, radii(real)), covered(real, fake, radii(fake))


def test_precision_recall_match_a_loop_reference():
    """Random overlapping clouds of different sizes and spreads: equal to the loop reference."""
    from verl_dmd.eval.neighbours import precision_recall

    rng = np.random.default_rng(3)
    for width, k in ((2, 3), (16, 5)):
        real = rng.normal(size=(120, width))
        fake = rng.normal(size=(90, width)) * 0.8 + 2.0 / width**0.5
        ours = precision_recall(torch.as_tensor(real), fake, k=k)
        reference = reference_precision_recall(real, fake, k)
        assert (ours["precision"], ours["recall"]) == pytest.approx(reference, abs=1e-12)
        assert 0.05 < ours["precision"] < 1.0 and 0.05 < ours["recall"] < 1.0  # neither trivial


def test_precision_recall_see_collapse_and_unreal_samples():
    """Samples = the real set: 1 and 1; samples that collapse onto one real point: precision 1, recall
    small; samples far from the data: 0 and 0."""
    from verl_dmd.eval.neighbours import precision_recall

    rng = np.random.default_rng(4)
    real = rng.normal(size=(200, 8))
    assert precision_recall(real, real, k=5) == {"precision": 1.0, "recall": 1.0}
    collapsed = precision_recall(real, real[:1] + 1e-3 * rng.normal(size=(50, 8)), k=5)
    assert collapsed["precision"] == 1.0 and collapsed["recall"] < 0.05
    assert precision_recall(real, real + 100.0, k=5) == {"precision": 0.0, "recall": 0.0}
    with pytest.raises(ValueError, match="k = 200"):
        precision_recall(real, real, k=200)
    with pytest.raises(ValueError, match="same width"):
        precision_recall(real, real[:, :4], k=5)


def test_memorisation_ratio_flags_copies(classifier_and_data):
    """Copies of training digits score 0, the held-out digits themselves 1, copies with a little pixel
    noise stay well below 1; the median is of exact float64 distances (a loop reference)."""
    from verl_dmd.eval.neighbours import memorisation_ratio, nearest_distances

    _, train, holdout = classifier_and_data
    pixels = [to_pixel_range(s.images) for s in (train, holdout)]
    assert memorisation_ratio(pixels[0][:300], *pixels) == 0.0
    assert memorisation_ratio(pixels[1], *pixels) == 1.0
    jittered = (
        pixels[0][:300] + torch.randn(300, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    ).clamp(0, 16)
    assert 0.1 < memorisation_ratio(jittered, *pixels) < 0.6
    flat = [p.reshape(len(p), -1).double().numpy() for p in (holdout.images[:20], train.images)]
    loop = [min(np.sqrt(((flat[1] - q) ** 2).sum(1))) for q in flat[0]]
    assert nearest_distances(holdout.images[:20], train.images).numpy() == pytest.approx(loop, rel=1e-12)


def test_quality_rows_carry_every_measure(classifier_and_data, tmp_path):
    """A table row of training digits: accurate, precise, and flagged as copies (memorisation 0); the
    table prints every column and the .npz records them."""
    from verl_dmd.eval.digits_report import DigitsEvaluation, format_table

    classifier, train, holdout = classifier_and_data
    evaluation = DigitsEvaluation(classifier, holdout, train, num_samples=100, out_dir=tmp_path)
    index = torch.cat([torch.nonzero(train.labels == c)[:10, 0] for c in range(10)])
    images = train.images[index].reshape(10, 10, 1, 8, 8).transpose(0, 1).reshape(100, 1, 8, 8)  # i mod 10
    row = evaluation.row("real", "none", 0, images)
    assert row.accuracy >= 0.95 and row.precision >= 0.9 and row.memorisation == 0.0 and 0 < row.recall < 1
    table = format_table([row])
    assert "| precision | recall | memorisation |" in table and f"| {row.recall:.3f} | 0.000 |" in table
    saved = np.load(row.samples)
    assert float(saved["recall"]) == row.recall and float(saved["memorisation"]) == 0.0
