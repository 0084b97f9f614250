"""The serving contract of an export: the dmd2_config block read with vllm-omni's semantics, the diffusers
scheduler that reproduces the trained schedule and the student's sampler, the vllm-omni class, the guidance."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from verl_dmd.checkpoint import serving
from verl_dmd.plan import PlanError
from verl_dmd.plan.specs import AlgorithmSpec

TEACHER_SCHEDULER = {  # SD3's / Flux's scheduler as released (Flux: dynamic shifting on)
    "_class_name": "FlowMatchEulerDiscreteScheduler", "_diffusers_version": "0.42.1", "num_train_timesteps": 1000,
    "shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15, "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}  # fmt: skip
CASES = [(1, 1.0), (2, 3.0), (4, 3.0), (4, 1.0), (3, 5.0)]


def trained(steps: int, shift: float) -> list[float]:
    from verl_dmd.algorithms.sampling import trained_schedule

    return trained_schedule(AlgorithmSpec(student_steps=steps, sigma_shift=shift)).tolist()


def diffusers_levels(config: dict, steps: int, **call) -> list[float]:
    """The levels a Flux / Qwen-Image pipeline call with `num_inference_steps=steps` gives the scheduler."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1.0 / steps, steps), **call)
    return scheduler.sigmas.tolist()


@pytest.mark.parametrize(("steps", "shift"), CASES)
def test_the_exported_scheduler_samples_the_trained_schedule(steps, shift):
    config = serving.diffusers_scheduler_config(TEACHER_SCHEDULER, shift)
    want = trained(steps, shift)
    # Flux passes mu (resolution-dependent); with dynamic shifting off the scheduler ignores it.
    for call in ({}, {"mu": 1.1}):
        got = diffusers_levels(config, steps, **call)
        assert len(got) == len(want) and max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-6, (
            got,
            want,
        )
    # The teacher's own scheduler does not (mutation: the copied scheduler of the old export); one step
    # starts at 1 under any shift.
    got = diffusers_levels(TEACHER_SCHEDULER, steps, mu=0.5)  # a small image's mu: shift e^0.5
    assert steps == 1 or max(abs(a - b) for a, b in zip(got, want, strict=True)) > 1e-3


def test_the_exported_scheduler_steps_as_the_student_samples():
    """One diffusers step (stochastic sampling) equals the student's step: x0 from the velocity, re-noised to
    the next level. The fresh noise is made equal by giving diffusers' step a generator in the state that
    drew ours (it draws the sample's shape in float32 on the CPU, as our sampler does)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from verl_dmd.adapters import get_adapter

    adapter = get_adapter("sd3")()
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(
        serving.diffusers_scheduler_config(TEACHER_SCHEDULER, 3.0)
    )
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.25, 4))
    g = torch.Generator().manual_seed(0)
    x, v = (torch.randn(2, 4, 8, 8, generator=g) for _ in range(2))
    state = g.get_state()
    fresh = torch.randn(2, 4, 8, 8, generator=g)
    sigma, next_sigma = scheduler.sigmas[1], scheduler.sigmas[2]
    want = adapter.add_noise(adapter.to_x0(x, v, sigma), fresh, next_sigma)
    scheduler._step_index = 1
    got = scheduler.step(
        v, scheduler.timesteps[1], x, generator=torch.Generator().set_state(state)
    ).prev_sample
    assert float((got - want).abs().max()) < 1e-6
    # Without stochastic sampling (the teacher's scheduler) it is an ODE step, not the student's.
    plain = FlowMatchEulerDiscreteScheduler.from_config({**TEACHER_SCHEDULER, "use_dynamic_shifting": False})
    plain.set_timesteps(sigmas=np.linspace(1.0, 0.25, 4))
    plain._step_index = 1
    plain_step = plain.step(
        v, plain.timesteps[1], x, generator=torch.Generator().set_state(state)
    ).prev_sample
    assert float((plain_step - want).abs().max()) > 1e-2


@pytest.mark.parametrize(("steps", "shift"), CASES)
@pytest.mark.parametrize("teacher_class", sorted(serving.VLLM_OMNI_CLASSES))
def test_vllm_omni_reads_our_block_as_the_trained_sampler(steps, shift, teacher_class):
    schedule = trained(steps, shift)
    block = serving.dmd2_block(schedule, 2.5)
    index = {"_class_name": teacher_class, "transformer": ["diffusers", "X"]}
    served = serving.read_served(
        serving.index_with_block(index, block, serving.vllm_omni_class(teacher_class))
    )
    assert served["dmd2"] and served["fell_back"] is None
    assert served["stochastic"] and served["guidance_scale"] == 2.5
    assert (
        max(abs(a - b) for a, b in zip(served["sigmas"], schedule, strict=True)) < 1e-6
        and len(served["sigmas"]) == steps + 1
    )
    # The teacher's own class name builds the plain pipeline, which ignores the block (the old export).
    assert not serving.read_served(serving.index_with_block(index, block))["dmd2"]
    # The flat keys of older readers say the same, with the shift baked in (1.0).
    flat = serving.index_with_block(index, block)
    assert (flat["dmd2_num_inference_steps"], flat["dmd2_denoising_timesteps"], flat["dmd2_guidance_scale"],
            flat["dmd2_scheduler_shift"]) == (steps, block["denoising_timesteps"], 2.5, 1.0)  # fmt: skip
    assert json.loads(json.dumps(flat)) == flat  # plain JSON types only


GOOD = {
    "num_inference_steps": 2,
    "denoising_timesteps": [1000.0, 750.0],
    "solver": "sde",
    "guidance_scale": 1.0,
}
MALFORMED = [
    ([1000, 500], "not an object"),
    ({**GOOD, "num_inference_steps": 3}, "2 denoising_timesteps for num_inference_steps = 3"),
    ({**GOOD, "num_inference_steps": 2.0}, "not a positive integer"),
    ({**GOOD, "denoising_timesteps": ["1000", "750"]}, "not a list of numbers"),
    ({**GOOD, "denoising_timesteps": [750.0, 1000.0]}, "not strictly decreasing"),
    (
        {**GOOD, "denoising_timesteps": [1.0, 0.75]},
        None,
    ),  # sigmas, not timesteps: reads, samples wrong levels
    ({**GOOD, "solver": "euler"}, "not 'ode' or 'sde'"),
    ({**GOOD, "shift": 3.0}, "unknown key 'shift'"),
    ({k: v for k, v in GOOD.items() if k != "denoising_timesteps"}, "no denoising_timesteps"),
    ({**GOOD, "guidance_scale": float("nan")}, "not a positive number"),
]


@pytest.mark.parametrize(("block", "reason"), MALFORMED)
def test_a_malformed_block_falls_back_to_the_defaults_with_a_reason(block, reason):
    served = serving.read_served({"_class_name": "FluxDMD2Pipeline", "dmd2_config": block})
    if reason is None:
        assert served["fell_back"] is None and served["sigmas"] == [0.001, 0.00075, 0.0]
        return
    assert reason in served["fell_back"]
    assert served["sigmas"] == [0.999, 0.749, 0.499, 0.249, 0.0] and not served["stochastic"]
    assert serving.read_served({"_class_name": "FluxDMD2Pipeline"})["fell_back"] == "no dmd2_config"


def test_our_block_is_never_malformed():
    for steps, shift in CASES:
        assert serving.block_problem(serving.dmd2_block(trained(steps, shift), 1.0)) is None
    explicit = AlgorithmSpec(student_steps=3, student_sigmas=(1.0, 0.6, 0.2))
    from verl_dmd.algorithms.sampling import trained_schedule

    assert serving.block_problem(serving.dmd2_block(trained_schedule(explicit).tolist(), 1.0)) is None


def test_sd3_has_no_vllm_omni_class_and_is_refused_before_training(tmp_path):
    with pytest.raises(serving.ServingError) as err:
        serving.vllm_omni_class("StableDiffusion3Pipeline")
    assert "no DMD2 pipeline for a StableDiffusion3Pipeline" in str(err.value) and "\n" not in str(err.value)

    from verl_dmd.preflight import check_export_targets

    source = tmp_path / "sd3"
    source.mkdir()
    (source / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline"}))

    class Plan:  # check_export_targets reads two keys
        class export:
            formats = ("peft", "vllm_omni")
            pipeline_source = str(source)

    with pytest.raises(PlanError) as err:
        check_export_targets(Plan)
    assert str(err.value).startswith(
        "config key 'export.formats' = ['peft', 'vllm_omni']: vllm-omni has no DMD2"
    )
    (source / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    check_export_targets(Plan)


@pytest.mark.parametrize(
    ("pipeline_class", "rank", "targets", "problem"),
    [
        ("FluxPipeline", 64, ("to_q", "to_k", "to_v", "to_out.0"), "to_q (fused into to_qkv)"),
        ("QwenImagePipeline", 64, ("to_q", "to_k", "to_v", "to_out.0"), "to_out.0 (named to_out)"),
        (
            "WanPipeline",
            64,
            ("to_q", "to_k", "to_v", "ffn.net.0.proj"),
            "ffn.net.0.proj (named ffn.net_0.proj)",
        ),
        ("QwenImagePipeline", 64, ("to_q", "to_k", "to_v"), None),
        ("FluxPipeline", 64, ("to_out.0", "proj_mlp"), None),
        ("QwenImagePipeline", 1024, ("to_q",), "rank 1024 is above vllm-omni's largest, 512"),
        ("QwenImagePipeline", 8, ("transformer_blocks.0.attn.to_out.0",), "to_out.0 (named to_out)"),
        # PEFT puts an adapter on every module whose name ends with the target
        ("WanPipeline", 8, ("net.0.proj",), "ffn.net.0.proj (named ffn.net_0.proj)"),
        ("FluxPipeline", 8, ("attn.to_k",), "to_k (fused into to_qkv)"),
    ],
)
def test_a_lora_vllm_omni_would_not_place_is_named(pipeline_class, rank, targets, problem):
    """Our default targets (q, k, v, out) are among those vllm-omni's peft LoRA loader cannot place on
    Flux, Qwen-Image or Wan (read from its code): refused, naming the target and why."""
    got = serving.vllm_omni_lora_problem(pipeline_class, rank, targets)
    assert (got is None) if problem is None else (problem in got), got


def test_a_lora_vllm_omni_export_vllm_omni_would_misplace_is_refused_before_training(tmp_path):
    from verl_dmd.main import compose_plan
    from verl_dmd.preflight import check_export_lora, check_export_targets

    source = tmp_path / "qwen"
    source.mkdir()
    (source / "model_index.json").write_text(json.dumps({"_class_name": "QwenImagePipeline"}))
    overrides = [f"model.teacher.path={source}", f"data.path={tmp_path}", "model.student.lora.rank=4", "model.fake_score.lora.rank=4",
                 "export.formats=[peft,lora_vllm_omni]", f"export.pipeline_source={source}"]  # fmt: skip
    check_export_targets(
        compose_plan("qwen_image_lora_dmd2", overrides)
    )  # the class serves: the LoRA is next
    with pytest.raises(PlanError) as err:
        check_export_lora(compose_plan("qwen_image_lora_dmd2", overrides))
    message = str(err.value)
    assert "\n" not in message and message.startswith("config key 'export.formats' lists lora_vllm_omni: ")
    assert "to_out.0 (named to_out)" in message and "fix: serve the merged student" in message
    check_export_lora(compose_plan("qwen_image_lora_dmd2", [*overrides,
                                      "model.student.lora.target_modules=[to_q,to_k,to_v]"]))  # fmt: skip


def test_lora_serving_formats_need_a_lora_student_and_the_peft_adapter_before_training():
    from verl_dmd.main import compose_plan

    with pytest.raises(
        PlanError, match=r"^config key 'export.formats' = \['peft', 'lora_pipeline'\]: the peft "
    ):
        compose_plan("digits_dmd2", ["export.formats=[peft,lora_pipeline]", "export.pipeline_source=/x"])
    with pytest.raises(
        PlanError, match=r"lora_pipeline serves the adapter of the peft format beside it; fix: "
    ):
        compose_plan("qwen_image_lora_dmd2", ["model.teacher.path=/t", "data.path=/d", "export.formats=[lora_pipeline]",
                                              "export.pipeline_source=/x"])  # fmt: skip


def test_a_pipeline_source_with_a_second_expert_is_refused(tmp_path):
    """A Wan 2.2 A14B pipeline as export.pipeline_source (the teacher named as a bare transformer directory):
    the export would ship the teacher's low-noise expert beside the student."""
    from verl_dmd.preflight import check_export_targets

    source = tmp_path / "wan22"
    source.mkdir()
    index = {"_class_name": "WanPipeline", "transformer": ["diffusers", "WanTransformer3DModel"],
             "transformer_2": ["diffusers", "WanTransformer3DModel"]}  # fmt: skip
    (source / "model_index.json").write_text(json.dumps(index))

    class Plan:
        class export:
            formats = ("peft", "pipeline")
            pipeline_source = str(source)

    with pytest.raises(
        PlanError, match=r"^config key 'export.pipeline_source' = .*a second transformer, transformer_2"
    ):
        check_export_targets(Plan)
    (source / "model_index.json").write_text(json.dumps({**index, "transformer_2": [None, None]}))
    check_export_targets(Plan)


def test_the_guidance_embedding_served_is_the_data_sets(tmp_path):
    from verl_dmd.data.prepared import FORMAT, MANIFEST

    class Plan:
        class data:
            path = str(tmp_path / "data")

    assert serving.constant_guidance(Plan, {"guidance_embeds": False}) == 1.0
    with pytest.raises(serving.ServingError, match=r"config key .data.path."):
        serving.constant_guidance(Plan, {"guidance_embeds": True})
    (tmp_path / "data").mkdir()
    manifest = {"format": FORMAT, "files": {}, "latent_shape": [16, 4, 4], "prompt_count": 0,
                "intent": {"encoding": {"constant_cond": {"guidance": 2.5}}}}  # fmt: skip
    (tmp_path / "data" / MANIFEST).write_text(json.dumps(manifest))
    assert serving.constant_guidance(Plan, {"guidance_embeds": True}) == 2.5
    manifest["intent"]["encoding"]["constant_cond"] = {}
    (tmp_path / "data" / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(serving.ServingError, match=r"no constant cond\.guidance"):
        serving.constant_guidance(Plan, {"guidance_embeds": True})


def test_a_scheduler_of_another_kind_is_replaced_and_a_non_velocity_student_refused():
    """Wan's teacher samples with UniPC: its student gets the flow-matching scheduler that re-noises."""
    unipc = {"_class_name": "UniPCMultistepScheduler", "num_train_timesteps": 1000, "flow_shift": 3.0}
    config = serving.diffusers_scheduler_config(unipc, 3.0)
    assert config["_class_name"] == serving.SCHEDULER_CLASS and "flow_shift" not in config
    got, want = diffusers_levels(config, 4), trained(4, 3.0)
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-6
    with pytest.raises(serving.ServingError, match="the student predicts x0"):
        serving.diffusers_scheduler_config(TEACHER_SCHEDULER, 1.0, parameterization="x0")


def test_wans_call_needs_the_levels_passed():
    """WanPipeline calls set_timesteps(N) without levels: the scheduler then spaces its own (to ~0.001, not
    1/N); docs/serving.md's call binds the unshifted levels to set_timesteps, which gives the trained ones."""
    import functools

    from diffusers import FlowMatchEulerDiscreteScheduler

    config = serving.diffusers_scheduler_config({"_class_name": "UniPCMultistepScheduler"}, 3.0)
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
    want = trained(4, 3.0)
    scheduler.set_timesteps(4)
    assert max(abs(a - b) for a, b in zip(scheduler.sigmas.tolist(), want, strict=True)) > 1e-2
    scheduler.set_timesteps = functools.partial(scheduler.set_timesteps, sigmas=[1.0, 0.75, 0.5, 0.25])
    scheduler.set_timesteps(4, device="cpu")  # as WanPipeline calls it
    assert max(abs(a - b) for a, b in zip(scheduler.sigmas.tolist(), want, strict=True)) < 1e-6
