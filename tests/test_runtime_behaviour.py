"""Runtime behaviour on 2 gloo ranks, and one regression test per FSDP2/PEFT trap in ../shared/TRAPS.md.

One spawn runs every scenario (tests/trap_scenarios.py). Each trap scenario runs
with the engine's guard and again with that guard removed inside the rank
process; the tests assert that the guarded run is right *and* that the
unguarded run shows the silent failure, so each test is known to fail if its
guard goes away.
"""

from __future__ import annotations

import pytest
import torch
import trap_scenarios
from dist_harness import run_ranks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("behaviour")
    (workdir / "peft").mkdir()
    return run_ranks(trap_scenarios.run_all, 2, workdir / "ranks", str(workdir / "peft"))


def scenario(results, name, rank=0):
    value = results[rank][name]
    assert "crashed" not in value, value.get("crashed")
    return value


def relative_error(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


# --------------------------------------------------------------------------- behaviours


def test_gradient_isolation_names_role_and_parameter(results):
    """A computer that unfreezes the base is rejected, naming the phase's role and a base parameter."""
    for rank in (0, 1):
        error = scenario(results, "gradient_isolation", rank)["error"]
        assert error.startswith("GradientIsolationError: gradient isolation broken in a fake_score phase")
        assert "parameter base." in error and "\n" not in error


def test_nonfinite_on_one_rank_skips_on_every_rank(results):
    """NaN on rank 1 only: both ranks skip, nothing advances, grads are cleared; the next phase steps."""
    for rank in (0, 1):
        got = scenario(results, "nonfinite_agreement", rank)
        assert got["poisoned"] == {"stepped": False, "skipped_reason": "non-finite loss on rank(s) [1]"}
        assert got["unchanged"] == {
            "weights": True,
            "exp_avg": True,
            "step": True,
            "lr_epoch": True,
            "ema": True,
        }
        assert got["grads_cleared"]
        assert got["healthy_stepped"] and got["moved_after"]


def test_count_normalizer_is_invariant_to_splits_and_unequal_ranks(results):
    """Count mode gives the same update for 1, 2, 4 micro-batches with 4 vs 8 samples per rank,
    equal to plain sample-mean training on the same 12 samples split 6/6 (float64)."""
    got = scenario(results, "normalizer_splits")
    reference_weights, reference_norm = got["mean/equal"]
    for accumulation in (1, 2, 4):
        weights, norm = got[f"count/{accumulation}"]
        assert abs(norm - reference_norm) / reference_norm < 1e-9
        for w, ref in zip(weights, reference_weights, strict=True):
            assert relative_error(w, ref) < 1e-9


def test_mixed_normalizer_modes_fail_closed(results):
    """A phase whose micro-batches mix None and counts raises a contract error."""
    error = scenario(results, "normalizer_splits")["mixed_error"]
    assert error.startswith("PhaseContractError:") and "one mode throughout" in error


def test_shared_layout_holds_one_copy_of_base_weights(results):
    """Per rank, frozen parameter bytes are one base copy in the shared layout and three when independent."""
    got = scenario(results, "memory")
    shared, independent = got["shared_base_adapters"], got["independent"]
    assert independent["frozen"] == 3 * shared["frozen"]
    assert shared["student"] == independent["student"] > 0
    assert shared["student_ema"] == independent["ema_state"] == shared["student"]


def test_parameters_are_partitioned_and_optimizers_disjoint(results):
    """Every parameter sits in exactly one role or the frozen set; each optimizer holds exactly its role's."""
    for layout, got in scenario(results, "partition").items():
        assert got == {"disjoint": True, "complete": True, "optimizers_exact": True, "all_dtensor": True}, (
            layout
        )


def test_activation_checkpointing_changes_no_number(results):
    """Recomputing activations in backward gives the same trained weights (float64)."""
    got = scenario(results, "activation_checkpointing")
    for a, b in zip(got[False], got[True], strict=True):
        assert relative_error(a, b) < 1e-12


def test_lora_init_from_peft_directory(results):
    """A saved PEFT adapter seeds the student exactly; wrong rank or a missing file is a one-line error."""
    got = scenario(results, "init_from_peft_dir")
    assert got["matches"]
    assert "config key 'model.student.lora.init_path'" in got["mismatch"] and "rank 4" in got["mismatch"]
    assert "adapter_config.json not found" in got["missing"]
    assert "\n" not in got["mismatch"] + got["missing"]


# --------------------------------------------------------------------------- traps


def test_trap_lazy_init_fixes_gradient_dtypes(results):
    """Guard: RoleEngine._finish_lazy_init (lazy init with both roles trainable). Without it a
    frozen first forward leaves FSDP2 with no gradient dtypes, so low-precision gradients are
    reduced in bf16/fp16 instead of float32, silently."""
    got = scenario(results, "trap_lazy_init_dtype")
    for dtype in ("bfloat16", "float16"):
        assert got[f"guarded/{dtype}"] == {"error": None, "dtypes": ["torch.float32/torch.float32"]}
        assert got[f"unguarded/{dtype}"]["dtypes"] == ["None/None"]


def test_trap_frozen_forward_between_student_forward_and_backward(results):
    """Guard: a role switch never freezes the trainable role (SharedBaseLayout.switch_adapter touches no
    flag; _activate re-asserts the trainable set). Switching through PEFT's API without the
    re-assertion, the teacher/fake-score forwards inside a student phase freeze the student's
    LoRA before backward: zero gradient, no update, and the phase still reports success."""
    got = scenario(results, "trap_switch_between_forward_and_backward")
    assert got["guarded"]["grad_norm"] > 0 and got["guarded"]["moved"]
    assert got["unguarded"] == {"grad_norm": 0.0, "moved": False, "stepped": True}


def test_trap_leaving_disabled_adapters_restores_trainable_set(results):
    """Guard: same re-assertion. Leaving the teacher (adapters disabled) inside a fake-score phase
    must leave exactly the fake score trainable; without the guard peft's switch leaves it frozen."""
    got = scenario(results, "trap_flags_after_disable")
    assert got["guarded"] == {"student": [False], "fake_score": [True], "student_ema": [False]}
    assert got["unguarded"]["fake_score"] == [False]


def test_trap_switching_adapters_flips_no_flags(results):
    """Guard: SharedBaseLayout.switch_adapter sets PEFT's active adapter without PEFT's requires_grad side
    effects, so gathered copies (kept across the switches inside a phase) keep their flags. With
    LoRA on a root-unit module (proj_out), switching through PEFT's set_adapter flips the flags of
    the gathered copies after the student's forward: that module's LoRA silently gets no gradient."""
    got = scenario(results, "trap_switch_flips_no_flags")
    assert got["guarded"]["root_lora_moved"] and got["guarded"]["block_lora_moved"]
    assert not got["unguarded"]["root_lora_moved"] and got["unguarded"]["block_lora_moved"]
    assert got["unguarded"]["grad_norm"] < got["guarded"]["grad_norm"]


def test_role_switches_inside_a_phase_regather_nothing(results):
    """Inside a phase the frozen forwards (fake score, teacher) switch roles without resharding: a
    phase reshards exactly twice (entering and leaving), with or without reshard_after_forward, in
    both layouts, and the trained weights equal resharding at every switch bit for bit, for the
    reference computer and for DMD2 with CFG, backward simulation, regression and both GAN terms."""
    got = scenario(results, "switch_keeps_gathered")
    assert set(got) == {f"{computer}/{layout}/{flag}" for computer in ("reference", "dmd2")
                        for layout in ("shared_base_adapters", "independent")
                        for flag in (True, False)}  # fmt: skip
    for case, value in got.items():
        assert value["equal"], case
        assert value["reshards"] == 2 * 3, (case, value)
        assert value["reference_reshards"] > value["reshards"], (case, value)


def test_frozen_weights_stored_in_compute_dtype_change_no_number(results):
    """With bfloat16 compute the frozen weights are stored in bfloat16 (half the bytes) and the
    trainable ones in float32; three phases of training and every role's forward are bit for bit
    those of frozen weights stored in float32 (FSDP2 rounds them to bfloat16 at each gather)."""
    got = scenario(results, "frozen_in_compute_dtype")
    for layout in ("shared_base_adapters", "independent"):
        value = got[layout]
        assert value["dtypes"] == {"frozen": ["torch.bfloat16"], "trainable": ["torch.float32"]}, layout
        assert value["reference_dtypes"]["frozen"] == ["torch.float32"], layout
        assert value["bytes_ratio"] == 0.5, layout
        assert value["equal"], layout


def test_trap_ema_swap_reshards_first(results):
    """Guard: reshard before swapping EMA shards in (independent, full weights). Without it the
    root unit's gathered student weights leak into the EMA forward."""
    got = scenario(results, "trap_ema_swap_needs_reshard")
    assert relative_error(got["guarded"], got["student"]) > 1e-4  # the EMA really differs
    assert relative_error(got["unguarded"], got["guarded"]) > 1e-6  # stale values changed the output


def test_trap_adapter_added_after_sharding(results):
    """Guard: RoleEngine.verify_layout at every phase. An adapter added after fully_shard is a
    plain replicated tensor whose gradients differ per rank and are never synchronized."""
    refused = scenario(results, "trap_adapter_after_shard")
    assert (
        refused["refused"].startswith("RuntimeError: parameter base.")
        and "after the engine sharded" in refused["refused"]
    )
    assert not refused["late_are_dtensors"]
    per_rank = refused["grads_per_rank"]
    assert per_rank[0] != per_rank[1]  # ranks would diverge


def test_trap_parameter_replaced_after_sharding(results):
    """verify_layout's kept tree (checked at every phase after the first) still sees a parameter object
    replaced on a known module; putting the sharded one back passes again. A child module removed is
    no error, but the kept tree lets it go (it would keep the module's parameters alive)."""
    got = scenario(results, "trap_parameter_replaced_after_shard")
    assert got["refused"] and got["refused"].startswith("RuntimeError: parameter base."), got["refused"]
    assert "after the engine sharded" in got["refused"]
    assert got["again"] is None
    assert got["root"] and "appeared after the engine sharded" in got["root"], got["root"]  # a new model
    assert got["restored"] is None
    assert got["removed"] is None and got["forgotten"] and got["back"] is None, got


def test_trap_cpu_offload_without_pinned_memory_on_cpu(results):
    """Guard: CPUOffloadPolicy(pin_memory=False) unless on CUDA. With pinned memory the CPU-only
    machine fails to build the offloaded model."""
    got = scenario(results, "trap_cpu_offload_pin_memory")
    assert got["guarded"] is True
    assert got["unguarded"] is not None and "accelerator" in got["unguarded"]


def test_runtime_never_sets_a_gradient_divide_factor():
    """The guard of the trap above, stated directly: no runtime module calls set_gradient_divide_factor."""
    import inspect

    from verl_dmd.runtime import engine, runtime, sharding

    for module in (engine, runtime, sharding):
        assert "set_gradient_divide_factor" not in inspect.getsource(module)
    assert torch.distributed.is_available()


def test_trap_gradient_divide_factor_fails_on_gloo(results):
    """Guard: count-mode division on the reduced gradients, never set_gradient_divide_factor.
    A count-mode divisor (not the world size) through FSDP2 needs PREMUL_SUM, which gloo lacks.
    (With factor = world size torch 2.13 takes another path and runs.)"""
    got = scenario(results, "trap_gradient_divide_factor_on_gloo")
    assert got["guarded"]["norm"] > 0
    assert "PREMUL_SUM" in got["unguarded"]


def test_trap_peft_loader_fails_on_sharded_model(results):
    """Guard: LoRA init from a PEFT directory happens before sharding (see the init test);
    peft's loader on the sharded model fails."""
    assert scenario(results, "trap_peft_state_dict_on_sharded_model")["unguarded"] is not None


def test_ema_copies_student_before_start_step(results):
    """ema.start_step=2: global step 1 copies the student into the EMA; from step 2 the EMA lags."""
    assert scenario(results, "ema_start_step") == {"equal_after_1": True, "equal_after_2": False}


def test_independent_student_can_differ_from_teacher(results):
    """Independent layout: a student built from its own config trains beside a different teacher."""
    got = scenario(results, "independent_student_from_other_config")
    assert got == {"student_blocks": 1, "teacher_blocks": 2, "stepped": True}


def test_ranks_with_different_metric_keys_fail_loudly(results):
    """Position-wise averaging of metrics is guarded: differing keys raise on every rank."""
    for rank in (0, 1):
        error = scenario(results, "metric_keys_must_agree", rank)["error"]
        assert error is not None and "different metric keys" in error


def test_a_metric_some_micro_batches_report_is_their_mean(results):
    """2 ranks x 2 micro-batches: a metric every micro-batch reports is the mean of the four values; one only
    the first micro-batch of each rank reports is the mean of those two (not halved by the micro-batches
    that did not report it)."""
    for rank in (0, 1):
        assert scenario(results, "metric_of_some_micro_batches", rank) == {"every": 5.5, "first_only": 100.5}


def test_trap_dit_keeps_block_zero_in_the_root_unit(results):
    """Guard: DiTAdapter.fsdp_units leaves block 0 in the root. DiT's forward reads
    transformer_blocks[0].norm1.emb outside block 0; sharding every block fails on mixed
    tensors. The guarded forward equals an unsharded single-process forward."""
    from runtime_scenarios import make_plan

    from verl_dmd.adapters import get_adapter
    from verl_dmd.adapters.base import ModelSource

    got = scenario(results, "trap_dit_block_zero_in_root")
    assert got["unguarded"] is not None and "DTensor" in got["unguarded"]
    plan = make_plan("dit", "shared_base_adapters")
    adapter = get_adapter("dit")()
    torch.manual_seed(plan.trainer.seed)
    model = adapter.build_model(ModelSource.of(plan.model.teacher)).eval()  # eval: no CFG label dropout
    x0, cond = adapter.example_batch(model, 4, torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = adapter.predict(model, x0, torch.full((4,), 0.5), cond)
    assert relative_error(got["guarded"], want) < 1e-5


def test_frozen_roles_run_in_eval_mode_even_with_peft_dropout(tmp_path):
    """A teacher loaded from a directory is in eval mode, PEFT's injected dropout layers in train mode;
    after construction every module is in eval mode, and a phase puts only its own model in train mode."""
    import torch

    from verl_dmd.adapters import get_adapter
    from verl_dmd.adapters.base import ModelSource

    torch.manual_seed(0)
    adapter = get_adapter("dit")()
    adapter.build_model(ModelSource(config=adapter.tiny_config)).save_pretrained(tmp_path / "teacher")
    (result,) = run_ranks(trap_scenarios.lora_dropout_modes, 1, tmp_path / "ranks", str(tmp_path / "teacher"))
    assert result["built"] == {"teacher": [False], "student": [False], "fake_score": [False]}
    assert result["fake_phase"] == {"teacher": [False], "student": [False], "fake_score": [True]}
    assert result["after"] == result["built"]


def test_mode_switch_sets_every_module_and_respects_train_overrides():
    """The engine sets train/eval on a cached module list instead of walking the tree; a model with a
    module that overrides `train` goes through `model.train`, so the override still runs."""
    import types

    from torch import nn

    from verl_dmd.runtime.engine import RoleEngine

    calls = []

    class Custom(nn.Linear):
        def train(self, mode=True):
            calls.append(mode)
            return super().train(mode)

    fake = types.SimpleNamespace(_module_cache={})
    plain = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Dropout(0.5), nn.Linear(2, 2)))
    custom = nn.Sequential(nn.Linear(2, 2), Custom(2, 2))
    for mode in (False, True, False):
        RoleEngine._set_mode(fake, "plain", plain, mode)
        RoleEngine._set_mode(fake, "custom", custom, mode)
        assert {m.training for m in plain.modules()} == {mode}
        assert {m.training for m in custom.modules()} == {mode}
    assert fake._module_cache["plain"][1] and not fake._module_cache["custom"][1]
    assert calls == [False, True, False]


def test_phase_parts_are_named_in_a_profiler_trace(tmp_path):
    """run_phase marks its parts with record_function, in order (scripts/trace_gaps.py charges the
    device's idle time to them): setup, compute per micro-batch, grad norm and its read-back, step, EMA
    (its range exists in every phase; it updates only after student steps), metrics."""
    from composite_scenarios import annotated_phases

    (names,) = run_ranks(
        annotated_phases, 1, tmp_path / "ranks", "shared_base_adapters", str(tmp_path / "t.json")
    )
    phase = ["verl_dmd.setup", "verl_dmd.compute", "verl_dmd.grad_norm", "verl_dmd.step", "verl_dmd.ema",
             "verl_dmd.metrics"]  # fmt: skip
    merged = [name for i, name in enumerate(names) if i == 0 or names[i - 1] != name]  # micro-batches
    assert merged == phase * 3, names
    assert names.count("verl_dmd.compute") > 3  # this plan splits some phases into micro-batches
