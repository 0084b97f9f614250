"""Edge cases of the extension points: each a one-line error, or the right behaviour, where a user can reach."""

from __future__ import annotations

import json

import pytest
import torch

from verl_dmd.adapters.diffusers_transformers import DiTAdapter
from verl_dmd.main import compose_plan
from verl_dmd.phases import ExtraModule, PhaseContractError, Role

TINY_DIT = f"model.teacher.config={json.dumps(DiTAdapter.tiny_config)}"
SMALL = ["model.teacher.path=null", TINY_DIT, "trainer.total_steps=1", "algorithm.regression_weight=0",
         "algorithm.fake_update_ratio=1", "algorithm.fake_warmup_steps=0", "algorithm.student_steps=1",
         "batch.student.micro_batch_size=4", "batch.fake_score.micro_batch_size=4", "resources.workers_per_node=1",
         "trainer.progress_bar=false", "validation.num_samples=10", "validation.sampling_steps=[1]"]  # fmt: skip


def test_copying_an_adapter_copies_embedding_factors_too():
    """PEFT names embedding factors `<layer>.lora_embedding_A.<adapter>` (no trailing segment): the
    student_ema copy of the student's adapter must reach them as well as the linear factors."""
    from torch import nn

    from verl_dmd.plan import LoraSpec
    from verl_dmd.runtime import lora

    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8))
    for name in ("student", "student_ema"):
        lora.add_adapter(model, lora.lora_config(LoraSpec(rank=2), ["0", "1"]), name)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if lora.adapter_of(name) == "student":
                p.uniform_(1.0, 2.0)
    lora.copy_adapter(model, "student", "student_ema")
    params = dict(model.named_parameters())
    pairs = [
        (n, lora.rename_adapter(n, "student", "student_ema"))
        for n in params
        if lora.adapter_of(n) == "student"
    ]
    assert any("lora_embedding_A" in n for n, _ in pairs) and any("lora_A" in n for n, _ in pairs)
    for source, target in pairs:
        assert torch.equal(params[source], params[target]), target
    assert lora.rename_adapter("a.lora_embedding_B.student", "student", "x") == "a.lora_embedding_B.x"
    assert lora.rename_adapter("student.lora_A.student.weight", "student", "x") == "student.lora_A.x.weight"


def test_only_the_fake_score_owns_extra_modules():
    with pytest.raises(PhaseContractError, match="owner 'student'; allowed: fake_score"):
        ExtraModule("head", Role.STUDENT, lambda model: torch.nn.Linear(1, 1))
    assert ExtraModule("head", "fake_score", lambda model: torch.nn.Linear(1, 1)).owner is Role.FAKE_SCORE


def test_a_method_class_must_have_the_whole_protocol():
    from verl_dmd.algorithms.registry import register_method

    class Partial:
        @classmethod
        def from_plan(cls, adapter, model_config, plan, *, rank):
            return cls()

        def compute_phase(self, request, batch, runtime, *, micro_batch_index, num_micro_batches):
            raise NotImplementedError

    with pytest.raises(TypeError, match="missing: extra_modules, state_dict, load_state_dict, reseed"):
        register_method("test_partial")(Partial)


class _Epsilon(DiTAdapter):
    parameterization = "epsilon"
    sigma_max = 0.9


class _X0(DiTAdapter):
    parameterization = "x0"


@pytest.mark.parametrize(
    ("adapter", "overrides", "message"),
    [
        (_Epsilon, ["algorithm.sigma_max=0.95"], "'algorithm.sigma_max' = 0.95: model adapter"),
        (
            _Epsilon,
            ["algorithm.sigma_max=0.9", "algorithm.student_sigmas=[0.95]"],
            "'algorithm.student_sigmas'",
        ),
        (
            _Epsilon,
            ["algorithm.sigma_max=0.9", "algorithm.fake_score_weighting=edm"],
            "'algorithm.fake_sigma_max' = 1.0",
        ),
        (
            _X0,
            ["algorithm.fake_score_weighting=dmd2_sd"],
            "'algorithm.fake_sigma_min' = 0.0: the dmd2_sd weighting",
        ),
    ],
)
def test_noise_levels_the_family_cannot_denoise_are_refused(adapter, overrides, message):
    from verl_dmd.algorithms.dmd2 import DMD2Computer

    plan = compose_plan("digits_dmd2", ["algorithm.student_steps=1", *overrides])
    with pytest.raises(ValueError, match=message) as info:
        DMD2Computer(adapter(), plan.algorithm, seed=0, rank=0)
    assert "\n" not in str(info.value) and "fix:" in str(info.value)
    fine = compose_plan("digits_dmd2", ["algorithm.student_steps=1", "algorithm.sigma_max=0.9",
                                        "algorithm.fake_sigma_min=0.02", "algorithm.fake_sigma_max=0.98"])  # fmt: skip
    DMD2Computer(adapter(), fine.algorithm, seed=0, rank=0)  # the same family inside its range


@pytest.mark.slow
def test_a_batch_whose_tensors_disagree_is_a_one_line_error(tmp_path, capsys):
    """A data provider whose batch does not split (its tensors disagree on the batch size) ends the run
    with exit code 2 and one line naming the provider, not a traceback."""
    from verl_dmd.trainer.digits import DigitsProvider
    from verl_dmd.trainer.ray_trainer import DistillationRayTrainer
    from verl_dmd.trainer.registry import DATA_PROVIDERS, register_data_provider

    if "test_ragged" not in DATA_PROVIDERS.names():

        @register_data_provider("test_ragged")
        class Ragged(DigitsProvider):
            validator = "digits"

            def next_batch(self, size):
                batch = super().next_batch(size)
                return {**batch, "noise": batch["noise"][:-1]}

    plan = compose_plan("digits_dmd2", [*SMALL, "data.name=test_ragged", f"trainer.output_dir={tmp_path}"])
    assert DistillationRayTrainer(plan, backend="local", log=lambda line: None).fit() == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(
        "verl-dmd: error: data provider 'test_ragged': batch tensors disagree on the batch size"
    )


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["shared_base_adapters", "independent"])
def test_a_run_without_ema_trains_validates_and_exports(tmp_path, layout):
    from verl_dmd.trainer.ray_trainer import DistillationRayTrainer

    lora = (
        ["model.student.lora.rank=4", "model.fake_score.lora.rank=4"]
        if layout == "shared_base_adapters"
        else []
    )
    plan = compose_plan("digits_dmd2", [
        *SMALL, f"model.storage={layout}", *lora, "ema.enabled=false", "export.role=student",
        "validation.roles=[student]", f"trainer.output_dir={tmp_path}",
    ])  # fmt: skip
    assert DistillationRayTrainer(plan, backend="local", log=lambda line: None).fit() == 0
    assert (tmp_path / "export" / "global_step_1" / "student" / "diffusers" / "config.json").is_file()
    assert "| student | few-step | 1 |" in (tmp_path / "table.md").read_text()
