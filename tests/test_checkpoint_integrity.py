"""Damaged and hostile checkpoints: with the defaults, a flipped bit in any file of the newest checkpoint is
named and the previous checkpoint resumed; when none is intact the resume is a one-line error that sets
nothing aside; a pickle payload planted in any file a resume or an export reads never runs."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from composite_scenarios import load_each, two_checkpoints
from dist_harness import run_ranks

from verl_dmd.checkpoint.store import MANIFEST, _manifest_digest

pytestmark = pytest.mark.slow


def flip_bit(path: Path) -> None:
    """Flip one bit in the middle of `path` (its size stays)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def published(root: Path) -> list[Path]:
    return sorted(root.glob("global_step_*"), key=lambda p: int(p.name.split("_")[-1]))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict]:
    """Two checkpoints of a 2-rank run (shared layout) and each one's state digest."""
    work = tmp_path_factory.mktemp("saved")
    digests = run_ranks(two_checkpoints, 2, work / "ranks", "shared_base_adapters", str(work / "ckpt"))
    assert digests[0] == digests[1]  # the full tensors, as each rank sees them
    return work / "ckpt", digests[0]


def test_a_flipped_bit_in_any_file_is_named_and_the_previous_checkpoint_resumed(saved, tmp_path):
    root, digests = saved
    older, newer = published(root)
    files = [*sorted(json.loads((newer / MANIFEST).read_text())["files"]), MANIFEST]
    roots = []
    for index, relative in enumerate(files):
        copy = tmp_path / f"flip{index}"
        shutil.copytree(root, copy)
        flip_bit(copy / newer.name / relative)
        roots.append(str(copy))
    results = run_ranks(load_each, 2, tmp_path / "ranks", "shared_base_adapters", roots, {})
    for relative, copy, got in zip(files, roots, results[0], strict=True):
        assert got["error"] is None, (relative, got)
        assert got["step"] == int(older.name.split("_")[-1]), (relative, got)
        assert got["digest"] == digests[older.name], relative  # the older state, bit for bit
        named = [w for w in got["warnings"] if "skipping damaged checkpoint" in w]
        assert named and str(Path(copy) / newer.name / relative) in named[0], (relative, got["warnings"])
        assert not (Path(copy) / newer.name).exists()  # the damaged one is set aside, not read again
        assert any(p.name.startswith(f".set-aside-{newer.name}") for p in Path(copy).iterdir())
    assert [r["step"] for r in results[1]] == [r["step"] for r in results[0]]  # every rank agreed


def test_when_every_checkpoint_is_damaged_auto_is_an_error_and_nothing_is_set_aside(saved, tmp_path):
    root, _ = saved
    copy = tmp_path / "all"
    shutil.copytree(root, copy)
    for checkpoint in published(copy):
        flip_bit(checkpoint / "engine" / "__0_0.distcp")
    before = sorted(p.name for p in copy.iterdir())
    results = run_ranks(load_each, 2, tmp_path / "ranks", "shared_base_adapters", [str(copy)], {})
    for rank_results in results:
        (got,) = rank_results
        assert got["error"] is not None and "\n" not in got["error"], got
        assert "none is intact" in got["error"] and "checkpoint.resume=disable" in got["error"]
        for checkpoint in published(copy):
            assert str(checkpoint / "engine" / "__0_0.distcp") in got["error"]
    assert sorted(p.name for p in copy.iterdir()) == before  # nothing set aside, nothing deleted


def test_a_named_checkpoint_that_is_damaged_is_an_error_not_a_fallback(saved, tmp_path):
    root, _ = saved
    copy = tmp_path / "named"
    shutil.copytree(root, copy)
    newer = published(copy)[-1]
    flip_bit(newer / "rng" / "rank_1.pt")
    results = run_ranks(load_each, 2, tmp_path / "ranks", "shared_base_adapters", [str(copy)],
                        {"checkpoint.resume": str(newer)})  # fmt: skip
    for (got,) in results:
        assert got["error"] is not None and str(newer / "rng" / "rank_1.pt") in got["error"], got
        assert "checkpoint.resume" in got["error"]


# --------------------------------------------------------------------------- planted code


class _Payload:
    """Unpickling this runs `touch <marker>`."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _rewrite_manifest(checkpoint: Path) -> None:
    """What an attacker who can rewrite files does: make the manifest match the planted file."""
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    for relative, entry in manifest["files"].items():
        data = (checkpoint / relative).read_bytes()
        entry.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    manifest["manifest_sha256"] = _manifest_digest(manifest)
    (checkpoint / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def _plant(path: Path, marker: Path, kind: str) -> None:
    if kind == "pickle":  # a bare pickle in place of the file (DCP metadata is one)
        path.write_bytes(pickle.dumps(_Payload(str(marker))))
    else:  # a torch.save archive whose object is the payload (RNG files, DCP data files)
        torch.save({"x": _Payload(str(marker))}, path)


PLANTED = [
    ("engine/.metadata", "pickle"),
    ("engine/__0_0.distcp", "pickle"),
    ("engine/__0_0.distcp", "torch"),
    ("rng/rank_0.pt", "torch"),
    ("rng/rank_0.pt", "pickle"),
]


@pytest.mark.parametrize("verify", [True, False], ids=["verify_hashes", "sizes_only"])
def test_a_planted_pickle_payload_never_runs_on_resume(saved, tmp_path, verify):
    root, _ = saved
    roots, markers = [], []
    for index, (relative, kind) in enumerate(PLANTED):
        copy = tmp_path / f"planted{index}"
        shutil.copytree(root, copy)
        for checkpoint in published(copy)[:-1]:
            shutil.rmtree(checkpoint)  # one checkpoint: nothing to fall back to
        newest = published(copy)[-1]
        marker = tmp_path / f"ran{index}"
        _plant(newest / relative, marker, kind)
        _rewrite_manifest(newest)  # sizes and hashes match: only the loader stands in the way
        roots.append(str(copy))
        markers.append(marker)
    results = run_ranks(load_each, 2, tmp_path / "ranks", "shared_base_adapters", roots,
                        {"checkpoint.verify_hashes": verify})  # fmt: skip
    for (relative, kind), copy, marker, got in zip(PLANTED, roots, markers, results[0], strict=True):
        assert not marker.exists(), (relative, kind)
        assert got["error"] is not None and "\n" not in got["error"], (relative, kind, got)
        assert str(published(Path(copy))[-1] / relative) in got["error"], (relative, kind, got["error"])


def test_a_planted_pickle_payload_never_runs_on_export(saved, tmp_path):
    from verl_dmd.checkpoint.export import read_role_tensors
    from verl_dmd.checkpoint.store import CheckpointError
    from verl_dmd.runtime.naming import RoleTensors

    root, _ = saved
    for relative, kind in [("engine/.metadata", "pickle"), ("engine/__0_0.distcp", "torch")]:
        copy = tmp_path / kind
        shutil.copytree(published(root)[-1], copy)
        marker = tmp_path / f"ran-{kind}"
        _plant(copy / relative, marker, kind)
        _rewrite_manifest(copy)
        with pytest.raises(CheckpointError) as caught:
            read_role_tensors(copy / "engine", RoleTensors(prefix="", adapter=None, model_name=""))
        assert not marker.exists(), relative
        assert str(copy / relative) in str(caught.value) and "\n" not in str(caught.value)


def test_a_named_older_checkpoint_sets_the_newer_ones_aside_however_its_path_is_spelt(saved, tmp_path):
    """Resuming from an explicit older step starts a new timeline in this run's root, also when the path is
    written another way than the root (here through ``..``): the newer step is set aside, so the run can save
    that step again."""
    root, digests = saved
    copy = tmp_path / "spelt"
    shutil.copytree(root, copy)
    older, newer = published(copy)
    spelt = copy / ".." / copy.name / older.name
    results = run_ranks(load_each, 2, tmp_path / "ranks", "shared_base_adapters", [str(copy)],
                        {"checkpoint.resume": str(spelt)})  # fmt: skip
    (got,) = results[0]
    assert got["error"] is None and got["digest"] == digests[older.name], got
    assert not newer.exists() and any(p.name.startswith(f".set-aside-{newer.name}") for p in copy.iterdir())
