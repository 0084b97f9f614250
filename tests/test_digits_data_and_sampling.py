"""The digits condition stream (resumable, world-size free), the samplers, and sample files."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from verl_dmd import losses
from verl_dmd.adapters.base import DistributionMatchingModelAdapter
from verl_dmd.algorithms.sampling import euler_sample, even_schedule, few_step_sample
from verl_dmd.data.digits import DigitsConditionStream, load_digits_splits
from verl_dmd.eval.images import save_grid, save_samples

LABELS = torch.arange(37) % 10


def stream(seed: int = 3) -> DigitsConditionStream:
    return DigitsConditionStream(LABELS, null_class=10, seed=seed)


def cat(*batches):
    return {k: torch.cat([b[k] for b in batches]) for k in batches[0]}


def test_stream_is_the_same_at_every_world_size():
    """Two ranks of 5 per step read exactly what one rank of 10 per step reads, in order."""
    one, (r0, r1) = stream(), (stream(), stream())
    for _ in range(6):  # crosses epoch boundaries (37 labels)
        whole = one.next_batch(10)
        parts = cat(r0.next_batch(5, rank=0, world_size=2), r1.next_batch(5, rank=1, world_size=2))
        for key in whole:
            assert torch.equal(whole[key], parts[key]), key
    assert one.position == r0.position == r1.position == 60


def test_stream_resumes_exactly_and_covers_each_epoch_once():
    straight = stream()
    first = [straight.next_batch(8) for _ in range(3)]
    later = [straight.next_batch(8) for _ in range(4)]
    resumed = stream()
    resumed.load_state_dict({"position": 24, "seed": 3, "num_labels": 37})
    for expected in later:
        got = resumed.next_batch(8)
        assert all(torch.equal(got[k], expected[k]) for k in got)
    seen = torch.cat(
        [b["cond.class_labels"] for b in first]
    )  # 24 of epoch 0: no label more often than it exists
    assert (torch.bincount(seen, minlength=10) <= torch.bincount(LABELS, minlength=10)).all()
    full = stream().next_batch(37)["cond.class_labels"]
    assert torch.equal(full.sort().values, LABELS.sort().values)  # one epoch = every label once
    again = stream().next_batch(37)
    assert torch.equal(again["cond.class_labels"], full)
    assert not torch.equal(stream(seed=4).next_batch(37)["cond.class_labels"], full)
    assert torch.equal(again["uncond.class_labels"], torch.full((37,), 10))
    noise = again["noise"]
    assert noise.shape == (37, 1, 8, 8) and noise.std().item() == pytest.approx(1.0, abs=0.1)


def test_stream_rejects_bad_state_and_sizes():
    s = stream()
    with pytest.raises(ValueError, match="seed = 9"):
        s.load_state_dict({"position": 0, "seed": 9, "num_labels": 37})
    with pytest.raises(ValueError, match="num_labels"):
        s.load_state_dict({"position": 0, "seed": 3, "num_labels": 36})
    with pytest.raises(ValueError, match="position = -1"):
        s.load_state_dict({"position": -1, "seed": 3, "num_labels": 37})
    with pytest.raises(ValueError, match="rank=2"):
        s.next_batch(4, rank=2, world_size=2)
    train, _ = load_digits_splits()
    real = DigitsConditionStream(train.labels, null_class=10, seed=0)
    assert real.next_batch(2)["cond.class_labels"].dtype == torch.int64


class PointMass(DistributionMatchingModelAdapter):
    """The exact velocity field of data concentrated at `center`: v = (x_t - center) / sigma."""

    def __init__(self, center: torch.Tensor, uncond_center: torch.Tensor | None = None) -> None:
        self.center, self.uncond_center = center, uncond_center

    def predict(self, module, x_t, sigma, cond):
        center = self.uncond_center if cond.get("uncond") else self.center
        return (x_t - center) / sigma.view(-1, 1, 1, 1)


def test_samplers_reach_the_point_mass_exactly():
    """With the exact field of a point mass every sampler lands on it, at any step count."""
    center = torch.randn(1, 1, 8, 8, dtype=torch.float64)
    noise = torch.randn(6, 1, 8, 8, dtype=torch.float64)
    adapter = PointMass(center)
    for steps in (1, 2, 5):
        x = euler_sample(adapter, None, noise, {}, steps)
        assert torch.allclose(x, center.expand_as(x), rtol=0, atol=1e-12)
        y = few_step_sample(adapter, None, noise, {}, even_schedule(steps), torch.Generator().manual_seed(0))
        assert torch.allclose(y, center.expand_as(y), rtol=0, atol=1e-12)
    shifted = even_schedule(4, shift=3.0)
    assert shifted[0] == 1.0 and shifted[-1] == 0.0 and (shifted.diff() < 0).all()
    assert torch.allclose(shifted, losses.student_sigma_schedule(4, shift=3.0))


def test_euler_guidance_follows_standard_cfg():
    """Two point masses (cond c, uncond u): guided Euler with scale s lands on u + s (c - u)."""
    c, u = torch.ones(1, 1, 8, 8, dtype=torch.float64), torch.zeros(1, 1, 8, 8, dtype=torch.float64)
    adapter = PointMass(c, u)
    noise = torch.randn(3, 1, 8, 8, dtype=torch.float64)
    x = euler_sample(adapter, None, noise, {}, 4, guidance=3.0, uncond={"uncond": True})
    assert torch.allclose(x, (u + 3.0 * (c - u)).expand_as(x), atol=1e-12)
    with pytest.raises(ValueError, match="unconditional"):
        euler_sample(adapter, None, noise, {}, 4, guidance=2.0)
    with pytest.raises(ValueError, match="ending in 0"):
        few_step_sample(adapter, None, noise, {}, [1.0, 0.5], torch.Generator())


def test_samples_and_grid_files(tmp_path):
    images = torch.linspace(-1, 1, 12 * 64).reshape(12, 1, 8, 8)
    labels = torch.arange(12) % 10
    path = save_samples(tmp_path / "s" / "x.npz", images, labels, steps=4, fid=1.5)
    with np.load(path, allow_pickle=False) as data:
        assert np.array_equal(data["images"], images.numpy()) and np.array_equal(
            data["labels"], labels.numpy()
        )
        assert int(data["steps"]) == 4 and float(data["fid"]) == 1.5
    png = save_grid(tmp_path / "g.png", images, nrow=5)
    picture = Image.open(png)
    assert picture.size == ((5 * 9 + 1) * 4, (3 * 9 + 1) * 4) and picture.mode == "L"
    pixels = np.asarray(picture)
    assert pixels[4:8, 4:8].min() == 0 and pixels.max() == 255  # first image starts black, last ends white
    with pytest.raises(ValueError, match="expected"):
        save_grid(tmp_path / "bad.png", images[:, 0], nrow=5)


def test_dit_adapter_turns_label_dropout_off():
    """diffusers' DiT drops labels in train mode from the global RNG; the adapter's models never do."""
    from verl_dmd.adapters import get_adapter
    from verl_dmd.adapters.base import ModelSource
    from verl_dmd.adapters.diffusers_transformers import set_label_dropout

    adapter = get_adapter("dit")()
    model = adapter.build_model(ModelSource(config=adapter.tiny_config)).train()
    x = torch.randn(64, 1, 8, 8)
    sigma, cond = torch.full((64,), 0.5), {"class_labels": torch.arange(64) % 10}
    torch.manual_seed(0)
    first = adapter.predict(model, x, sigma, cond)
    state = torch.get_rng_state()
    torch.manual_seed(1)
    second = adapter.predict(model, x, sigma, cond)
    assert torch.equal(first, second)
    torch.manual_seed(0)
    adapter.predict(model, x, sigma, cond)
    assert torch.equal(torch.get_rng_state(), state)  # no global draws
    set_label_dropout(model, 0.1)  # diffusers' default
    torch.manual_seed(1)
    assert not torch.equal(adapter.predict(model, x, sigma, cond), first)


def test_builtin_teacher_asset_resolves_and_loads():
    from verl_dmd.adapters import get_adapter
    from verl_dmd.adapters.base import ModelSource
    from verl_dmd.assets import builtin_models, resolve_model_path

    assert "digits_teacher" in builtin_models()
    assert resolve_model_path("/some/dir") == "/some/dir"
    model = get_adapter("dit")().build_model(ModelSource(path="builtin:digits_teacher"))
    assert model.config.num_layers == 4 and sum(p.numel() for p in model.parameters()) > 300_000
    with pytest.raises(ValueError, match="allowed: builtin:digits_teacher"):
        resolve_model_path("builtin:other")


def test_pairs_ride_along_world_size_free_and_are_checked():
    """With pairs, each sample also carries one (noise, target, label) pair, same at any world size."""
    from verl_dmd.data.digits import check_pairs

    center = torch.randn(1, 1, 8, 8)
    labels = torch.arange(7) % 10
    noise = torch.randn(7, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    target = euler_sample(PointMass(center), None, noise, {"class_labels": labels}, 2)
    pairs = {"noise": noise, "target": target, "cond.class_labels": labels}
    assert torch.allclose(pairs["target"], center.expand(7, 1, 8, 8), atol=1e-5)
    assert check_pairs(pairs, "test") is not pairs
    one = DigitsConditionStream(LABELS, null_class=10, seed=3, pairs=pairs)
    r0, r1 = (DigitsConditionStream(LABELS, null_class=10, seed=3, pairs=pairs) for _ in range(2))
    seen = []
    for _ in range(3):
        whole = one.next_batch(6)
        parts = cat(r0.next_batch(3, rank=0, world_size=2), r1.next_batch(3, rank=1, world_size=2))
        assert all(torch.equal(whole[k], parts[k]) for k in whole)
        seen.append(whole["regression.noise"])
    assert set(whole) == {"noise", "cond.class_labels", "uncond.class_labels", "regression.noise",
                          "regression.target", "regression.cond.class_labels"}  # fmt: skip
    first_epoch = torch.cat(seen)[:7]  # 7 pairs: the first 7 positions use each pair once
    assert sorted(first_epoch[:, 0, 0, 0].tolist()) == sorted(pairs["noise"][:, 0, 0, 0].tolist())
    bad = [
        ({k: v for k, v in pairs.items() if k != "target"}, "missing target"),
        ({**pairs, "target": pairs["target"][:3]}, "target has shape"),
        ({**pairs, "noise": pairs["noise"] * float("nan")}, "non-finite"),
        ({**pairs, "cond.class_labels": pairs["cond.class_labels"] + 10}, "integers in"),
    ]
    for broken, message in bad:
        with pytest.raises(ValueError, match=message):
            check_pairs(broken, "'x.safetensors'")


def test_stream_takes_any_seed():
    """Seeds are mixed into 64-bit generator seeds; large ones are hashed down first (no overflow)."""
    for seed in (0, 2**23 - 1, 2**23, 2**40, 2**62):
        batch = DigitsConditionStream(LABELS, null_class=10, seed=seed).next_batch(3)
        assert batch["noise"].shape == (3, 1, 8, 8)
    big = [
        DigitsConditionStream(LABELS, null_class=10, seed=s).next_batch(5)["noise"] for s in (2**40, 2**41)
    ]
    assert not torch.equal(*big)
    with pytest.raises(ValueError, match="seed = -1"):
        DigitsConditionStream(LABELS, null_class=10, seed=-1)


def test_the_seed_reaches_every_random_stream():
    """torch's CPU generator keeps only a seed's low 32 bits: every stream must still depend on the seed,
    and the label, pair and real-data orders must be independent of each other."""
    pairs = {
        "noise": torch.randn(37, 1, 8, 8),
        "target": torch.randn(37, 1, 8, 8),
        "cond.class_labels": LABELS,
    }
    a, b = (DigitsConditionStream(LABELS, null_class=10, seed=s, pairs=pairs).next_batch(37) for s in (0, 1))
    for key in ("noise", "cond.class_labels", "regression.noise"):
        assert not torch.equal(a[key], b[key]), key
    order = [int(torch.nonzero((pairs["noise"] == n).all(dim=(1, 2, 3)))[0]) for n in a["regression.noise"]]
    assert not torch.equal(torch.tensor(order) % 10, a["cond.class_labels"])  # pairs not tied to labels
