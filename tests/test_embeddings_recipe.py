"""The SD3 recipe's code path on CPU: precomputed embeddings, LoRA roles on a shared base, PEFT export."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from verl_dmd.adapters import get_adapter
from verl_dmd.main import compose_plan
from verl_dmd.plan import PlanError
from verl_dmd.trainer.embeddings import EmbeddingsProvider

ROOT = Path(__file__).resolve().parents[1]


def write_embeddings(path: Path, rows: int = 6, *, latent_shape: str = "4,8,8") -> Path:
    """Tiny SD3-shaped text embeddings (joint dim 16, pooled dim 8) with one unconditional row."""
    import safetensors.torch

    generator = torch.Generator().manual_seed(0)
    tensors = {
        "cond.encoder_hidden_states": torch.randn(rows, 3, 16, generator=generator),
        "cond.pooled_projections": torch.randn(rows, 8, generator=generator),
        "uncond.encoder_hidden_states": torch.zeros(1, 3, 16),
        "uncond.pooled_projections": torch.zeros(1, 8),
    }
    safetensors.torch.save_file(tensors, path, metadata={"latent_shape": latent_shape})
    return path


def test_gpu_recipes_compose_and_name_what_is_missing():
    for recipe in ("sd3_lora_dmd2", "flux_lora_dmd2", "wan_lora_dmd2"):
        plan = compose_plan(recipe, ["model.teacher.path=/models/x", "data.path=/data/x"])
        assert plan.model.storage == "shared_base_adapters" and plan.model.student.lora.rank > 0
        with pytest.raises(PlanError, match=r"'model.teacher.path' = None: the teacher needs a source"):
            compose_plan(recipe, ["data.path=/data/x"])
        with pytest.raises(PlanError, match=r"'data.path' = None: the embeddings provider"):
            compose_plan(recipe, ["model.teacher.path=/models/x"])


def test_embeddings_provider_is_positional_and_resumable(tmp_path):
    path = write_embeddings(tmp_path / "emb.safetensors")
    plan = compose_plan("sd3_lora_dmd2", ["model.teacher.path=/m", f"data.path={path}"])
    provider = EmbeddingsProvider(plan)
    first = provider.next_batch(4)
    assert first["noise"].shape == (4, 4, 8, 8) and first["uncond.pooled_projections"].shape == (4, 8)
    assert first["cond.encoder_hidden_states"].shape == (4, 3, 16)
    state = provider.state_dict()
    second = provider.next_batch(4)  # crosses into the second epoch (6 rows)
    again = EmbeddingsProvider(plan)
    again.load_state_dict(state)
    for key, tensor in again.next_batch(4).items():
        assert torch.equal(tensor, second[key]), key
    # One epoch holds every row exactly once.
    seen = torch.cat([first["cond.pooled_projections"], second["cond.pooled_projections"][:2]])
    assert len({tuple(row.tolist()) for row in seen}) == 6
    write_embeddings(tmp_path / "bad.safetensors", latent_shape="4,8,8")
    import safetensors.torch

    safetensors.torch.save_file({"cond.x": torch.zeros(2, 3)}, tmp_path / "nometa.safetensors")
    bad = compose_plan(
        "sd3_lora_dmd2", ["model.teacher.path=/m", f"data.path={tmp_path / 'nometa.safetensors'}"]
    )
    with pytest.raises(ValueError, match="no 'latent_shape' metadata"):
        EmbeddingsProvider(bad)


@pytest.mark.slow
def test_sd3_recipe_trains_and_exports_a_peft_adapter_on_cpu(tmp_path):
    """The sd3_lora_dmd2 recipe on a tiny SD3 model, CPU, float32, one rank (--local): DMD2 with CFG
    from the embeddings' unconditional rows, a checkpoint, and the PEFT + merged export."""
    adapter = get_adapter("sd3")()
    torch.manual_seed(0)
    adapter.model_class.from_config(adapter.tiny_config).save_pretrained(tmp_path / "teacher")
    data = write_embeddings(tmp_path / "emb.safetensors")
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "verl_dmd.main", "--local", "--config-name", "sd3_lora_dmd2",
         f"model.teacher.path={tmp_path / 'teacher'}", "model.teacher.subfolder=null", f"data.path={data}",
         "model.param_dtype=float32", "resources.device=cpu", "trainer.total_steps=2",
         "algorithm.fake_update_ratio=1", "model.student.lora.rank=4", "model.student.lora.alpha=4",
         "model.fake_score.lora.rank=4", "model.fake_score.lora.alpha=4",
         "batch.student.micro_batch_size=2", "batch.fake_score.micro_batch_size=2",
         f"trainer.output_dir={out}"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # Hand-made embeddings and a bare transformer directory: nothing to decode with, and the run says so.
    assert (
        "validation: off (no decoded samples: the teacher is not a component of a pipeline" in result.stdout
    )
    exported = out / "export" / "global_step_2" / "student_ema"
    assert (exported / "peft" / "adapter_config.json").is_file()
    assert (exported / "diffusers" / "config.json").is_file()


@pytest.mark.slow
def test_the_digits_validator_refuses_a_family_without_classes(tmp_path, capsys):
    """validation.name=digits with a text-conditioned family is one line before any phase runs."""
    from verl_dmd.trainer.ray_trainer import DistillationRayTrainer

    adapter = get_adapter("sd3")()
    torch.manual_seed(0)
    adapter.model_class.from_config(adapter.tiny_config).save_pretrained(tmp_path / "teacher")
    data = write_embeddings(tmp_path / "emb.safetensors")
    plan = compose_plan("sd3_lora_dmd2", [
        f"model.teacher.path={tmp_path / 'teacher'}", "model.teacher.subfolder=null", f"data.path={data}",
        "model.param_dtype=float32", "resources.device=cpu", "validation.name=digits",
        "validation.num_samples=10", f"trainer.output_dir={tmp_path / 'out'}",
    ])  # fmt: skip
    lines = []
    assert DistillationRayTrainer(plan, backend="local", log=lines.append).fit() == 2
    (error,) = capsys.readouterr().err.strip().splitlines()
    assert "'validation.name' = 'digits': the digits table samples class-conditional models" in error
    assert not any(line.startswith("step ") for line in lines)
