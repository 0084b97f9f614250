"""Export round trips: what verl-dmd-export writes loads with peft and diffusers and reproduces the role."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from dist_harness import run_ranks
from export_scenarios import export_plan, fixed_inputs, train_and_save

from verl_dmd.adapters import get_adapter
from verl_dmd.checkpoint.export import (
    DIFFUSERS_DIR,
    DIFFUSERS_LORA_WEIGHTS,
    EXPORT_INFO,
    PEFT_DIR,
    PIPELINE_DIR,
    ExportError,
    check_finite,
    export_checkpoint,
)
from verl_dmd.checkpoint.store import CheckpointError, file_sha256

TOLERANCE = 1e-5  # fp32, max abs error (the acceptance bound)
NO_TEXT_OR_VAE = {name: None for name in ("vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2",
                                          "text_encoder_3", "tokenizer_3")}  # fmt: skip


def save_teacher(family: str, directory) -> str:
    return save_teacher_seeded(family, directory, seed=3)


def save_teacher_seeded(family: str, directory, seed: int) -> str:
    adapter = get_adapter(family)()
    torch.manual_seed(seed)
    adapter.model_class.from_config(adapter.tiny_config).save_pretrained(str(directory))
    return str(directory)


def fake_pipeline(directory, teacher_dir) -> str:
    """A diffusers pipeline directory: model_index.json, a scheduler and the teacher transformer."""
    directory.mkdir()
    index = {"_class_name": "StableDiffusion3Pipeline", "_diffusers_version": "0.42.1",
             "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
             "transformer": ["diffusers", "SD3Transformer2DModel"]}  # fmt: skip
    (directory / "model_index.json").write_text(json.dumps(index))
    (directory / "scheduler").mkdir()
    (directory / "scheduler" / "scheduler_config.json").write_text(
        '{"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0, "use_dynamic_shifting": true}'
    )
    os.symlink(teacher_dir, directory / "transformer")
    return str(directory)


def predict(family: str, model) -> torch.Tensor:
    adapter = get_adapter(family)()
    model.eval()
    with torch.no_grad():
        x, sigma, cond = fixed_inputs(adapter, model)
        return adapter.predict(model, x, sigma, cond)


def max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max())


def weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a saved diffusers model directory (one safetensors file here)."""
    import safetensors.torch

    (file,) = sorted(directory.glob("*.safetensors"))
    return safetensors.torch.load_file(str(file))


def assert_rounded_bitwise(got: dict[str, torch.Tensor], full: dict[str, torch.Tensor]) -> None:
    """`got` is `full` rounded to bfloat16, every bit of every tensor (and not merely equal as numbers)."""
    assert got.keys() == full.keys()
    for name, tensor in got.items():
        assert tensor.dtype == torch.bfloat16, name
        rounded = full[name].to(torch.bfloat16)
        assert torch.equal(tensor.view(torch.int16), rounded.view(torch.int16)), name
    # Rounding really happened: float32 weights of a trained model are not all bfloat16 values already.
    assert any(not torch.equal(full[n], got[n].float()) for n in got)


@pytest.mark.parametrize(("layout", "world_size"), [("shared_base_adapters", 2), ("independent", 1)])
def test_lora_export_round_trips_through_peft_and_diffusers(tmp_path, layout, world_size):
    """Both LoRA layouts: the exported adapter (PEFT's loader, diffusers' loader, our init_path loader),
    the merged model and the pipeline's transformer each reproduce the in-trainer role."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from peft import PeftModel

    teacher_dir = save_teacher("sd3", tmp_path / "teacher")
    pipeline = fake_pipeline(tmp_path / "pipeline_src", teacher_dir)
    overrides = {"export.formats": ["peft", "diffusers", "pipeline"], "export.pipeline_source": pipeline,
                 "export.dtype": "float32"}  # fmt: skip
    trained = run_ranks(train_and_save, world_size, tmp_path / "run", "sd3", layout, teacher_dir,
                        str(tmp_path / "ckpt"), overrides)[0]  # fmt: skip
    plan = export_plan("sd3", layout, teacher_dir, **overrides)
    want = trained["outputs"]
    # The roles really differ, so picking the wrong one would fail the comparisons below.
    assert max_error(want["student"], want["student_ema"]) > 100 * TOLERANCE
    assert max_error(want["student"], want["teacher"]) > 100 * TOLERANCE

    for role in ("student_ema", "student"):
        out = export_checkpoint(
            plan, trained["path"], role=role, output_dir=tmp_path / "export" / role, log=lambda _: None
        )
        peft_dir = out / PEFT_DIR
        assert {p.name for p in peft_dir.iterdir()} == {"adapter_config.json", "adapter_model.safetensors",
                                                        DIFFUSERS_LORA_WEIGHTS}  # fmt: skip
        fresh = SD3Transformer2DModel.from_pretrained(teacher_dir)
        assert max_error(predict("sd3", fresh), want["teacher"]) < TOLERANCE
        with_peft = PeftModel.from_pretrained(fresh, str(peft_dir))
        assert max_error(predict("sd3", with_peft.base_model.model), want[role]) < TOLERANCE, role

        fresh = SD3Transformer2DModel.from_pretrained(teacher_dir)
        fresh.load_lora_adapter(str(peft_dir), prefix="transformer", use_safetensors=True, adapter_name="dmd")
        assert max_error(predict("sd3", fresh), want[role]) < TOLERANCE, role

        # A pipeline's load_lora_weights picks diffusers' file from the directory by itself.
        pipe = StableDiffusion3Pipeline(transformer=SD3Transformer2DModel.from_pretrained(teacher_dir),
                                        scheduler=FlowMatchEulerDiscreteScheduler(), **NO_TEXT_OR_VAE)  # fmt: skip
        pipe.load_lora_weights(str(peft_dir))
        assert max_error(predict("sd3", pipe.transformer), want[role]) < TOLERANCE, role

        merged = SD3Transformer2DModel.from_pretrained(str(out / DIFFUSERS_DIR))
        assert not any("lora" in name for name, _ in merged.named_parameters())
        assert max_error(predict("sd3", merged), want[role]) < TOLERANCE, role

        index = json.loads((out / PIPELINE_DIR / "model_index.json").read_text())
        assert index["dmd2_config"] == {"num_inference_steps": 1, "denoising_timesteps": [1000.0],
                                        "solver": "sde", "guidance_scale": 1.0}  # fmt: skip
        assert index["transformer"] == ["diffusers", "SD3Transformer2DModel"]
        assert {k: index[k] for k in index if k.startswith("dmd2_") and k != "dmd2_config"} == {
            "dmd2_num_inference_steps": 1, "dmd2_denoising_timesteps": [1000.0], "dmd2_guidance_scale": 1.0,
            "dmd2_scheduler_shift": 1.0}  # fmt: skip
        # The scheduler samples the trained schedule (shift 1 here), with the student's re-noising; the
        # teacher's own file (hard-linked into the copy) is untouched.
        scheduler = json.loads((out / PIPELINE_DIR / "scheduler" / "scheduler_config.json").read_text())
        assert (scheduler["shift"], scheduler["use_dynamic_shifting"], scheduler["stochastic_sampling"]) == (
            1.0, False, True)  # fmt: skip
        assert (
            json.loads((Path(pipeline) / "scheduler" / "scheduler_config.json").read_text())["shift"] == 3.0
        )
        in_pipeline = SD3Transformer2DModel.from_pretrained(str(out / PIPELINE_DIR), subfolder="transformer")
        assert max_error(predict("sd3", in_pipeline), want[role]) < TOLERANCE, role

        info = json.loads((out / EXPORT_INFO).read_text())
        assert info["role"] == role and info["global_step"] == 2 and info["merged_dtype"] == "float32"
        from verl_dmd.digests import model_digests

        assert info["teacher"] == {"path": teacher_dir, "subfolder": None, "pipeline_class": None,
                                   **model_digests(Path(teacher_dir))}  # fmt: skip
        for relative, digest in info["files"].items():
            assert file_sha256(out / relative) == digest, relative

        # The default dtype: the same merged weights, each rounded once to bfloat16, bit for bit.
        bf16 = export_checkpoint(
            export_plan("sd3", layout, teacher_dir, **{**overrides, "export.dtype": "bfloat16"}), trained["path"],
            role=role, formats=("diffusers",), output_dir=tmp_path / "export_bf16" / role, log=lambda _: None,
        )  # fmt: skip
        assert_rounded_bitwise(weights(bf16 / DIFFUSERS_DIR), weights(out / DIFFUSERS_DIR))

    # The lora_* directories serve the adapter on export.pipeline_source's transformer: one that is not the
    # teacher's (another seed) is refused before anything is read or written.
    other = fake_pipeline(
        tmp_path / "other_src", save_teacher_seeded("sd3", tmp_path / "other_teacher", seed=4)
    )
    refused = export_plan("sd3", layout, teacher_dir, **{**overrides, "export.pipeline_source": other,
                                                         "export.formats": ["peft", "lora_pipeline"]})  # fmt: skip
    with pytest.raises(ExportError, match=r"its transformer is not the teacher the adapter was trained on"):
        export_checkpoint(refused, trained["path"], output_dir=tmp_path / "refused", log=lambda _: None)
    assert not (tmp_path / "refused").exists()
    lora_served = export_checkpoint(export_plan("sd3", layout, teacher_dir, **{**overrides, "export.formats": [
        "peft", "lora_pipeline"]}), trained["path"], output_dir=tmp_path / "lora_served", log=lambda _: None)  # fmt: skip
    weights_file = sorted(Path(teacher_dir).glob("*.safetensors"))[0]
    assert os.path.samefile(weights_file, lora_served / "lora_pipeline" / "transformer" / weights_file.name)

    # The exported adapter starts a new run: model.student.lora.init_path reads PEFT's key layout.
    from verl_dmd.runtime.lora import add_adapter, load_peft_adapter_dir, lora_config

    spec = plan.model.student.lora
    fresh = SD3Transformer2DModel.from_pretrained(teacher_dir)
    add_adapter(fresh, lora_config(spec, get_adapter("sd3").default_lora_targets), "student")
    load_peft_adapter_dir(
        fresh, str(tmp_path / "export" / "student" / PEFT_DIR), "student", spec, "model.student.lora"
    )
    assert max_error(predict("sd3", fresh), want["student"]) < TOLERANCE


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """The digits model (DiT) fully fine-tuned in independent copies, saved at step 2."""
    tmp_path = tmp_path_factory.mktemp("full")
    teacher_dir = save_teacher("dit", tmp_path / "teacher")
    overrides = {
        "model.student.lora.rank": 0,
        "model.fake_score.lora.rank": 0,
        "export.formats": ["diffusers"],
        "export.dtype": "float32",
    }
    (trained,) = run_ranks(train_and_save, 1, tmp_path / "run", "dit", "independent", teacher_dir,
                           str(tmp_path / "ckpt"), overrides)  # fmt: skip
    plan = export_plan("dit", "independent", teacher_dir, **overrides)
    return tmp_path, teacher_dir, plan, trained


def test_full_fine_tune_exports_the_merged_model_for_each_role(full_run):
    from diffusers import DiTTransformer2DModel

    tmp_path, _, plan, trained = full_run
    want = trained["outputs"]
    assert max_error(want["student"], want["student_ema"]) > 100 * TOLERANCE
    for role in ("student_ema", "student"):
        out = export_checkpoint(
            plan, trained["path"], role=role, output_dir=tmp_path / role, log=lambda _: None
        )
        assert sorted(p.name for p in out.iterdir()) == [DIFFUSERS_DIR, EXPORT_INFO]
        merged = DiTTransformer2DModel.from_pretrained(str(out / DIFFUSERS_DIR))
        assert max_error(predict("dit", merged), want[role]) < TOLERANCE, role


def test_the_default_bf16_export_is_the_roles_weights_rounded_bit_for_bit(full_run):
    """A full fine-tune's role is its checkpoint tensors: read straight from the DCP files, rounded once to
    bfloat16, they are the exported file bit for bit (its config says nothing of dtype; the tensors are)."""
    from verl_dmd.checkpoint.composite import ENGINE_DIR
    from verl_dmd.checkpoint.export import read_role_tensors
    from verl_dmd.phases import Role
    from verl_dmd.runtime.layouts import layout_for

    tmp_path, teacher_dir, plan, trained = full_run
    plan = export_plan("dit", "independent", teacher_dir, **{"model.student.lora.rank": 0,
                       "model.fake_score.lora.rank": 0, "export.formats": ["diffusers"]})  # fmt: skip
    assert plan.export.dtype == "bfloat16"  # the default
    for role in ("student_ema", "student"):
        out = export_checkpoint(plan, trained["path"], role=role, output_dir=tmp_path / f"bf16_{role}",
                                log=lambda _: None)  # fmt: skip
        selection = layout_for(plan, get_adapter("dit")()).role_tensors(Role(role))
        full = read_role_tensors(Path(trained["path"]) / ENGINE_DIR, selection)
        assert_rounded_bitwise(weights(out / DIFFUSERS_DIR), full)
        assert json.loads((out / EXPORT_INFO).read_text())["merged_dtype"] == "bfloat16"


def test_export_refuses_bad_requests_with_one_line_errors(full_run):
    tmp_path, teacher_dir, plan, trained = full_run
    quiet = {"log": lambda _: None}
    with pytest.raises(ExportError, match=r"export.formats.*peft format needs a LoRA student"):
        export_checkpoint(plan, trained["path"], formats=("peft",), output_dir=tmp_path / "x", **quiet)
    target = tmp_path / "taken"
    export_checkpoint(plan, trained["path"], output_dir=target, **quiet)
    with pytest.raises(ExportError, match="already exists; fix: remove it"):
        export_checkpoint(plan, trained["path"], output_dir=target, **quiet)
    drifted = export_plan("dit", "independent", teacher_dir, **{"model.student.lora.rank": 0,
                          "model.fake_score.lora.rank": 0, "export.formats": ["diffusers"], "optim.student.lr": 0.5})  # fmt: skip
    with pytest.raises(CheckpointError, match=r"optim.student.lr: checkpoint 0.001, now 0.5"):
        export_checkpoint(drifted, trained["path"], output_dir=tmp_path / "y", **quiet)
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]


def test_export_detects_a_damaged_checkpoint_file(full_run, tmp_path):
    import shutil

    _, _, plan, trained = full_run
    copy = tmp_path / "global_step_2"
    shutil.copytree(trained["path"], copy)
    victim = next(p for p in sorted((copy / "engine").iterdir()) if p.suffix == ".distcp")
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=victim.name):
        export_checkpoint(plan, copy, output_dir=tmp_path / "out", log=lambda _: None)


def test_non_finite_values_are_named():
    check_finite({"a": torch.ones(3)}, "here")
    with pytest.raises(ExportError, match=r"here: tensor b has 2 non-finite values"):
        check_finite({"a": torch.ones(2), "b": torch.tensor([1.0, float("nan"), float("inf")])}, "here")


def run_export_cli(config_dir, *overrides: str):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(sys.executable).parent / "verl-dmd-export"
    return subprocess.run([str(script), "--config-path", str(config_dir), "--config-name", "run", *overrides],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "HYDRA_FULL_ERROR": "0"})  # fmt: skip


def test_console_script_exports_the_newest_checkpoint_of_a_run(full_run):
    """`verl-dmd-export` with the run's config: finds the newest checkpoint under checkpoint.root, exports
    export.role; a run without checkpoints is a one-line error and exit code 2."""
    from diffusers import DiTTransformer2DModel
    from omegaconf import OmegaConf

    tmp_path, _, plan, trained = full_run
    config_dir = tmp_path / "config"
    config_dir.mkdir()
    config = {**plan.to_dict(), "hydra": {"run": {"dir": str(tmp_path / "hydra")}, "output_subdir": None}}
    OmegaConf.save(OmegaConf.create(config), config_dir / "run.yaml")
    root = os.path.dirname(trained["path"])
    result = run_export_cli(config_dir, f"checkpoint.root={root}", f"trainer.output_dir={tmp_path / 'cli'}")
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "cli" / "export" / "global_step_2" / "student_ema"
    assert f"exported to {out}" in result.stdout
    merged = DiTTransformer2DModel.from_pretrained(str(out / DIFFUSERS_DIR))
    assert max_error(predict("dit", merged), trained["outputs"]["student_ema"]) < TOLERANCE

    result = run_export_cli(config_dir, f"checkpoint.root={tmp_path / 'nothing'}")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("verl-dmd-export: error: no checkpoint under"), result.stderr
    assert "Traceback" not in result.stderr


def test_end_of_run_export_keeps_its_own_and_replaces_another_runs(full_run, tmp_path):
    """The trainer's export at the end (if_exists="reuse"): a directory holding this checkpoint's export is
    kept; one holding another run's export of the same step (a restarted timeline) is replaced, never
    silently reused; the command's default refuses an existing directory."""
    import dataclasses
    import shutil

    from verl_dmd.checkpoint.store import CheckpointStore
    from verl_dmd.trainer.ray_trainer import Export

    _, _, plan, trained = full_run
    plan = dataclasses.replace(
        plan, export=dataclasses.replace(plan.export, output_dir=str(tmp_path / "exp"))
    )
    export = Export(plan, lambda line: None)
    target = tmp_path / "exp" / "global_step_2" / "student_ema"
    export.at_end(trained["path"])
    info = json.loads((target / EXPORT_INFO).read_text())
    assert info["manifest_sha256"] == CheckpointStore.verify(trained["path"]).manifest["manifest_sha256"]
    stamp = (target / EXPORT_INFO).stat().st_mtime_ns
    export.at_end(trained["path"])  # the same checkpoint: kept as it is
    assert (target / EXPORT_INFO).stat().st_mtime_ns == stamp
    with pytest.raises(ExportError, match="already exists"):
        export_checkpoint(plan, trained["path"], log=lambda line: None)
    shutil.rmtree(target / DIFFUSERS_DIR)  # pretend another run wrote this directory
    (target / EXPORT_INFO).write_text(json.dumps({**info, "manifest_sha256": "0" * 64}))
    export.at_end(trained["path"])
    assert json.loads((target / EXPORT_INFO).read_text())["manifest_sha256"] == info["manifest_sha256"]
    assert (target / DIFFUSERS_DIR / "config.json").is_file()


def test_a_failing_write_leaves_no_partial_export(full_run, tmp_path, monkeypatch):
    """A write that fails half way (here save_pretrained: disk full) removes the staging directory; the
    target never appears."""
    from diffusers import DiTTransformer2DModel

    _, _, plan, trained = full_run

    def disk_full(self, *args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(DiTTransformer2DModel, "save_pretrained", disk_full)
    with pytest.raises(OSError, match="No space left"):
        export_checkpoint(
            plan, trained["path"], output_dir=tmp_path / "out" / "student_ema", log=lambda _: None
        )
    assert list((tmp_path / "out").iterdir()) == []


def test_an_existing_export_is_reused_only_for_the_same_checkpoint_and_formats(tmp_path):
    """The end-of-run export keeps a directory holding this checkpoint's export in the formats and dtype asked
    for, and replaces one of another checkpoint, with other formats or in another dtype (naming which)."""
    from types import SimpleNamespace

    from verl_dmd.checkpoint.export import _existing_export

    found = SimpleNamespace(manifest={"manifest_sha256": "a" * 64})
    cases = [
        ({"manifest_sha256": "a" * 64, "formats": ["diffusers"], "merged_dtype": "bfloat16"}, ("diffusers",), True,
         "already"),
        ({"manifest_sha256": "a" * 64, "formats": ["diffusers"]}, ("peft", "diffusers"), False, "other formats"),
        # the same checkpoint and formats in float32 (written before export.dtype existed: no merged_dtype)
        ({"manifest_sha256": "a" * 64, "formats": ["diffusers"]}, ("diffusers",), False, "another dtype"),
        ({"manifest_sha256": "b" * 64, "formats": ["diffusers"], "checkpoint": "x"}, ("diffusers",), False, "another run"),
    ]  # fmt: skip
    for info, formats, kept, said in cases:
        target = tmp_path / "target"
        target.mkdir(exist_ok=True)
        (target / EXPORT_INFO).write_text(json.dumps(info))
        lines = []
        assert _existing_export(target, found, formats, "reuse", lines.append) is kept
        assert target.exists() is kept and said in lines[0]
    target.mkdir()
    with pytest.raises(ExportError, match="already exists"):
        _existing_export(target, found, ("diffusers",), "fail", lines.append)


def test_the_bf16_export_keeps_the_modules_the_model_class_keeps_in_float32():
    """Wan keeps its time embedder, scale-shift table and norms in float32 (diffusers upcasts them on load):
    the export writes them as they are, every other weight rounded once."""
    from diffusers import WanTransformer3DModel

    from verl_dmd.checkpoint.export import _to_export_dtype

    adapter = get_adapter("wan")()
    torch.manual_seed(0)
    model = WanTransformer3DModel.from_config(adapter.tiny_config)
    full = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    keep = WanTransformer3DModel._keep_in_fp32_modules
    assert keep  # the class declares some
    _to_export_dtype(model, torch.bfloat16)
    kept = [name for name in full if any(part in name.split(".") for part in keep)]
    assert kept and len(kept) < len(full)
    for name, tensor in model.state_dict().items():
        if name in kept:
            assert tensor.dtype == torch.float32 and torch.equal(tensor, full[name]), name
        else:
            assert torch.equal(tensor.view(torch.int16), full[name].to(torch.bfloat16).view(torch.int16)), (
                name
            )
