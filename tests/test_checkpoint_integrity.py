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


# --------------------------------------------------------------------------- damaged files


def _copy(root: Path, into: Path) -> Path:
    shutil.copytree(root, into)
    return into


def flip_cases(root: Path, work: Path) -> list[tuple[str, Path, dict]]:
    """A copy of the two checkpoints per file of the newer one (the manifest included), that file flipped."""
    newer = published(root)[-1]
    files = [*sorted(json.loads((newer / MANIFEST).read_text())["files"]), MANIFEST]
    cases = []
    for index, relative in enumerate(files):
        copy = _copy(root, work / f"flip{index}")
        flip_bit(copy / newer.name / relative)
        cases.append((relative, copy, {}))
    return cases


def planted_cases(root: Path, work: Path, verify: bool) -> list[tuple[tuple[str, str], Path, dict]]:
    """One checkpoint per planted file, the manifest rewritten to match."""
    cases = []
    for index, (relative, kind) in enumerate(PLANTED):
        copy = _copy(root, work / f"planted{int(verify)}-{index}")
        for checkpoint in published(copy)[:-1]:
            shutil.rmtree(checkpoint)  # one checkpoint: nothing to fall back to
        newest = published(copy)[-1]
        _plant(newest / relative, work / f"ran{int(verify)}-{index}", kind)
        _rewrite_manifest(newest)  # sizes and hashes match: only the loader stands in the way
        cases.append(((relative, kind), copy, {"checkpoint.verify_hashes": verify}))
    return cases


@pytest.fixture(scope="module")
def loads(saved, tmp_path_factory) -> dict:
    """Every resume scenario of this file, prepared here and loaded in one 2-rank spawn (a stack per plan)."""
    root, _ = saved
    work = tmp_path_factory.mktemp("loads")
    scenarios = {"flip": flip_cases(root, work)}
    everything = _copy(root, work / "all")
    for checkpoint in published(everything):
        flip_bit(checkpoint / "engine" / "__0_0.distcp")
    scenarios["all"] = [("all", everything, {})]
    named = _copy(root, work / "named")
    flip_bit(published(named)[-1] / "rng" / "rank_1.pt")
    scenarios["named"] = [("named", named, {"checkpoint.resume": str(published(named)[-1])})]
    spelt = _copy(root, work / "spelt")
    older = published(spelt)[0]
    scenarios["spelt"] = [
        ("spelt", spelt, {"checkpoint.resume": str(spelt / ".." / spelt.name / older.name)})
    ]
    for verify in (True, False):
        scenarios[f"planted-{verify}"] = planted_cases(root, work, verify)
    listing = {
        name: sorted(p.name for p in case[1].iterdir()) for name in ("all",) for case in scenarios[name]
    }
    cases = [(str(case[1]), case[2]) for group in scenarios.values() for case in group]
    results = run_ranks(load_each, 2, work / "ranks", "shared_base_adapters", cases)
    out, index = {}, 0
    for name, group in scenarios.items():
        out[name] = [(case[0], case[1], [r[index + i] for r in results]) for i, case in enumerate(group)]
        index += len(group)
    out["listing"] = listing
    out["markers"] = work
    return out


def test_a_flipped_bit_in_any_file_is_named_and_the_previous_checkpoint_resumed(saved, loads):
    _, digests = saved
    for relative, copy, per_rank in loads["flip"]:
        older, newer_name = published(copy)[0], published(saved[0])[-1].name
        for got in per_rank:  # every rank agreed
            assert got["error"] is None, (relative, got)
            assert got["step"] == int(older.name.split("_")[-1]), (relative, got)
            assert got["digest"] == digests[older.name], relative  # the older state, bit for bit
        named = [w for w in per_rank[0]["warnings"] if "skipping damaged checkpoint" in w]
        assert named and str(copy / newer_name / relative) in named[0], (relative, per_rank[0]["warnings"])
        assert not (copy / newer_name).exists()  # the damaged one is set aside, not read again
        assert any(p.name.startswith(f".set-aside-{newer_name}") for p in copy.iterdir())


def test_when_every_checkpoint_is_damaged_auto_is_an_error_and_nothing_is_set_aside(loads):
    ((_, copy, per_rank),) = loads["all"]
    for got in per_rank:
        assert got["error"] is not None and "\n" not in got["error"], got
        assert "none is intact" in got["error"] and "checkpoint.resume=disable" in got["error"]
        for checkpoint in published(copy):
            assert str(checkpoint / "engine" / "__0_0.distcp") in got["error"]
    assert sorted(p.name for p in copy.iterdir()) == loads["listing"]["all"]  # nothing set aside or deleted


def test_a_named_checkpoint_that_is_damaged_is_an_error_not_a_fallback(loads):
    ((_, copy, per_rank),) = loads["named"]
    newer = published(copy)[-1]
    for got in per_rank:
        assert got["error"] is not None and str(newer / "rng" / "rank_1.pt") in got["error"], got
        assert "checkpoint.resume" in got["error"]


def test_a_named_older_checkpoint_sets_the_newer_ones_aside_however_its_path_is_spelt(saved, loads):
    """Resuming from an explicit older step starts a new timeline in this run's root, also when the path is
    written another way than the root (here through ``..``): the newer step is set aside, so the run can save
    that step again."""
    _, digests = saved
    ((_, copy, per_rank),) = loads["spelt"]
    older_name, newer_name = (p.name for p in published(saved[0]))
    assert per_rank[0]["error"] is None and per_rank[0]["digest"] == digests[older_name], per_rank[0]
    assert not (copy / newer_name).exists()
    assert any(p.name.startswith(f".set-aside-{newer_name}") for p in copy.iterdir())


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
def test_a_planted_pickle_payload_never_runs_on_resume(loads, verify):
    for index, ((relative, kind), copy, per_rank) in enumerate(loads[f"planted-{verify}"]):
        assert not (loads["markers"] / f"ran{int(verify)}-{index}").exists(), (relative, kind)
        got = per_rank[0]
        assert got["error"] is not None and "\n" not in got["error"], (relative, kind, got)
        assert str(published(copy)[-1] / relative) in got["error"], (relative, kind, got["error"])


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
