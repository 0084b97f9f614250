"""Publishing a declared role to the inference replica (verl_dmd.runtime.weight_sync, verl_dmd.workers.replica).

The reference for a role's full weights is independent of the sync: the role read from the checkpoint the
same session saved (DCP, one process) and merged by PEFT's own merge, as `verl-dmd-export` writes it in
float32. The tiny SD3 pipeline is a real diffusers pipeline (verl_dmd.testing.pipelines).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch
from dist_harness import run_ranks
from weight_sync_scenarios import failing_sync_scenario, set_roles, sync_plan, sync_scenario

from verl_dmd.runtime.weight_sync import WeightSyncError, WeightSyncPlan


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory) -> Path:
    from verl_dmd.testing.pipelines import build_pipeline

    return build_pipeline("sd3", tmp_path_factory.mktemp("pipeline") / "sd3")


def exported(plan, checkpoint: str, role: str, out: Path) -> dict[str, torch.Tensor]:
    """`role`'s merged weights as verl-dmd-export writes them (float32)."""
    import dataclasses

    from verl_dmd.checkpoint.export import export_checkpoint

    plan = dataclasses.replace(plan, export=dataclasses.replace(plan.export, dtype="float32"))
    done = export_checkpoint(
        plan, checkpoint, role=role, formats=("diffusers",), output_dir=out, log=lambda _: None
    )
    (file,) = sorted((done / "diffusers").glob("*.safetensors"))
    return safetensors.torch.load_file(str(file))


def assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Every parameter `got` holds is `want`'s, bit for bit; `want` (a saved model) may also hold buffers."""
    assert got.keys() <= want.keys() and all(n.endswith("pos_embed") for n in want.keys() - got.keys())
    for name, tensor in got.items():
        assert torch.equal(tensor, want[name]), name


@pytest.mark.parametrize(("layout", "world_size"), [("shared_base_adapters", 2), ("independent", 1)])
def test_a_synced_role_is_its_full_weights_bit_for_bit_and_a_blend_is_exact(
    pipeline, tmp_path, layout, world_size
):
    """After a sync of student_ema the replica's transformer is the role's full weights (LoRA merged) bit for
    bit, gathered from 2 sharded ranks or 1; a blended sync of the student (decay 0.25) gives
    0.25 * EMA + 0.75 * student exactly; only the transformer's version moves."""
    out = tmp_path / "out"
    result = run_ranks(sync_scenario, world_size, tmp_path / "run", str(pipeline), layout, str(out))[0]
    plan = sync_plan(str(pipeline), layout, str(out))
    ema = exported(plan, result["checkpoint"], "student_ema", tmp_path / "ema")
    student = exported(plan, result["checkpoint"], "student", tmp_path / "student")
    teacher = safetensors.torch.load_file(str(sorted((pipeline / "transformer").glob("*.safetensors"))[0]))
    # The three differ, so a sync of the wrong role (or of nothing) would fail below.
    assert any(not torch.equal(ema[n], student[n]) for n in ema)
    assert any(not torch.equal(ema[n], teacher[n]) for n in ema)

    assert_bitwise(result["ema"], ema)
    blend = {n: ema[n].clone().mul_(0.25).add_(student[n], alpha=0.75) for n in result["ema"]}
    assert_bitwise(result["after_blend"], blend)
    assert result["first"]["versions"] == {"transformer": 1} and result["first"]["version"] == "student_ema@1"
    assert result["blended"]["versions"] == {"transformer": 2}
    state = result["state"]
    assert state["sources"]["transformer"] == "blend(student)" and state["syncs"] == 2
    assert {c: v for c, v in state["versions"].items() if c != "transformer"} == dict.fromkeys(
        [c for c in state["versions"] if c != "transformer"], 0
    )
    # One parameter (with its LoRA factors and delta) at a time, never the model.
    largest = max(t.numel() * 4 for t in result["ema"].values())
    assert 0 < result["first"]["gathered_peak_bytes"] <= 3 * largest + 4 * 64 * 1024
    assert result["first"]["gathered_peak_bytes"] < sum(t.numel() * 4 for t in result["ema"].values())


def test_the_replica_samples_as_the_trainer_and_keeps_what_a_sync_does_not_touch(pipeline, tmp_path):
    from verl_dmd.algorithms.sampling import renoise_draws, trained_schedule
    from verl_dmd.workers.group import LocalWorkerGroup, WorkerError

    plan = sync_plan(str(pipeline), "shared_base_adapters", str(tmp_path / "out"))
    group = LocalWorkerGroup(plan)
    try:
        group.init_model()
        set_roles(group.session.engine)
        replica = group.session._replica()
        prompts = ["a red cat", "two dogs on a beach"]
        cond = replica.encode(prompts, max_sequence_length=32)
        assert replica.encode(prompts, max_sequence_length=32).keys() == cond.keys()
        assert (replica.counters["text_cache_misses"], replica.counters["text_cache_hits"]) == (2, 2)

        synced = group.sync_replica("student_ema")
        state = group.replica_state()
        assert synced["version"] == "student_ema@1" and state["versions"]["transformer"] == 1
        assert all(v == 0 for c, v in state["versions"].items() if c != "transformer")
        again = replica.encode(prompts, max_sequence_length=32)  # the transformer sync kept the encodings
        assert (replica.counters["text_cache_misses"], replica.counters["text_cache_hits"]) == (2, 4)
        assert all(torch.equal(again[k], cond[k]) for k in cond)

        generator = torch.Generator().manual_seed(5)
        noise = torch.randn((2, 16, 4, 4), generator=generator)
        schedule = trained_schedule(plan.algorithm).tolist()
        draws = renoise_draws(noise.shape, len(schedule) - 1, generator)
        got, version = group.replica_few_step(noise, cond, schedule, draws)
        want = group.few_step("student_ema", noise, cond, schedule, draws)
        teacher = group.few_step("teacher", noise, cond, schedule, draws)
        assert version == "student_ema@1"
        assert float((got - want).abs().max()) < 1e-5
        assert float((got - teacher).abs().max()) > 1e-3  # it would tell the teacher from the EMA

        # A sync of another component (the VAE, here its own weights) keeps the encodings and bumps its version.
        from verl_dmd.workers.replica import ReplicaError

        vae = [("vae", n, p.detach().clone()) for n, p in replica.components["vae"].named_parameters()]
        replica.sync(WeightSyncPlan("teacher", ("vae",)), {"vae": replica.manifest("vae")}, vae)
        replica.encode(prompts, max_sequence_length=32)
        assert (replica.counters["text_cache_misses"], replica.counters["text_cache_hits"]) == (2, 6)
        assert replica.versions["vae"] == 1 and replica.versions["text_encoder"] == 0

        # A text encoder's sync (here: its own weights, doubled) drops its encodings and bumps its version only.
        encoder = replica.components["text_encoder"]
        manifest = replica.manifest("text_encoder")
        doubled = [("text_encoder", n, p.detach() * 2) for n, p in encoder.named_parameters()]
        replica.sync(WeightSyncPlan("teacher", ("text_encoder",)), {"text_encoder": manifest}, doubled)
        assert replica.versions["text_encoder"] == 1 and replica.versions["transformer"] == 1
        replica.encode(prompts, max_sequence_length=32)
        assert replica.counters["text_cache_misses"] == 4  # both prompts encoded again
        replica.encode(prompts, max_sequence_length=16)  # another length: other encodings
        assert replica.counters["text_cache_misses"] == 6

        # Refused before any transfer, with one line; the replica is unchanged.
        held = {n: p.detach().clone() for n, p in replica.components["transformer"].named_parameters()}
        with pytest.raises(WeightSyncError, match=r"^weight sync role = 'teachr': no such role; allowed: "):
            WeightSyncPlan("teachr")
        with pytest.raises(WeightSyncError, match=r"blend = 1.5: the decay must be in \[0, 1\)"):
            WeightSyncPlan("student", blend=1.5)
        with pytest.raises(
            WorkerError, match=r"the replica has no component 'unet'; it has text_encoder, "
        ) as err:
            group.sync_replica("student", components=("unet",))
        assert "\n" not in str(err.value)
        with pytest.raises(
            WorkerError, match=r"the role student holds no vae weights \(it holds transformer\)"
        ):
            group.sync_replica("student", components=("vae",))
        transformer = replica.manifest("transformer")
        name = next(iter(transformer))
        wrong_shape = {"transformer": {**transformer, name: ((1, 2), torch.float32)}}
        with pytest.raises(ReplicaError, match=rf"transformer\.{name} has shape \(1, 2\), the replica's"):
            replica.check(WeightSyncPlan("student"), wrong_shape)
        missing = {"transformer": {k: v for k, v in transformer.items() if k != name}}
        with pytest.raises(ReplicaError, match=rf"1 missing, 0 unexpected; missing {name}"):
            replica.check(WeightSyncPlan("student"), missing)
        assert replica.versions["transformer"] == 1 and replica.admitting
        assert_bitwise({n: p.detach() for n, p in replica.components["transformer"].named_parameters()}, held)

        # The teacher is the base with the adapters off: its full weights are the pipeline's own file.
        group.sync_replica("teacher")
        teacher_file = sorted((pipeline / "transformer").glob("*.safetensors"))[0]
        assert_bitwise({n: p.detach() for n, p in replica.components["transformer"].named_parameters()},
                       safetensors.torch.load_file(str(teacher_file)))  # fmt: skip

        # A transfer that ends short marks the component unknown: sampling refuses until a sync completes.
        with pytest.raises(ReplicaError, match="weights not sent"):
            replica.sync(WeightSyncPlan("student"), {"transformer": transformer}, iter([]))
        with pytest.raises(ReplicaError, match="the transformer weights are incomplete"):
            replica.few_step(noise, cond, schedule, draws)
        with pytest.raises(ReplicaError, match="a blend into it would be wrong"):
            replica.check(WeightSyncPlan("student", blend=0.5), {"transformer": transformer})
        group.sync_replica("student")
        assert group.replica_state()["versions"]["transformer"] == 3
        assert json.dumps(group.replica_state())  # plain data for the driver
    finally:
        group.close()


def test_a_sync_that_fails_on_rank_0_leaves_no_rank_waiting(pipeline, tmp_path):
    """2 gloo ranks: rank 0's transfer fails half way; the other rank finishes its gathers and returns, the
    engine's active role is restored, the replica's transformer is marked incomplete, and the next sync
    completes on both ranks."""
    result = run_ranks(failing_sync_scenario, 2, tmp_path / "run", str(pipeline), str(tmp_path / "out"))[0]
    assert result["failed"] == "disk full (injected)" and result["incomplete"] is None
    assert result["active"] is None and result["done"]["versions"] == {"transformer": 1}


@pytest.mark.parametrize("family", ["sd3", "flux", "qwen_image", "wan"])
def test_a_bf16_replica_takes_float32_latents_as_the_engine_does(family, tmp_path):
    """A replica in bf16 (the recipes' param dtype) samples from float32 noise and levels: its modules cast
    floating inputs to their dtype, as FSDP's mixed precision does for the training roles (the first
    full-size GPU runs failed here with "Input type (float) and bias type (BFloat16)": SD3, then Wan, whose
    transformer keeps some modules in float32, so its first parameter is not the dtype it computes in)."""
    from verl_dmd.adapters import get_adapter
    from verl_dmd.algorithms.sampling import renoise_draws
    from verl_dmd.testing.pipelines import build_pipeline
    from verl_dmd.workers.replica import InferenceReplica

    pipeline = build_pipeline(family, tmp_path / family)
    adapter = get_adapter(family)()
    replicas = {
        dtype: InferenceReplica(pipeline, adapter, dtype=dtype) for dtype in (torch.bfloat16, torch.float32)
    }
    high_replica = replicas[torch.float32]
    cond = high_replica.encode(["a red cat", "a blue dog"], max_sequence_length=16)  # float32 text, both
    transformer, vae = high_replica.components["transformer"], high_replica.components["vae"]
    for key, value in adapter.constant_cond(transformer.config, 3.5).items():
        cond[key] = torch.full((2,), float(value))
    shape = adapter.latent_shape(vae.config, transformer.config, 32, 32, 5 if family == "wan" else None)
    generator = torch.Generator().manual_seed(3)
    noise = torch.randn((2, *shape), generator=generator)
    schedule = [1.0, 0.5, 0.0]
    draws = renoise_draws(noise.shape, 2, generator)
    low = replicas[torch.bfloat16].few_step(noise, cond, schedule, draws)
    high = high_replica.few_step(noise, cond, schedule, draws)
    assert low.shape == noise.shape and torch.isfinite(low).all()
    # bf16 arithmetic, the same sampler: close to float32, not equal (the cast is real)
    error = float((low.float() - high).abs().max() / high.abs().max())
    assert 0 < error < 0.05, error
