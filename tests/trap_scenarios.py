"""Rank-side scenarios for the runtime behaviour and trap tests (one spawn runs them all).

Each trap scenario runs twice: with the engine's guard, and with the guard
removed (monkeypatched inside this rank process), recording what happens. The
tests then assert that the guarded run is right and that the unguarded run shows
the silent failure the guard exists for.
"""

from __future__ import annotations

import contextlib
import traceback

import torch
import torch.distributed as dist
from peft import LoraConfig
from runtime_scenarios import default_dtype, full, local_part, make_plan
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.tensor import DTensor

from verl_dmd.adapters import get_adapter
from verl_dmd.adapters.base import ModelSource
from verl_dmd.algorithms.reference import ReferenceRegressionComputer, regression_batch
from verl_dmd.phases import PhaseOutput, PhaseRequest, Role
from verl_dmd.runtime import sharding as sharding_module
from verl_dmd.runtime.engine import RoleEngine
from verl_dmd.runtime.layouts import SharedBaseLayout
from verl_dmd.runtime.runtime import DistillationRoleRuntime

FAMILY = "sd3"
SHARED = "shared_base_adapters"


def _request(role: Role, step: int = 0) -> PhaseRequest:
    return PhaseRequest(role=role, global_step=0, role_step=step, phase_index=step)


def _setup(layout: str = SHARED, computer_kwargs=None, **overrides):
    plan = make_plan(FAMILY, layout, **overrides)
    adapter = get_adapter(FAMILY)()
    engine = RoleEngine(plan, adapter)
    runtime = DistillationRoleRuntime(engine, ReferenceRegressionComputer(adapter, **(computer_kwargs or {})))
    return plan, adapter, engine, runtime


def _batch(adapter, engine, rank, world, size=8, seed=0):
    return local_part(regression_batch(adapter, engine.module_for(Role.STUDENT), size, seed), rank, world)


def _weights(engine, role: Role) -> list[torch.Tensor]:
    return [full(p).detach().clone() for p in engine.params[role]]


def _error(fn) -> str | None:
    try:
        fn()
    except Exception as err:  # recorded, asserted in the test process
        return f"{type(err).__name__}: {err}"
    return None


@contextlib.contextmanager
def patched(obj, name, value):
    original = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, original)


# --------------------------------------------------------------------------- behaviours


def gradient_isolation(rank, world):
    _, adapter, engine, runtime = _setup(computer_kwargs={"leak_frozen": True})
    message = _error(
        lambda: runtime.run_phase(_request(Role.FAKE_SCORE), _batch(adapter, engine, rank, world))
    )
    return {"error": message}


def nonfinite_agreement(rank, world):
    _, adapter, engine, runtime = _setup()
    runtime.run_phase(_request(Role.FAKE_SCORE), _batch(adapter, engine, rank, world, seed=1))
    optimizer = engine.optimizers[Role.FAKE_SCORE]

    def snapshot():
        first = engine.params[Role.FAKE_SCORE][0]
        state = optimizer.state[first]
        return {
            "weights": _weights(engine, Role.FAKE_SCORE),
            "exp_avg": full(state["exp_avg"]).clone(),
            "step": float(state["step"]),
            "lr_epoch": engine.schedulers[Role.FAKE_SCORE].last_epoch,
            "ema": _weights(engine, Role.STUDENT_EMA),
        }

    before = snapshot()
    runtime.computer.nan_on_rank = 1
    poisoned = runtime.run_phase(_request(Role.FAKE_SCORE, 1), _batch(adapter, engine, rank, world, seed=2))
    after = snapshot()
    grads_cleared = all(p.grad is None for p in engine.params[Role.FAKE_SCORE])
    runtime.computer.nan_on_rank = None
    healthy = runtime.run_phase(_request(Role.FAKE_SCORE, 1), _batch(adapter, engine, rank, world, seed=2))
    return {
        "poisoned": {k: poisoned[k] for k in ("stepped", "skipped_reason")},
        "unchanged": {
            "weights": all(
                torch.equal(a, b) for a, b in zip(before["weights"], after["weights"], strict=True)
            ),
            "exp_avg": torch.equal(before["exp_avg"], after["exp_avg"]),
            "step": before["step"] == after["step"],
            "lr_epoch": before["lr_epoch"] == after["lr_epoch"],
            "ema": all(torch.equal(a, b) for a, b in zip(before["ema"], after["ema"], strict=True)),
        },
        "grads_cleared": grads_cleared,
        "healthy_stepped": healthy["stepped"],
        "moved_after": not all(
            torch.equal(a, b)
            for a, b in zip(after["weights"], _weights(engine, Role.FAKE_SCORE), strict=True)
        ),
    }


def normalizer_splits(rank, world):
    """Count mode: identical updates for 1, 2, 4 micro-batches and unequal rank shares."""
    out = {}
    with default_dtype(torch.float64):
        for accumulation in (1, 2, 4):
            _, adapter, engine, runtime = _setup(
                computer_kwargs={"normalizer": "count"},
                **{"batch.fake_score.accumulation_steps": accumulation},
            )
            batch = regression_batch(adapter, engine.module_for(Role.STUDENT), 12, seed=5)
            # rank 0 holds 4 samples, rank 1 holds 8: unequal counts
            share = {k: (v[:4] if rank == 0 else v[4:]) for k, v in batch.items()}
            metrics = runtime.run_phase(_request(Role.FAKE_SCORE), share)
            out[f"count/{accumulation}"] = (
                _weights(engine, Role.FAKE_SCORE),
                metrics["fake_score/grad_norm"],
            )
        _, adapter, engine, runtime = _setup()
        batch = regression_batch(adapter, engine.module_for(Role.STUDENT), 12, seed=5)
        metrics = runtime.run_phase(_request(Role.FAKE_SCORE), local_part(batch, rank, world))
        out["mean/equal"] = (_weights(engine, Role.FAKE_SCORE), metrics["fake_score/grad_norm"])
    _, adapter, engine, runtime = _setup(computer_kwargs={"normalizer": "mixed"})
    out["mixed_error"] = _error(
        lambda: runtime.run_phase(_request(Role.FAKE_SCORE), _batch(adapter, engine, rank, world))
    )
    return out


def memory(rank, world):
    return {layout: _setup(layout)[2].parameter_bytes() for layout in (SHARED, "independent")}


def partition(rank, world):
    """Every parameter in exactly one place; each optimizer holds exactly its role's parameters."""
    out = {}
    for layout in (SHARED, "independent"):
        engine = _setup(layout)[2]
        groups = [*(engine.params[r] for r in engine.params), engine.frozen_params]
        ids = [id(p) for group in groups for p in group]
        every = [id(p) for model in engine.models.values() for p in model.parameters()]
        optimizer_ids = {
            role.value: sorted(id(p) for g in engine.optimizers[role].param_groups for p in g["params"])
            for role in engine.optimizers
        }
        out[layout] = {
            "disjoint": len(ids) == len(set(ids)),
            "complete": sorted(ids) == sorted(every),
            "optimizers_exact": all(
                optimizer_ids[role.value] == sorted(map(id, engine.params[role]))
                for role in engine.optimizers
            ),
            "all_dtensor": all(
                isinstance(p, DTensor) for model in engine.models.values() for p in model.parameters()
            ),
        }
    return out


def activation_checkpointing(rank, world):
    out = {}
    with default_dtype(torch.float64):
        for flag in (False, True):
            _, adapter, engine, runtime = _setup(**{"model.activation_checkpointing": flag})
            for step, role in enumerate((Role.FAKE_SCORE, Role.STUDENT)):
                runtime.run_phase(_request(role, step), _batch(adapter, engine, rank, world, seed=10 + step))
            out[flag] = _weights(engine, Role.STUDENT) + _weights(engine, Role.FAKE_SCORE)
    return out


def init_from_peft_dir(rank, world, directory):
    """A saved PEFT adapter seeds the student; a rank mismatch is a one-line error."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    adapter = get_adapter(FAMILY)()
    plan = make_plan(FAMILY, SHARED)
    if rank == 0:
        torch.manual_seed(123)
        model = adapter.build_model(ModelSource.of(plan.model.teacher))
        config = LoraConfig(r=4, lora_alpha=4, target_modules=list(adapter.default_lora_targets))
        model.add_adapter(config, adapter_name="saved")
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)
        state = get_peft_model_state_dict(model, adapter_name="saved")
        save_file({k: v.contiguous() for k, v in state.items()}, f"{directory}/adapter_model.safetensors")
        config.save_pretrained(directory)
        torch.save({k: v for k, v in state.items()}, f"{directory}/expected.pt")
    dist.barrier()
    _, adapter, engine, _ = _setup(**{"model.student.lora.init_path": directory})
    expected = torch.load(f"{directory}/expected.pt", weights_only=True)
    loaded = {}
    for p in engine.params[Role.STUDENT]:
        name = engine.param_names[id(p)].split(".", 1)[1].replace(".student.", ".")
        loaded[name] = full(p)
    matches = sorted(loaded) == sorted(expected) and all(
        torch.equal(loaded[k], expected[k]) for k in expected
    )
    mismatch = _error(
        lambda: _setup(**{"model.student.lora.init_path": directory, "model.student.lora.rank": 8})
    )
    missing = _error(lambda: _setup(**{"model.student.lora.init_path": f"{directory}/nope"}))
    return {"matches": matches, "mismatch": mismatch, "missing": missing}


# --------------------------------------------------------------------------- traps


def _group_dtypes(engine) -> list[str]:
    """FSDP2's per-group (original, reduce) gradient dtypes of the groups holding trainable LoRA."""
    out = []
    for module in engine.fsdp_modules():
        for group in module._get_fsdp_state()._fsdp_param_groups:
            if any(".lora_" in fqn for fqn in (p._param_fqn or "" for p in group.fsdp_params)):
                out.append(f"{group._orig_dtype}/{group._reduce_dtype}")
    return sorted(set(out))


def trap_lazy_init_dtype(rank, world):
    """FSDP2 fixes gradient dtypes at lazy init; a frozen first forward must not decide them."""

    def attempt(param_dtype):
        _, adapter, engine, runtime = _setup(**{"model.param_dtype": param_dtype})
        batch = _batch(adapter, engine, rank, world)
        with torch.no_grad(), engine.use_role(Role.TEACHER) as teacher:  # a frozen role runs first
            cond = {k[5:]: v for k, v in batch.items() if k.startswith("cond.")}
            adapter.predict(teacher, batch["x_t"], batch["sigma"], cond)
        error = _error(lambda: runtime.run_phase(_request(Role.STUDENT), batch))
        return {"error": error, "dtypes": _group_dtypes(engine)}

    out = {}
    for param_dtype in ("bfloat16", "float16"):
        out[f"guarded/{param_dtype}"] = attempt(param_dtype)
        with patched(RoleEngine, "_finish_lazy_init", lambda self: None):
            out[f"unguarded/{param_dtype}"] = attempt(param_dtype)
    return out


def _switch_with_peft(self, role):
    """Switching through PEFT's API, which sets requires_grad on adapter weights as a side effect
    (what SharedBaseLayout.switch_adapter avoids); `self` is the layout."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in self.tuner_layers():
        if isinstance(module, BaseTunerLayer):
            if role is Role.TEACHER:
                module.enable_adapters(False)
            else:
                module.enable_adapters(True)
                module.set_adapter(Role.STUDENT.value if role is None else role.value, inference_mode=True)


def _activate_without_reassert(self, role):
    """A switch through PEFT's API with no re-assertion of the trainable set afterwards."""
    self.reshard()
    if self.layout.name == SHARED:
        _switch_with_peft(self.layout, role)
    self._active = role


_REAL_ACTIVATE = RoleEngine._activate


def _activate_always_resharding(self, role):
    """RoleEngine._activate resharding at every switch, also inside a phase (the reference)."""
    self.reshard()
    _REAL_ACTIVATE(self, role)


def switch_keeps_gathered(rank, world):
    """Role switches inside a phase re-gather nothing, and the numbers equal resharding at every switch.

    Two computers: the reference regression computer, and DMD2 with CFG, a 3-step student, the
    regression term and both GAN terms (the generator term takes autograd.grad through the fake
    score inside a student phase, after the student's forward, with its units possibly still
    gathered), in both layouts, with and without reshard_after_forward.
    """
    from dmd2_scenarios import dmd2_batch, dmd2_plan

    from verl_dmd.algorithms.dmd2 import DMD2Computer

    dmd2_overrides = {k: v for k, v in _plan_overrides(dmd2_plan()).items()}
    out = {}
    for computer_name in ("reference", "dmd2"):
        for layout in (SHARED, "independent"):
            for reshard_after_forward in (True, False):
                overrides = {"model.reshard_after_forward": reshard_after_forward}
                if computer_name == "dmd2":
                    overrides.update(dmd2_overrides)

                def train(reference: bool, layout=layout, overrides=overrides, computer_name=computer_name):
                    plan = make_plan(FAMILY, layout, **overrides)
                    adapter = get_adapter(FAMILY)()
                    if computer_name == "dmd2":
                        computer = DMD2Computer(adapter, plan.algorithm, seed=plan.trainer.seed, rank=rank)
                    else:
                        computer = ReferenceRegressionComputer(adapter)
                    engine = RoleEngine(plan, adapter, extra_modules=computer.extra_modules())
                    runtime = DistillationRoleRuntime(engine, computer)
                    calls = []
                    real = engine.reshard
                    engine.reshard = lambda: calls.append(1) or real()
                    context = (
                        patched(RoleEngine, "_activate", _activate_always_resharding)
                        if reference
                        else contextlib.nullcontext()
                    )
                    with context:
                        for step, role in enumerate((Role.FAKE_SCORE, Role.STUDENT, Role.FAKE_SCORE)):
                            if computer_name == "dmd2":
                                batch = local_part(
                                    dmd2_batch(adapter, engine.module_for(role), 4 * world, seed=step),
                                    rank,
                                    world,
                                )
                            else:
                                batch = _batch(adapter, engine, rank, world, seed=step)
                            runtime.run_phase(_request(role, step), batch)
                    state = [*_weights(engine, Role.STUDENT), *_weights(engine, Role.FAKE_SCORE)]
                    state += [full(t).detach().clone() for t in engine.ema.own_tensors]
                    if layout == SHARED:
                        state += _weights(engine, Role.STUDENT_EMA)
                    return state, len(calls)

                kept, reshards = train(False)
                reference, reference_reshards = train(True)
                out[f"{computer_name}/{layout}/{reshard_after_forward}"] = {
                    "equal": all(torch.equal(a, b) for a, b in zip(kept, reference, strict=True)),
                    "reshards": reshards,
                    "reference_reshards": reference_reshards,
                }
    return out


def frozen_in_compute_dtype(rank, world):
    """bfloat16 compute: frozen weights stored in bfloat16 train and predict exactly as stored in float32."""
    out = {}
    for layout in (SHARED, "independent"):

        def run(store_low: bool, layout=layout):
            overrides = {"model.param_dtype": "bfloat16", "model.reduce_dtype": "float32"}
            with patched(RoleEngine, "STORE_FROZEN_IN_COMPUTE_DTYPE", store_low):
                _, adapter, engine, runtime = _setup(layout, **overrides)
            dtypes = {
                "frozen": sorted({str(local_part_of(p).dtype) for p in engine.frozen_params}),
                "trainable": sorted(
                    {str(local_part_of(p).dtype) for ps in engine.params.values() for p in ps}
                ),
            }
            for step, role in enumerate((Role.FAKE_SCORE, Role.STUDENT, Role.FAKE_SCORE)):
                runtime.run_phase(_request(role, step), _batch(adapter, engine, rank, world, seed=step))
            state = [*_weights(engine, Role.STUDENT), *_weights(engine, Role.FAKE_SCORE)]
            state += [full(t).detach().clone() for t in engine.ema.own_tensors]
            probe = _batch(adapter, engine, rank, world, seed=9)
            cond = {k[5:]: v for k, v in probe.items() if k.startswith("cond.")}
            with torch.no_grad():
                for role in (Role.TEACHER, Role.STUDENT, Role.FAKE_SCORE):
                    with engine.use_role(role) as model:
                        state.append(adapter.predict(model, probe["x_t"], probe["sigma"], cond).detach())
            return state, dtypes, engine.parameter_bytes()["frozen"]

        low, low_dtypes, low_bytes = run(True)
        high, high_dtypes, high_bytes = run(False)
        out[layout] = {
            "equal": all(torch.equal(a, b) for a, b in zip(low, high, strict=True)),
            "dtypes": low_dtypes,
            "reference_dtypes": high_dtypes,
            "bytes_ratio": low_bytes / high_bytes,
        }
    return out


def local_part_of(param) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def _plan_overrides(plan) -> dict:
    """The algorithm/batch/optim/data settings of a DMD2 test plan as make_plan overrides."""
    return {
        "algorithm.teacher_guidance_scale": plan.algorithm.teacher_guidance_scale,
        "algorithm.student_steps": plan.algorithm.student_steps,
        "algorithm.sigma_shift": plan.algorithm.sigma_shift,
        "batch.student.accumulation_steps": 1,
        "batch.fake_score.accumulation_steps": 1,
        "algorithm.regression_weight": plan.algorithm.regression_weight,
        "algorithm.gan_generator_weight": plan.algorithm.gan_generator_weight,
        "algorithm.gan_discriminator_weight": plan.algorithm.gan_discriminator_weight,
        "data.regression_pairs_path": plan.data.regression_pairs_path,
    }


def trap_switch_between_forward_and_backward(rank, world):
    """A frozen forward between the student's forward and backward must not drop its gradients."""

    def attempt():
        _, adapter, engine, runtime = _setup()
        before = _weights(engine, Role.STUDENT)
        metrics = runtime.run_phase(_request(Role.STUDENT), _batch(adapter, engine, rank, world))
        after = _weights(engine, Role.STUDENT)
        moved = not all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        return {"grad_norm": metrics["student/grad_norm"], "moved": moved, "stepped": metrics["stepped"]}

    guarded = attempt()
    with patched(RoleEngine, "_activate", _activate_without_reassert):
        unguarded = attempt()
    return {"guarded": guarded, "unguarded": unguarded}


def trap_flags_after_disable(rank, world):
    """Leaving the teacher (adapters disabled) must restore exactly the phase's trainable set."""

    def flags_after_teacher():
        _, _, engine, _ = _setup()
        with engine.trainable(Role.FAKE_SCORE), engine.use_role(Role.FAKE_SCORE):
            with engine.use_role(Role.TEACHER):
                pass
            return {
                role.value: sorted({p.requires_grad for p in params})
                for role, params in engine.params.items()
            }

    guarded = flags_after_teacher()
    with patched(RoleEngine, "_activate", _activate_without_reassert):
        unguarded = flags_after_teacher()
    return {"guarded": guarded, "unguarded": unguarded}


def trap_switch_flips_no_flags(rank, world):
    """Flags flipped while parameters are gathered come back stale at the next reshard."""

    def attempt():
        # proj_out lives in the root unit, which keeps its gathered parameters after forward.
        targets = ["to_q", "to_k", "to_v", "to_out.0", "proj_out"]
        _, adapter, engine, runtime = _setup(
            **{"model.student.lora.target_modules": targets, "model.fake_score.lora.target_modules": targets}
        )
        names = [engine.param_names[id(p)] for p in engine.params[Role.STUDENT]]
        before = _weights(engine, Role.STUDENT)
        metrics = runtime.run_phase(_request(Role.STUDENT), _batch(adapter, engine, rank, world))
        after = _weights(engine, Role.STUDENT)
        changed = {n: not torch.equal(a, b) for n, a, b in zip(names, before, after, strict=True)}
        return {
            "grad_norm": metrics["student/grad_norm"],
            "root_lora_moved": any(v for n, v in changed.items() if "proj_out.lora_B" in n),
            "block_lora_moved": any(v for n, v in changed.items() if "transformer_blocks" in n),
        }

    guarded = _error(attempt) or attempt()
    with patched(SharedBaseLayout, "switch_adapter", _switch_with_peft):
        unguarded = _error(attempt) or attempt()
    return {"guarded": guarded, "unguarded": unguarded}


def trap_ema_swap_needs_reshard(rank, world):
    """Independent full-weight EMA: swapping shards while the root holds gathered copies leaks stale values."""
    overrides = {
        "model.student.lora.rank": 0,
        "model.fake_score.lora.rank": 0,
        "export.formats": ["diffusers"],
        "ema.decay": 0.5,
    }

    def ema_forward(unguarded: bool):
        _, adapter, engine, runtime = _setup("independent", **overrides)
        runtime.run_phase(_request(Role.STUDENT), _batch(adapter, engine, rank, world, seed=3))
        runtime.run_phase(_request(Role.STUDENT, 1), _batch(adapter, engine, rank, world, seed=4))
        probe = _batch(adapter, engine, rank, world, seed=9)
        cond = {k[5:]: v for k, v in probe.items() if k.startswith("cond.")}
        context = patched(RoleEngine, "reshard", lambda self: None) if unguarded else contextlib.nullcontext()
        with context:
            # A grad-enabled forward (as in training): the root unit keeps its gathered weights.
            with engine.trainable(Role.STUDENT), engine.use_role(Role.STUDENT) as model:
                student = adapter.predict(model, probe["x_t"], probe["sigma"], cond).detach()
            with torch.no_grad(), engine.use_role(Role.STUDENT_EMA) as model:
                ema = adapter.predict(model, probe["x_t"], probe["sigma"], cond)
        return student, ema

    student, guarded = ema_forward(False)
    _, unguarded = ema_forward(True)
    return {"student": student, "guarded": guarded, "unguarded": unguarded}


def trap_adapter_after_shard(rank, world):
    """An adapter added after fully_shard is replicated and never synchronized. A phase runs first, so
    the check that catches it is the one of every later phase (verify_layout's kept module tree)."""
    _, adapter, engine, runtime = _setup()
    runtime.run_phase(_request(Role.FAKE_SCORE), _batch(adapter, engine, rank, world))
    base = engine.models["base"]
    torch.manual_seed(0)
    base.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["to_q"]), adapter_name="late")
    late = [p for n, p in base.named_parameters() if ".late." in n]
    refused = _error(
        lambda: runtime.run_phase(_request(Role.FAKE_SCORE), _batch(adapter, engine, rank, world))
    )
    # What would happen without the check: train the late adapter on each rank's own data.
    base.set_adapter("late")
    for p in late:
        p.requires_grad_(True)
    batch = _batch(adapter, engine, rank, world, seed=6)
    cond = {k[5:]: v for k, v in batch.items() if k.startswith("cond.")}
    adapter.predict(base, batch["x_t"], batch["sigma"], cond).square().mean().backward()
    grads = [p.grad.detach().clone() for p in late if p.grad is not None]
    gathered = [None] * world
    dist.all_gather_object(gathered, [g.sum().item() for g in grads])
    return {
        "refused": refused,
        "late_are_dtensors": any(isinstance(p, DTensor) for p in late),
        "grads_per_rank": gathered,
    }


def trap_parameter_replaced_after_shard(rank, world):
    """A parameter object replaced on a sharded module after phases ran (a plain tensor now) is refused
    at the next phase; the same module tree with the sharded parameter put back passes again."""
    _, adapter, engine, runtime = _setup()
    runtime.run_phase(_request(Role.FAKE_SCORE), _batch(adapter, engine, rank, world))
    module = next(m for m in engine.models["base"].modules() if m._parameters)
    name, sharded = next(iter(module._parameters.items()))
    setattr(module, name, torch.nn.Parameter(sharded.detach().to_local().clone(), requires_grad=False))
    refused = _error(
        lambda: runtime.run_phase(_request(Role.FAKE_SCORE), _batch(adapter, engine, rank, world))
    )
    setattr(module, name, sharded)
    again = _error(lambda: runtime.run_phase(_request(Role.FAKE_SCORE), _batch(adapter, engine, rank, world)))
    base = engine.models["base"]
    engine.models["base"] = torch.nn.Linear(2, 2)  # a whole model that is not the one sharded
    root = _error(engine.verify_layout)
    engine.models["base"] = base
    restored = _error(engine.verify_layout)
    # a child module removed: not an error, but the kept tree must let it go (a full walk forgets it)
    parent = next(m for m in base.modules() if m._modules)
    child_name, child = next(iter(parent._modules.items()))
    del parent._modules[child_name]
    removed = _error(engine.verify_layout)
    forgotten = id(child) not in engine.guard.known[2]
    parent._modules[child_name] = child
    back = _error(engine.verify_layout)
    return {"refused": refused, "again": again, "root": root, "restored": restored, "removed": removed,
            "forgotten": forgotten, "back": back}  # fmt: skip


def trap_cpu_offload_pin_memory(rank, world):
    """CPU offload with pinned memory needs an accelerator: the engine pins only on CUDA."""

    def attempt():
        _, adapter, engine, runtime = _setup(**{"model.teacher.cpu_offload": True})
        return runtime.run_phase(_request(Role.FAKE_SCORE), _batch(adapter, engine, rank, world))["stepped"]

    guarded = _error(attempt) or attempt()
    with patched(sharding_module, "CPUOffloadPolicy", lambda pin_memory: CPUOffloadPolicy(pin_memory=True)):
        unguarded = _error(attempt)
    return {"guarded": guarded, "unguarded": unguarded}


def trap_gradient_divide_factor_on_gloo(rank, world):
    """FSDP2's divide factor needs PREMUL_SUM, which gloo lacks; the runtime divides reduced grads itself."""

    def attempt(use_divide_factor: bool):
        _, adapter, engine, runtime = _setup(computer_kwargs={"normalizer": "count"})
        if use_divide_factor:
            for module in engine.fsdp_modules():
                module.set_gradient_divide_factor(3.0)  # a count-mode divisor, not the world size
        metrics = runtime.run_phase(_request(Role.FAKE_SCORE), _batch(adapter, engine, rank, world))
        return {"norm": metrics["fake_score/grad_norm"], "weights": _weights(engine, Role.FAKE_SCORE)}

    result = {
        "guarded": _error(lambda: attempt(False)) or attempt(False),
        "unguarded": _error(lambda: attempt(True)) or attempt(True),
    }
    # The failed phase leaves other PREMUL_SUM reduce-scatters of the same backward in flight; gloo's
    # barrier first waits for every work in flight and raises their error (without meeting the other
    # rank), so the next scenario's barrier failed now and then. A barrier that raised exchanged
    # nothing: retried until one meets, every rank meets exactly once.
    for _ in range(10):
        if _error(dist.barrier) is None:
            break
    return result


def trap_peft_state_dict_on_sharded_model(rank, world):
    """Adapter weights load before sharding; peft's loader on the sharded model fails."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    _, _, engine, _ = _setup()
    base = engine.models["base"]
    state = {k: full(v).clone() for k, v in get_peft_model_state_dict(base, adapter_name="student").items()}
    return {"unguarded": _error(lambda: set_peft_model_state_dict(base, state, adapter_name="student"))}


def ema_start_step(rank, world):
    """Before ema.start_step the EMA copies the student; from it on it lags behind."""
    _, adapter, engine, runtime = _setup(**{"ema.start_step": 2, "ema.decay": 0.5})
    out = {}
    for step in range(2):
        request = PhaseRequest(role=Role.STUDENT, global_step=step, role_step=step, phase_index=step)
        runtime.run_phase(request, _batch(adapter, engine, rank, world, seed=20 + step))
        student, ema = _weights(engine, Role.STUDENT), _weights(engine, Role.STUDENT_EMA)
        out[f"equal_after_{step + 1}"] = all(torch.equal(a, b) for a, b in zip(student, ema, strict=True))
    return out


def independent_student_from_other_config(rank, world):
    """Independent layout: the student may come from a different checkpoint/config than the teacher."""
    from runtime_scenarios import TINY_CONFIGS

    other = dict(TINY_CONFIGS[FAMILY], num_layers=1)
    _, adapter, engine, runtime = _setup(
        "independent",
        **{"model.student.config": other, "model.student.lora.rank": 0, "export.formats": ["diffusers"]},
    )
    metrics = runtime.run_phase(_request(Role.STUDENT), _batch(adapter, engine, rank, world))
    return {
        "student_blocks": len(engine.models["student"].transformer_blocks),
        "teacher_blocks": len(engine.models["teacher"].transformer_blocks),
        "stepped": metrics["stepped"],
    }


class _ExtraMetricOnRank1(ReferenceRegressionComputer):
    def compute_phase(self, request, batch, runtime, **loop):
        output = super().compute_phase(request, batch, runtime, **loop)
        if runtime.rank == 1:
            output = PhaseOutput(loss=output.loss, metrics={**output.metrics, "extra": 1.0})
        return output


def metric_keys_must_agree(rank, world):
    """Metrics are averaged by position: a rank with different keys fails the phase on every rank."""
    _, adapter, engine, runtime = _setup()
    runtime.computer = _ExtraMetricOnRank1(adapter)
    return {
        "error": _error(
            lambda: runtime.run_phase(_request(Role.FAKE_SCORE), _batch(adapter, engine, rank, world))
        )
    }


class _MetricOnFirstMicroBatch(ReferenceRegressionComputer):
    def compute_phase(self, request, batch, runtime, *, micro_batch_index, num_micro_batches):
        output = super().compute_phase(
            request, batch, runtime, micro_batch_index=micro_batch_index, num_micro_batches=num_micro_batches
        )
        extra = {"every": 10.0 * runtime.rank + micro_batch_index}
        if micro_batch_index == 0:
            extra["first_only"] = torch.tensor(100.0 + runtime.rank)
        return PhaseOutput(loss=output.loss, metrics={**output.metrics, **extra})


def metric_of_some_micro_batches(rank, world):
    """A metric that only some micro-batches report is the mean over those, of every rank."""
    _, adapter, engine, runtime = _setup()
    runtime.computer = _MetricOnFirstMicroBatch(adapter)
    metrics = runtime.run_phase(_request(Role.FAKE_SCORE), _batch(adapter, engine, rank, world))
    return {k: metrics[f"fake_score/{k}"] for k in ("every", "first_only")}


def trap_dit_block_zero_in_root(rank, world):
    """DiT reads block 0's label embedding outside block 0: sharding block 0 as a unit breaks."""
    from verl_dmd.adapters.diffusers_transformers import DiTAdapter

    def forward(all_blocks_as_units: bool):
        units = (
            (lambda self, model: list(model.transformer_blocks))
            if all_blocks_as_units
            else DiTAdapter.fsdp_units
        )
        with patched(DiTAdapter, "fsdp_units", units):
            plan = make_plan("dit", SHARED)
            adapter = get_adapter("dit")()
            engine = RoleEngine(plan, adapter)
            x0, cond = adapter.example_batch(
                engine.module_for(Role.STUDENT), 4, torch.Generator().manual_seed(0)
            )
            with torch.no_grad(), engine.use_role(Role.TEACHER) as teacher:
                return adapter.predict(teacher, x0, torch.full((4,), 0.5), cond)

    guarded = _error(lambda: forward(False)) or forward(False)
    return {"guarded": guarded, "unguarded": _error(lambda: forward(True))}


SCENARIOS = {
    "trap_dit_block_zero_in_root": trap_dit_block_zero_in_root,
    "metric_keys_must_agree": metric_keys_must_agree,
    "metric_of_some_micro_batches": metric_of_some_micro_batches,
    "trap_gradient_divide_factor_on_gloo": trap_gradient_divide_factor_on_gloo,
    "trap_peft_state_dict_on_sharded_model": trap_peft_state_dict_on_sharded_model,
    "ema_start_step": ema_start_step,
    "independent_student_from_other_config": independent_student_from_other_config,
    "gradient_isolation": gradient_isolation,
    "nonfinite_agreement": nonfinite_agreement,
    "normalizer_splits": normalizer_splits,
    "memory": memory,
    "partition": partition,
    "activation_checkpointing": activation_checkpointing,
    "trap_lazy_init_dtype": trap_lazy_init_dtype,
    "trap_switch_between_forward_and_backward": trap_switch_between_forward_and_backward,
    "trap_flags_after_disable": trap_flags_after_disable,
    "trap_switch_flips_no_flags": trap_switch_flips_no_flags,
    "switch_keeps_gathered": switch_keeps_gathered,
    "frozen_in_compute_dtype": frozen_in_compute_dtype,
    "trap_ema_swap_needs_reshard": trap_ema_swap_needs_reshard,
    "trap_adapter_after_shard": trap_adapter_after_shard,
    "trap_parameter_replaced_after_shard": trap_parameter_replaced_after_shard,
    "trap_cpu_offload_pin_memory": trap_cpu_offload_pin_memory,
}


def run_all(rank, world, directory):
    """Every scenario; a scenario that crashes is recorded, not fatal, so the others still report."""
    results = {}
    for name, fn in SCENARIOS.items():
        try:
            results[name] = fn(rank, world)
        except Exception:
            results[name] = {"crashed": traceback.format_exc()}
        dist.barrier()
    try:
        results["init_from_peft_dir"] = init_from_peft_dir(rank, world, directory)
    except Exception:
        results["init_from_peft_dir"] = {"crashed": traceback.format_exc()}
    return results


def lora_dropout_modes(rank: int, world_size: int, teacher_dir: str) -> dict:
    """PEFT's dropout layers, injected into a model loaded in eval mode, start in train mode: the
    engine must still run every frozen role in eval mode (review finding on train/eval switching)."""
    from runtime_scenarios import make_plan

    from verl_dmd.adapters import get_adapter
    from verl_dmd.phases import Role
    from verl_dmd.runtime.engine import RoleEngine

    lora = {"rank": 4, "dropout": 0.5}
    plan = make_plan("dit", "independent", **{"model.teacher.config": None, "model.teacher.path": teacher_dir,
                                              "model.student.lora": lora, "model.fake_score.lora": lora})  # fmt: skip
    engine = RoleEngine(plan, get_adapter("dit")())

    def training(name):
        return sorted({m.training for m in engine.models[name].modules()})

    out = {"built": {name: training(name) for name in engine.models}}
    with engine.trainable(Role.FAKE_SCORE), engine.use_role(Role.FAKE_SCORE):
        out["fake_phase"] = {name: training(name) for name in engine.models}
    out["after"] = {name: training(name) for name in engine.models}
    return out
