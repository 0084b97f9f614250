"""The plan counts its models by content: a teacher moved elsewhere resumes, a changed one does not; a
checkpoint written when the path counted still resumes under that path only; a Wan 2.2 teacher of two
experts is refused before anything starts (and before verl-dmd-prepare encodes anything).

The teachers are copies of the shipped digits teacher (a diffusers save: config.json and safetensors). The
digest cache goes to a folder of each test, and a changed weight is written to a new file that replaces the
old (a new inode), so the cache's file stats can never pass a changed weight off as the old one.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from verl_dmd import main, preflight
from verl_dmd.assets import resolve_model_path
from verl_dmd.main import compose_plan
from verl_dmd.plan import DistillationPlan, PlanError

SHIPPED_TEACHER = Path(resolve_model_path("builtin:digits_teacher"))
WEIGHTS = "diffusion_pytorch_model.safetensors"


@pytest.fixture(autouse=True)
def _own_digest_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VERL_DMD_CACHE_DIR", str(tmp_path / "digest-cache"))


def pipeline(root: Path, **components) -> Path:
    """A pipeline directory holding a copy of the digits teacher as its transformer; `components` are added to
    its model_index.json."""
    shutil.copytree(SHIPPED_TEACHER, root / "transformer")
    index = {
        "_class_name": "DiTPipeline",
        "transformer": ["diffusers", "DiTTransformer2DModel"],
        **components,
    }
    (root / "model_index.json").write_text(json.dumps(index))
    return root


def plan_for(root: Path, *overrides: str) -> DistillationPlan:
    return compose_plan("digits_dmd2", [f"model.teacher.path={root}", "model.teacher.subfolder=transformer",
                                        *overrides])  # fmt: skip


def published(tmp_path: Path, plan: DistillationPlan, *, fingerprint: str | None = None, semantic=None):
    """A checkpoint (no engine state: only its manifest is read here) written under `plan`."""
    from verl_dmd.checkpoint.store import CheckpointStore

    store = CheckpointStore(tmp_path / "ckpt")
    staging = store.begin(1)
    (staging / "trainer_state.json").write_text("{}")
    return store.publish(staging, global_step=1, fingerprint=fingerprint or plan.fingerprint(), world_size=1,
                         extra={"plan": plan.semantic_dict() if semantic is None else semantic})  # fmt: skip


def refusal(checkpoint, plan: DistillationPlan) -> str:
    from verl_dmd.checkpoint.composite import check_plan
    from verl_dmd.checkpoint.store import CheckpointError

    with pytest.raises(CheckpointError) as raised:
        check_plan(checkpoint, plan)
    return str(raised.value)


def change_one_weight(folder: Path) -> None:
    """Add 1 to one value of the first tensor; written to a new file that replaces the old one."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / WEIGHTS)
    name = sorted(tensors)[0]
    tensors[name].view(-1)[0] += 1.0
    save_file(tensors, folder / "changed.safetensors.tmp", metadata={"format": "pt"})
    os.replace(folder / "changed.safetensors.tmp", folder / WEIGHTS)


# --------------------------------------------------------------------------- content, not place


def test_a_teacher_moved_elsewhere_keeps_the_fingerprint_and_resumes(tmp_path):
    """The same teacher in another directory (renamed, or copied and read from another subfolder): the same
    fingerprint, and its checkpoint resumes; the path is no semantic key."""
    from verl_dmd.checkpoint.composite import check_plan

    before = plan_for(pipeline(tmp_path / "site-a" / "pipe"))
    fingerprint, semantic = before.fingerprint(), before.semantic_dict()
    assert "path" not in semantic["model"]["teacher"] and "subfolder" not in semantic["model"]["teacher"]
    checkpoint = published(tmp_path, before)
    moved = tmp_path / "site-b" / "elsewhere"
    moved.parent.mkdir()
    os.rename(tmp_path / "site-a" / "pipe", moved)
    after = plan_for(moved)
    assert after.fingerprint() == fingerprint
    check_plan(checkpoint, after)
    shutil.copytree(moved / "transformer", tmp_path / "bare")
    bare = compose_plan("digits_dmd2", [f"model.teacher.path={tmp_path / 'bare'}"])
    assert bare.fingerprint() == fingerprint
    check_plan(checkpoint, bare)
    identity = bare.teacher_identity()
    assert identity["path"] == str(tmp_path / "bare") and identity["subfolder"] is None
    assert identity["content_sha256"] == semantic["model"]["teacher"]["content_sha256"]


def test_a_changed_teacher_weight_changes_the_fingerprint_and_is_refused(tmp_path):
    root = pipeline(tmp_path / "pipe")
    before = plan_for(root)
    weights_before = before.teacher_identity()["weights_sha256"]
    checkpoint = published(tmp_path, before)
    change_one_weight(root / "transformer")
    after = plan_for(root)  # the same path and plan: the teacher on disk differs
    assert after.teacher_identity()["weights_sha256"] != weights_before
    assert after.fingerprint() != checkpoint.manifest["plan_fingerprint"]
    line = refusal(checkpoint, after)
    assert "model.teacher.content_sha256: checkpoint '" in line and "fix: " in line, line
    assert "model.teacher.path" not in line, line


def test_a_changed_teacher_config_changes_the_fingerprint_and_is_refused(tmp_path):
    root = pipeline(tmp_path / "pipe")
    before = plan_for(root)
    fingerprint, identity = before.fingerprint(), before.teacher_identity()
    checkpoint = published(tmp_path, before)
    config = json.loads((root / "transformer" / "config.json").read_text())
    (root / "transformer" / "config.json").write_text(json.dumps({**config, "norm_eps": 1e-5}))
    after = plan_for(root)
    assert after.fingerprint() != fingerprint
    changed = after.teacher_identity()
    assert changed["weights_sha256"] == identity["weights_sha256"]
    assert changed["config_sha256"] != identity["config_sha256"]
    assert "model.teacher.content_sha256" in refusal(checkpoint, after)


# --------------------------------------------------------------------------- checkpoints of earlier versions


def legacy_semantic(plan: DistillationPlan) -> dict:
    """`plan`'s semantic dict as verl_dmd wrote it before models counted by content: each model's path and
    subfolder as written, no content_sha256."""
    semantic = plan.semantic_dict()
    for role in ("teacher", "student", "fake_score"):
        spec = getattr(plan.model, role)
        entry = semantic["model"][role]
        del entry["content_sha256"]
        entry.update(path=spec.path, subfolder=spec.subfolder)
    return semantic


def test_a_checkpoint_written_when_the_path_counted_resumes_under_that_path_only(tmp_path):
    """Its fingerprint (of the old form) differs from every plan's now, so the semantic dicts decide: the same
    path and subfolder resume, as before; the same teacher elsewhere is refused naming the path, as before."""
    from verl_dmd.checkpoint.composite import check_plan

    root = pipeline(tmp_path / "pipe")
    plan = plan_for(root)
    checkpoint = published(tmp_path, plan, fingerprint="0" * 64, semantic=legacy_semantic(plan))
    check_plan(checkpoint, plan)
    shutil.copytree(root, tmp_path / "copy")
    line = refusal(checkpoint, plan_for(tmp_path / "copy"))
    assert f"model.teacher.path: checkpoint '{root}', now '{tmp_path / 'copy'}'" in line, line
    assert "content_sha256" not in line, line
    line = refusal(checkpoint, plan_for(root, "algorithm.fake_update_ratio=3"))
    assert "algorithm.fake_update_ratio" in line and "model.teacher" not in line, line


def test_the_recorded_legacy_checkpoints_still_match_their_plans():
    """The manifests of tests/fixtures/legacy_checkpoint_1018912 (config-built teachers) hold no content key:
    the plans they were written under show no difference (the slow test resumes them and trains)."""
    from verl_dmd.checkpoint.composite import check_plan
    from verl_dmd.checkpoint.store import CheckpointStore

    fixture = Path(__file__).resolve().parent / "fixtures" / "legacy_checkpoint_1018912"
    tiny = json.dumps(json.loads((fixture / "teacher_config.json").read_text()))
    for layout in ("independent", "shared"):
        overrides = (fixture / layout / "overrides.txt").read_text().split()
        later = (fixture / "later_overrides.txt").read_text().split()  # what changed since, at its old values
        plan = compose_plan("digits_dmd2", [*overrides, *later, f"model.teacher.config={tiny}"])
        checkpoint = CheckpointStore.verify(fixture / layout / "global_step_1")
        assert "content_sha256" not in json.dumps(checkpoint.manifest["plan"]["model"])
        assert plan.fingerprint() != checkpoint.manifest["plan_fingerprint"]  # a new form: compared by keys
        check_plan(checkpoint, plan)


# --------------------------------------------------------------------------- pinned content, the workers


def test_the_workers_plan_carries_the_content_and_reads_no_model(tmp_path):
    """`with_model_contents` (what the ray group sends) pins the content: the same fingerprint, computed where
    the teacher is not at hand; an unpinned plan there fails in one line naming model.teacher.path."""
    root = pipeline(tmp_path / "pipe")
    plan = plan_for(root)
    fingerprint = plan.fingerprint()
    sent = plan.with_model_contents().to_dict()
    assert sent["model"]["teacher"]["content_sha256"] == plan.teacher_identity()["content_sha256"]
    shutil.rmtree(root)
    on_worker = DistillationPlan.from_config(sent)
    assert on_worker.fingerprint() == fingerprint
    with pytest.raises(PlanError) as raised:
        plan_for(root).fingerprint()
    line = str(raised.value)
    assert len(line.splitlines()) == 1 and line.startswith(f"config key 'model.teacher.path' = '{root}': ")
    assert "fix: " in line and "model.teacher.content_sha256" in line
    assert "plan fingerprint: not computed here (config key 'model.teacher.path'" in main.describe(
        plan_for(root)
    )


def test_a_pinned_content_must_be_the_model_s(tmp_path):
    root = pipeline(tmp_path / "pipe")
    content = plan_for(root).teacher_identity()["content_sha256"]
    preflight.check_model_contents(plan_for(root, f"model.teacher.content_sha256={content}"))
    with pytest.raises(PlanError, match=r"config key 'model.teacher.content_sha256' = 'f{64}': the model at "
                       r"model.teacher.path = .* has content [0-9a-f]{64} .*; fix: "):  # fmt: skip
        preflight.check_model_contents(plan_for(root, f"model.teacher.content_sha256={'f' * 64}"))
    with pytest.raises(PlanError, match=r"'model.teacher.content_sha256' = 'abc': must be a SHA-256"):
        plan_for(root, "model.teacher.content_sha256=abc")


def test_an_independent_student_from_a_path_counts_by_content_too(tmp_path):
    root = pipeline(tmp_path / "pipe")
    shutil.copytree(root / "transformer", tmp_path / "student-a")
    plan = plan_for(root, f"model.student.path={tmp_path / 'student-a'}")  # the digits recipe: independent
    fingerprint, semantic = plan.fingerprint(), plan.semantic_dict()
    os.rename(tmp_path / "student-a", tmp_path / "student-b")
    moved = plan_for(root, f"model.student.path={tmp_path / 'student-b'}")
    assert moved.fingerprint() == fingerprint
    change_one_weight(tmp_path / "student-b")
    differences = moved.semantic_differences(semantic)
    assert [key for key, _, _ in differences] == ["model.student.content_sha256"]


# --------------------------------------------------------------------------- Wan 2.2's two experts


def test_a_teacher_pipeline_of_two_experts_is_refused_before_anything_starts(tmp_path, capsys):
    root = pipeline(tmp_path / "wan22", transformer_2=["diffusers", "WanTransformer3DModel"])
    argv = [f"model.teacher.path={root}", "model.teacher.subfolder=transformer",
            f"trainer.output_dir={tmp_path / 'out'}"]  # fmt: skip
    assert main.check_command_line(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"verl-dmd: error: config key 'model.teacher.path' = '{root}': "), lines
    assert "transformer_2 (WanTransformer3DModel)" in lines[0] and "both experts" in lines[0]
    assert "fix: use a pipeline with one transformer" in lines[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("entry", [None, [None, None]])
def test_a_pipeline_whose_second_transformer_is_null_is_accepted(tmp_path, entry):
    """Wan 2.2 TI2V-5B's model_index.json names transformer_2 without a class: one transformer."""
    preflight.check_one_transformer(plan_for(pipeline(tmp_path / "pipe", transformer_2=entry)))


def test_prepare_refuses_a_teacher_pipeline_of_two_experts(tmp_path):
    from verl_dmd.prepare.job import PrepareError, resolve_inputs

    root = pipeline(tmp_path / "wan22", transformer_2=["diffusers", "WanTransformer3DModel"])
    plan = plan_for(root, "model.adapter=wan", f"data.path={tmp_path / 'data'}")
    with pytest.raises(PrepareError, match=r"config key 'model.teacher.path' = .*transformer_2.*; fix: "):
        resolve_inputs(plan)
