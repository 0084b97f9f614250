"""Atomic checkpoint publication: manifest, retention, corruption fallback, and SIGKILL at every step."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from verl_dmd.checkpoint.store import (
    FORMAT_VERSION,
    LATEST,
    MANIFEST,
    CheckpointError,
    CheckpointStore,
)

ROOT = Path(__file__).resolve().parents[1]
FILES = [f"model/shard_{i}.bin" for i in range(3)] + ["optim/student.bin", "optim/fake_score.bin",
         "trainer_state.pt", *(f"rng/rank_{r}.pt" for r in range(4))]  # fmt: skip


def write_contents(staging: Path, step: int, hook=lambda point: None) -> None:
    for i, name in enumerate(FILES):
        hook(f"write:{name}")
        path = staging / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes([step % 256, i]) * (100 + 37 * i))


def save(store: CheckpointStore, step: int, **retention) -> Path:
    staging = store.begin(step)
    write_contents(staging, step)
    checkpoint = store.publish(staging, global_step=step, fingerprint="f" * 64, world_size=4,
                               counters={"student_steps": step}, **retention)  # fmt: skip
    return checkpoint.path


def test_publish_writes_a_complete_verified_checkpoint(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt")
    path = save(store, 7)
    assert path.name == "global_step_7" and (tmp_path / "ckpt" / LATEST).read_text() == "global_step_7\n"
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["format_version"] == FORMAT_VERSION and manifest["world_size"] == 4
    assert manifest["counters"] == {"student_steps": 7} and sorted(manifest["files"]) == sorted(FILES)
    assert manifest["files"]["trainer_state.pt"]["size"] == (path / "trainer_state.pt").stat().st_size
    assert store.verify(path, hashes=True).global_step == 7
    assert store.resolve("auto").path == path and store.resolve("disable") is None
    assert store.resolve(str(path)).global_step == 7
    assert not [p for p in (tmp_path / "ckpt").iterdir() if p.name.startswith(".")]
    with pytest.raises(CheckpointError, match="already exists"):
        save(store, 7)


def test_retention_keeps_the_newest_and_every_kth(tmp_path):
    store = CheckpointStore(tmp_path)
    for step in range(1, 10):
        save(store, step, keep_last=2, keep_every=4)
    kept = sorted(int(p.name.split("_")[-1]) for p in tmp_path.glob("global_step_*"))
    assert kept == [4, 8, 9]
    assert store.apply_retention(keep_last=0, keep_every=0) == []  # 0 keeps all


def test_every_manifest_byte_is_covered(tmp_path):
    """Any one-bit edit anywhere in manifest.json (fingerprint and counters included) is detected."""
    store = CheckpointStore(tmp_path)
    manifest = save(store, 1) / MANIFEST
    original = manifest.read_bytes()
    for offset in range(0, len(original), 7):
        data = bytearray(original)
        data[offset] ^= 0x01
        manifest.write_bytes(bytes(data))
        with pytest.raises(CheckpointError, match=r"manifest\.json"):
            store.verify(manifest.parent)
    manifest.write_bytes(original)
    assert store.verify(manifest.parent, hashes=True).global_step == 1


@pytest.mark.parametrize("target", [*FILES, MANIFEST])
def test_a_flipped_byte_is_named_and_auto_falls_back(tmp_path, target):
    store = CheckpointStore(tmp_path)
    save(store, 1)
    newest = save(store, 2)
    file = newest / target
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01
    file.write_bytes(bytes(data))
    if target == MANIFEST:  # unreadable JSON, or readable with a checksum that no longer matches
        with pytest.raises(
            CheckpointError, match=re.escape(str(file)) + ": (unreadable|its checksum does not match)"
        ):
            store.verify(newest, hashes=True)
    else:
        with pytest.raises(CheckpointError, match=re.escape(f"{file}: SHA-256 differs")):
            store.verify(newest, hashes=True)
    with pytest.warns(UserWarning, match="skipping damaged checkpoint: .*global_step_2"):
        assert store.resolve("auto", hashes=True).global_step == 1


def test_truncated_files_manifest_and_latest_are_handled(tmp_path):
    store = CheckpointStore(tmp_path)
    save(store, 1)
    newest = save(store, 2)
    (tmp_path / LATEST).write_text("glob")  # truncated pointer: resolution does not depend on it
    assert store.resolve("auto", hashes=True).global_step == 2
    (tmp_path / LATEST).write_text("")
    assert store.resolve("auto").global_step == 2
    shard = newest / FILES[0]
    shard.write_bytes(shard.read_bytes()[:10])
    with pytest.raises(CheckpointError, match=re.escape(f"{shard}: 10 bytes, the manifest says")):
        store.verify(newest)
    manifest = newest / MANIFEST
    manifest.write_text(manifest.read_text()[:40])
    with pytest.warns(UserWarning, match="manifest.json: unreadable or truncated"):
        assert store.resolve("auto").global_step == 1
    with pytest.raises(CheckpointError, match="unreadable or truncated"):
        store.resolve(str(newest))
    (newest / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match="missing"):
        store.verify(newest)


CHILD = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    from test_checkpoint_store import write_contents
    from verl_dmd.checkpoint.store import CheckpointStore

    kill_at, points = int(sys.argv[1]), []
    def hook(point):
        points.append(point)
        if len(points) == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    store = CheckpointStore(sys.argv[2], fault_hook=hook)
    step = int(sys.argv[3])
    staging = store.begin(step)
    write_contents(staging, step, hook)
    store.publish(staging, global_step=step, fingerprint="f" * 64, world_size=4, keep_last=2)
    print("\\n".join(points))
    """
)


def run_child(kill_at: int, root: Path, step: int) -> subprocess.CompletedProcess:
    code = CHILD.format(tests=str(ROOT / "tests"))
    return subprocess.run([sys.executable, "-c", code, str(kill_at), str(root), str(step)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)  # fmt: skip


def test_sigkill_at_every_point_of_a_save_never_exposes_a_partial_checkpoint(tmp_path):
    """Kill the saving process at each of its steps (writes, hashes, manifest, fsync, rename, pointer,
    retention); auto-resume then finds a complete checkpoint (the previous one until the rename, the
    new one after it), and the next save succeeds and cleans the crash's staging directory."""
    probe = tmp_path / "probe"
    for step in (1, 2):
        assert run_child(0, probe, step).returncode == 0
    points = run_child(0, probe, 3).stdout.split()
    assert len(points) >= 20 and "rename" in points and any(p.startswith("delete:") for p in points)
    for index, point in enumerate(points, start=1):
        root = tmp_path / f"kill_{index}"
        for step in (1, 2):
            assert run_child(0, root, step).returncode == 0
        result = run_child(index, root, 3)
        assert result.returncode == -signal.SIGKILL, (point, result.stderr[-2000:])
        store = CheckpointStore(root)
        found = store.resolve("auto", hashes=True)
        renamed = points.index("rename") < index - 1 or point.startswith(("latest", "retention", "delete"))
        assert found.global_step == (3 if renamed else 2), point
        assert store.verify(found.path, hashes=True)
        staging = [p for p in root.iterdir() if p.name.startswith(".staging-")]
        assert bool(staging) == (not renamed), point
        save(store, 4, keep_last=2)  # training continues: the next save works and cleans up
        assert store.resolve("auto", hashes=True).global_step == 4
        assert not [p for p in root.iterdir() if p.name.startswith(".")]  # staging and pointer temporaries
        assert os.path.isdir(root / "global_step_4")


def test_a_resume_sets_the_abandoned_timeline_aside(tmp_path):
    """Resuming below the newest checkpoint (damaged newer ones, or an explicit older path) hides the
    later ones, so retention, auto-resume and saving those steps again see only the new timeline."""
    store = CheckpointStore(tmp_path)
    for step in (900, 950, 1000):
        save(store, step)
    (tmp_path / "global_step_1000" / FILES[0]).write_bytes(b"x")
    with pytest.warns(UserWarning, match="skipping damaged"):
        resumed = store.resolve("auto")
    assert resumed.global_step == 950
    with pytest.warns(UserWarning, match="global_step_1000"):
        store.set_aside_newer_than(resumed.global_step)
    save(store, 1000, keep_last=1)  # the new run reaches 1000 again: saved, and retention keeps it
    assert sorted(p.name for p in tmp_path.glob("global_step_*")) == ["global_step_1000"]
    assert store.resolve("auto", hashes=True).global_step == 1000
    assert len(list(tmp_path.glob(".set-aside-global_step_1000-*"))) == 1
    with pytest.warns(UserWarning, match="abandoned"):
        assert len(store.set_aside_newer_than(-1)) == 1  # a fresh start (resume=disable) hides all
    assert store.resolve("auto") is None


def test_manifest_step_must_match_the_directory(tmp_path):
    store = CheckpointStore(tmp_path)
    path = save(store, 3)
    path.rename(tmp_path / "global_step_4")
    with pytest.raises(CheckpointError, match="does not match the directory name"):
        store.verify(tmp_path / "global_step_4")


@pytest.mark.parametrize(
    "files",
    [[], {"../outside": {"size": 1, "sha256": "0" * 64}}, {"/etc/passwd": {"size": 1, "sha256": "0" * 64}},
     {"rng/rank_0.pt": {"sha256": "0" * 64}}, {"rng/rank_0.pt": "big"}],
    ids=["not-a-mapping", "dot-dot", "absolute", "no-size", "not-an-entry"],
)  # fmt: skip
def test_a_manifest_whose_file_list_is_malformed_is_refused_in_one_line(tmp_path, files):
    """Even with a matching checksum (someone who rewrites the manifest): no file outside the checkpoint is
    read and the error is a CheckpointError, not a KeyError from deep inside."""
    from verl_dmd.checkpoint.store import _manifest_digest

    path = save(CheckpointStore(tmp_path / "ckpt"), 3)
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["files"] = files
    manifest["manifest_sha256"] = _manifest_digest(manifest)
    (path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"malformed|not a mapping") as caught:
        CheckpointStore.verify(path)
    assert "\n" not in str(caught.value)


def test_a_failed_runs_resume_line_names_what_a_relaunch_would_load(tmp_path, monkeypatch):
    """After a worker failure the trainer says what relaunching the same command starts from, read from
    the checkpoint root as the resume reads it: step 0, the newest intact checkpoint, an explicit older
    one and the newer one it would set aside, a failure when none is intact, the last step's (only the
    final validation and export are left); and it never raises in place of the run's error."""
    from verl_dmd.controller import TooManySkipsError
    from verl_dmd.main import compose_plan
    from verl_dmd.trainer.ray_trainer import DistillationRayTrainer

    root = tmp_path / "checkpoints"
    store = CheckpointStore(root)
    failure = RuntimeError("a worker failed")

    def line(*overrides: str) -> str:
        plan = compose_plan(
            "digits_dmd2", [f"trainer.output_dir={tmp_path}", "trainer.total_steps=6", *overrides]
        )
        return DistillationRayTrainer(plan)._resume_note(failure)

    step = {n: root / f"global_step_{n}" for n in (2, 4, 6)}
    assert line("checkpoint.save_every=0") == (
        "with checkpoint.resume = 'auto', relaunching the same command starts from step 0 (no checkpoint yet; "
        "checkpoint.save_every = 0: only at the end and on a signal)"
    )
    for n in (2, 4):
        save(store, n)
    assert line() == f"relaunching the same command resumes from {step[4]} (global step 4 of 6)"
    plan = compose_plan("digits_dmd2", [f"trainer.output_dir={tmp_path}", "trainer.total_steps=6"])
    assert DistillationRayTrainer(plan)._resume_note(TooManySkipsError("skipped")) == (
        f"relaunching the same command resumes from {step[4]} (global step 4 of 6) and, the run being "
        "deterministic, meets the same non-finite steps again"
    )
    assert line(f"checkpoint.resume={step[2]}") == (
        f"relaunching the same command resumes from {step[2]} (global step 2 of 6); it sets aside the newer "
        f"{step[4]} (global step 4): to continue from that one, relaunch with checkpoint.resume={step[4]}"
    )
    assert line("checkpoint.resume=disable") == (
        "with checkpoint.resume = 'disable', relaunching the same command starts from step 0; the newest "
        f"checkpoint is {step[4]} (global step 4)"
    )
    (step[4] / FILES[0]).write_bytes(b"short")  # damaged: the resume skips it
    assert line() == f"relaunching the same command resumes from {step[2]} (global step 2 of 6)"
    (step[2] / FILES[0]).write_bytes(b"short")
    damaged = line()
    assert damaged.startswith("relaunching the same command fails: no intact checkpoint to resume from (2 "
                              "damaged; the first: "), damaged  # fmt: skip
    save(store, 6)
    assert line() == (
        f"{step[6]} is of the last step (6): relaunching the same command repeats only the final validation and "
        "export"
    )
    assert line("export.at_end=false").endswith("repeats only the final validation")

    def broken(self, resume):
        raise ValueError("global_step 'two' is not a number")

    monkeypatch.setattr(CheckpointStore, "candidates", broken)
    assert line() == (
        "what a relaunch would resume from could not be read (ValueError: global_step 'two' is not a number)"
    )
