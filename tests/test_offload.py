"""Sleep/wake of every role's state (verl_dmd.runtime.offload) on CPU: identity and bitwise training."""

from __future__ import annotations

import re

import pytest
from composite_scenarios import (
    PHASES,
    coalesced,
    coalesced_again,
    loaded_snapshot,
    plain_run,
    session_offload_settings,
    sharding_variant,
    sleep_wake,
)
from dist_harness import run_ranks
from test_checkpoint_composite import assert_equal_state

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("layout", ["shared_base_adapters", "independent"])
def test_sleep_wake_preserves_everything_and_training_continues_bitwise(tmp_path, layout):
    """2 gloo ranks: after a sleep every storage of the state is freed and gradients are dropped; after
    the wake, parameter objects, optimizer bindings, DTensor specs, local shapes, strides, dtypes,
    padded storage sizes, requires_grad, storage sharing and every value are as before; and training
    with a sleep/wake before every phase equals training without (bit for bit). Small storages move
    as one staged block, the others one by one; the threshold is set so both paths run."""
    with_sleep = run_ranks(sleep_wake, 2, tmp_path / "a", layout, True)
    without = run_ranks(plain_run, 2, tmp_path / "b", layout, 2 * PHASES)
    for rank in (0, 1):
        got = with_sleep[rank]
        assert got["mismatches"] == [], got["mismatches"]
        assert got["freed"] and got["grads_dropped"] and got["bytes"] > 0
        # storages moved as the staged block, one by one, and after coalescing into shared buffers
        assert min(got["paths"]) > 0, got["paths"]
        assert_equal_state(got["final"], without[rank], f"rank {rank}")


@pytest.mark.parametrize("layout", ["shared_base_adapters", "independent"])
def test_coalescing_small_storages_keeps_every_tensor_and_training_and_checkpoints_exact(tmp_path, layout):
    """2 gloo ranks: coalescing moves the small storages into shared buffers (fewer storages) while
    parameter objects, optimizer bindings, DTensor specs, shapes, strides, dtypes, requires_grad, values
    and which tensors overlap stay as they were; training after it (with sleep/wake before every phase)
    equals training without, bit for bit; a checkpoint saved after it loads back to the same state."""
    got = run_ranks(coalesced, 2, tmp_path / "a", layout, str(tmp_path / "ckpt"))
    without = run_ranks(plain_run, 2, tmp_path / "b", layout, 2 * PHASES)
    loaded = run_ranks(loaded_snapshot, 2, tmp_path / "c", layout, str(tmp_path / "ckpt"))
    for rank in (0, 1):
        result = got[rank]
        assert result["mismatches"] == [], result["mismatches"]
        before, after = result["storages"]
        # every storage of the tiny model is below the limit, and all of them fit in one shared buffer
        assert (result["moved"], after) == (before, 1), (result["moved"], before, after)
        assert result["recoalesced"] == 0  # nothing small left to move
        assert_equal_state(result["final"], without[rank], f"rank {rank}")
        assert_equal_state(loaded[rank], result["final"], f"rank {rank}: loaded checkpoint")


@pytest.mark.parametrize("layout", ["shared_base_adapters", "independent"])
def test_coalescing_again_at_offsets_with_mixed_dtypes_and_an_outside_holder(tmp_path, layout):
    """2 gloo ranks, frozen weights in bfloat16: coalescing in 4 KB runs before any optimizer state, then
    again when AdamW made its state (moving the first shared buffers, tensors at non-zero offsets), with
    a sleep/wake before every phase, trains bit for bit like no coalescing; a storage with a holder
    outside the state is left in place (its outside view still sees the parameter); coalescing while
    asleep is refused."""
    overrides = {"model.param_dtype": "bfloat16"}
    got = run_ranks(coalesced_again, 2, tmp_path / "a", layout, overrides)
    without = run_ranks(sharding_variant, 2, tmp_path / "b", layout, overrides)
    for rank in (0, 1):
        result = got[rank]
        assert result["first"] > 10 and result["first_rejected"] == 1, result
        assert result["later"]["moved"] > 0, result["later"]
        assert result["extra_aliased"]
        assert "while asleep" in (result["asleep_error"] or "")
        assert_equal_state(result["final"], without[rank], f"rank {rank}")


@pytest.mark.parametrize(
    ("conf", "works"),
    [
        ("", True),
        ("garbage_collection_threshold:0.6", True),
        ("max_split_size_mb:512", False),
        ("expandable_segments:True", False),
        ("backend:cudaMallocAsync", False),
        ("roundup_power2_divisions:4", False),
    ],
)
def test_packing_is_skipped_under_allocator_settings_that_stop_it(monkeypatch, conf, works):
    """Packing needs the default allocator to split one reserved block; these settings prevent it
    (oversize blocks never split, other rounding, another allocator), so wake allocates as usual."""
    from verl_dmd.runtime.offload import _packing_works

    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
    assert _packing_works() is works
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", conf)
    assert _packing_works() is works


@pytest.mark.parametrize(
    ("sizes", "target"),
    [([], 10), ([3], 10), ([4, 4, 4, 4, 4], 10), ([10, 10, 1], 10), ([25, 1, 1, 30, 2], 10), ([1] * 7, 3)],
)
def test_packed_runs_cover_every_storage_once_in_order(sizes, target):
    """A packed wake reserves one segment per run: runs are consecutive, cover every storage once, sum
    their sizes, and every run but the last holds at least the target and less than target + its last."""
    from verl_dmd.runtime.offload import plan_chunks

    chunks = plan_chunks(sizes, target)
    assert [i for _, start, end in chunks for i in range(start, end)] == list(range(len(sizes)))
    for number, (total, start, end) in enumerate(chunks):
        assert end > start and total == sum(sizes[start:end])
        if number < len(chunks) - 1:
            assert target <= total < target + sizes[end - 1]


@pytest.mark.parametrize("packing", [True, False])
def test_resources_offload_packing_reaches_the_workers_offloader(tmp_path, packing):
    """`resources.offload_packing=false` turns packing and coalescing off in the worker's session."""
    (got,) = run_ranks(session_offload_settings, 1, tmp_path, "shared_base_adapters", packing)
    assert got["pack"] is packing
    assert (got["coalesce_below"] > 0) is packing and (got["moved"] > 0) is packing


@pytest.mark.parametrize("layout", ["shared_base_adapters", "independent"])
def test_gpu_check_script_passes_on_cpu(layout):
    """scripts/check_sleep_training.py (the GPU check of bitwise training with sleep/wake before every
    phase, and of AdamW on the local shards vs on the DTensors) runs on CPU too: four runs, coalescing
    included, equal bit for bit. Two blocks of width 128 (the script's GPU default is 4 of 256): the
    same code paths, a quarter of the CPU time."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [
            sys.executable,
            "scripts/check_sleep_training.py",
            "--device",
            "cpu",
            "--layout",
            layout,
            "--phases",
            "4",
            "--layers",
            "2",
            "--hidden",
            "128",
        ],
        capture_output=True,
        text=True,
        cwd=root,
        timeout=300,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "PASS" in result.stdout and " 0 left in place" in result.stdout, result.stdout
    coalesced = re.search(r"; (\d+) coalesced over the run", result.stdout)
    assert coalesced and int(coalesced.group(1)) > 0, result.stdout  # the small storages were packed


@pytest.mark.parametrize("layout", ["shared_base_adapters", "independent"])
def test_adamw_on_local_shards_equals_the_dtensor_step(tmp_path, layout):
    """2 gloo ranks, learning rates changing every step: AdamW stepped on the local shards (the default)
    trains bit for bit like the optimizer's own step on the DTensors, including after a state tensor
    was replaced and after the models' local tensors were swapped by `.to()` (a new shadow each time);
    the first step of each role is the real one (AdamW makes its state there)."""
    from composite_scenarios import optimizer_step_path

    local = run_ranks(optimizer_step_path, 2, tmp_path / "a", layout, True)
    dtensor = run_ranks(optimizer_step_path, 2, tmp_path / "b", layout, False)
    for rank in (0, 1):
        assert_equal_state(local[rank]["final"], dtensor[rank]["final"], f"rank {rank}")
        for role, counts in local[rank]["counts"].items():
            assert counts["real"] == 1 and counts["local"] >= 2 and counts["built"] == 3, (role, counts)
        assert all(c == {"local": 0, "real": 0, "built": 0} for c in dtensor[rank]["counts"].values())


def test_local_adamw_step_leaves_step_wrappers_and_replaced_state_alone(tmp_path):
    """A wrapper put on `optimizer.step` (other than the LR scheduler's) sees every step: the real step
    runs while it is there, the local one again once it is gone; a moment replaced by a load-like copy
    is freed by the next sleep, not kept on the device by a stale shadow."""
    from composite_scenarios import optimizer_step_guards

    for rank, result in enumerate(run_ranks(optimizer_step_guards, 2, tmp_path, "shared_base_adapters")):
        wrapped, unwrapped = result["wrapped"], result["unwrapped"]
        assert result["calls"] == wrapped["real"] > 0 and wrapped["local"] == 0, (rank, result)
        assert unwrapped["local"] > 0 and unwrapped["real"] == 0, (rank, result)
        assert result["replaced_alive"] == 0, (rank, result)
