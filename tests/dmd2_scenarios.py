"""Rank side of the DMD2 computer tests: a few real DMD2 phases, then one probed student phase."""

from __future__ import annotations

import torch
from runtime_scenarios import full, local_part, make_plan, strip_model_prefix

from verl_dmd.adapters import get_adapter
from verl_dmd.algorithms.dmd2 import DMD2Computer
from verl_dmd.controller import DistillationController
from verl_dmd.phases import PhaseRequest, Role
from verl_dmd.runtime.engine import RoleEngine
from verl_dmd.runtime.runtime import DistillationRoleRuntime

GUIDANCE = 3.0
STUDENT_STEPS = 3
PER_RANK = 4
REGRESSION_WEIGHT = 0.5
STUDENT_STEP = 2  # the probed student phase: PhaseRequest(global_step=1), so student step 2 (from 1)
GAN_GENERATOR_WEIGHT = 0.7
REGRESSION_PREFIX = "regression."  # large, so that a wrong GAN gradient cannot hide under the DMD term


def dmd2_plan(gan_sigma_max=None, gan_head="pooled", regression_decay_steps=None, gan_heads="shared"):
    return make_plan(
        "sd3",
        "shared_base_adapters",
        **{
            "algorithm.teacher_guidance_scale": GUIDANCE,
            "algorithm.student_steps": STUDENT_STEPS,
            "algorithm.sigma_shift": 2.0,
            "batch.student.accumulation_steps": 1,
            "batch.fake_score.accumulation_steps": 1,
            "optim.student.lr": 1e-2,
            "optim.fake_score.lr": 1e-2,
            "algorithm.regression_weight": REGRESSION_WEIGHT,
            "algorithm.regression_decay_steps": regression_decay_steps,
            "algorithm.gan_generator_weight": GAN_GENERATOR_WEIGHT,
            "algorithm.gan_discriminator_weight": 0.5,
            "algorithm.gan_sigma_max": gan_sigma_max,
            "algorithm.gan_head": gan_head,
            "algorithm.gan_heads": gan_heads,
            "data.regression_pairs_path": "pairs.safetensors",  # the batch below carries the pairs
        },
    )


def dmd2_batch(adapter, model, size: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x0, cond = adapter.example_batch(model, size, generator)
    batch = {"noise": torch.randn(x0.shape, generator=generator)}
    batch.update({f"cond.{k}": v for k, v in cond.items()})
    batch.update({f"uncond.{k}": torch.zeros_like(v) for k, v in cond.items()})
    target, pair_cond = adapter.example_batch(model, size, generator)
    batch["regression.noise"] = torch.randn(target.shape, generator=generator)
    batch["regression.target"] = target
    batch.update({f"regression.cond.{k}": v for k, v in pair_cond.items()})
    real, real_cond = adapter.example_batch(model, size, generator)
    batch["real.x0"] = real
    batch.update({f"real.cond.{k}": v for k, v in real_cond.items()})
    return batch


def probe_student_gradient(
    rank: int, world_size: int, gan_sigma_max=None, gan_head="pooled", regression_decay_steps=None
) -> dict:
    plan = dmd2_plan(gan_sigma_max, gan_head, regression_decay_steps)
    adapter = get_adapter("sd3")()
    computer = DMD2Computer(adapter, plan.algorithm, seed=plan.trainer.seed, rank=rank)
    engine = RoleEngine(plan, adapter, extra_modules=computer.extra_modules())
    runtime = DistillationRoleRuntime(engine, computer)
    controller = DistillationController(
        fake_update_ratio=plan.algorithm.fake_update_ratio, fake_warmup_steps=1
    )
    head = {n: full(p).detach().clone() for n, p in engine.extra_module("dmd_gan_head").named_parameters()}
    head_moves, phase_metrics = [], []

    def trained_weights():
        return {
            f"{role.value}:{strip_model_prefix(engine.param_names[id(p)])}": full(p).detach().clone()
            for role in (Role.STUDENT, Role.FAKE_SCORE)
            for p in engine.params[role]
        }

    for phase in range(4):  # fake (warmup), student, fake, fake: every role has moved
        if phase == 3:  # what the last fake-score phase starts from (its float64 reference replays it)
            before_fake = {
                "weights": trained_weights(),
                "state": {k: v.clone() for k, v in computer.state_dict().items()},
            }
        role = controller.next_phase()
        step = controller.student_steps if role is Role.STUDENT else controller.fake_steps
        request = PhaseRequest(
            role=role, global_step=controller.global_step, role_step=step, phase_index=phase
        )
        batch = dmd2_batch(adapter, engine.module_for(role), PER_RANK * world_size, seed=100 + phase)
        metrics = runtime.run_phase(request, local_part(batch, rank, world_size))
        assert metrics["stepped"], metrics
        controller.record(role, stepped=True)
        now = {n: full(p).detach().clone() for n, p in engine.extra_module("dmd_gan_head").named_parameters()}
        head_moves.append((role.value, any(not torch.equal(now[n], head[n]) for n in now)))
        head = now
        phase_metrics.append(metrics)
    weights = trained_weights()
    state = {k: v.clone() for k, v in computer.state_dict().items()}
    probe = dmd2_batch(adapter, engine.module_for(Role.STUDENT), PER_RANK * world_size, seed=999)
    request = PhaseRequest(role=Role.STUDENT, global_step=STUDENT_STEP - 1, role_step=1, phase_index=4)
    engine.zero_grad(Role.STUDENT)
    with engine.trainable(Role.STUDENT), engine.use_role(Role.STUDENT):
        output = computer.compute_phase(
            request,
            local_part(probe, rank, world_size),
            runtime.view,
            micro_batch_index=0,
            num_micro_batches=1,
        )
        output.loss.backward()
    grads = {
        f"student:{strip_model_prefix(engine.param_names[id(p)])}": full(p.grad).clone()
        for p in engine.params[Role.STUDENT]
    }
    exits = [computer.exit_index() for _ in range(20)]
    return {
        "weights": weights,
        "state": state,
        "grads": grads,
        "exits": exits,
        "metrics": {k: float(v) for k, v in output.metrics.items()},
        "head_moves": head_moves,
        "before_fake": before_fake,
        "phase_metrics": phase_metrics,
        "head_role": [
            role.value
            for role in Role
            if any(
                p is q
                for p in engine.extra_module("dmd_gan_head").parameters()
                for q in engine.params.get(role, [])
            )
        ],
    }


HEADS = ("dmd_gan_head", "dmd_gan_head_later")


def probe_per_exit_heads(rank: int, world_size: int) -> dict:
    """algorithm.gan_heads=per_exit_group: which head each phase moves, and which head a student phase's
    GAN generator term reads (perturbing a head must change the student's gradient only if it is read)."""
    plan = dmd2_plan(0.3, "conv", gan_heads="per_exit_group")
    adapter = get_adapter("sd3")()
    computer = DMD2Computer(adapter, plan.algorithm, seed=plan.trainer.seed, rank=rank)
    engine = RoleEngine(plan, adapter, extra_modules=computer.extra_modules())
    runtime = DistillationRoleRuntime(engine, computer)
    controller = DistillationController(
        fake_update_ratio=plan.algorithm.fake_update_ratio, fake_warmup_steps=1
    )

    def heads():
        return {h: [full(p).detach().clone() for p in engine.extra_module(h).parameters()] for h in HEADS}

    def next_exit() -> int:  # the phase's first draw from the shared stream, peeked and put back
        state = computer.shared.get_state()
        exit_index = computer.exit_index()
        computer.shared.set_state(state)
        return exit_index

    phases, gan_metrics = [], []
    before = heads()
    for phase in range(10):
        role = controller.next_phase()
        step = controller.student_steps if role is Role.STUDENT else controller.fake_steps
        request = PhaseRequest(
            role=role, global_step=controller.global_step, role_step=step, phase_index=phase
        )
        batch = dmd2_batch(adapter, engine.module_for(role), PER_RANK * world_size, seed=100 + phase)
        exit_index = next_exit()
        metrics = runtime.run_phase(request, local_part(batch, rank, world_size))
        assert metrics["stepped"], metrics
        controller.record(role, stepped=True)
        now = heads()
        moved = [
            h for h in HEADS if any(not torch.equal(a, b) for a, b in zip(now[h], before[h], strict=True))
        ]
        phases.append((role.value, exit_index, moved))
        gan_metrics.append((role.value, exit_index, {k: v for k, v in metrics.items() if "/gan_" in k}))
        before = now

    def student_grads(state) -> list[torch.Tensor]:
        computer.load_state_dict(state)
        request = PhaseRequest(role=Role.STUDENT, global_step=5, role_step=1, phase_index=10)
        probe = dmd2_batch(adapter, engine.module_for(Role.STUDENT), PER_RANK * world_size, seed=999)
        engine.zero_grad(Role.STUDENT)
        with engine.trainable(Role.STUDENT), engine.use_role(Role.STUDENT):
            output = computer.compute_phase(
                request, local_part(probe, rank, world_size), runtime.view, micro_batch_index=0,
                num_micro_batches=1,
            )  # fmt: skip
            output.loss.backward()
        return [full(p.grad).clone() for p in engine.params[Role.STUDENT]]

    def perturbed(head: str, state) -> list[torch.Tensor]:
        params = list(engine.extra_module(head).parameters())
        saved = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p in params:
                p.add_(0.5)
        grads = student_grads(state)
        with torch.no_grad():
            for p, q in zip(params, saved, strict=True):
                p.copy_(q)
        return grads

    reads = {}  # exit group -> {head: does perturbing it change the student's gradient}
    for _ in range(20):
        state = {k: v.clone() for k, v in computer.state_dict().items()}
        group = "first" if next_exit() == 0 else "later"
        if group not in reads:
            base = student_grads(state)
            assert all(
                torch.equal(a, b) for a, b in zip(base, student_grads(state), strict=True)
            )  # replays bitwise
            reads[group] = {
                head: any(not torch.equal(a, b) for a, b in zip(base, perturbed(head, state), strict=True))
                for head in HEADS
            }
        computer.load_state_dict(state)
        computer.exit_index()  # on to another exit
    return {"phases": phases, "reads": reads, "gan_metrics": gan_metrics}


def run_heads_in_bf16_with_accumulation(rank: int, world_size: int) -> list[str]:
    """bf16 parameters, two micro-batches per phase and every exit the first: the later steps' head never
    runs, and the first micro-batch's backward (no gradient sync) must still finish."""
    plan = make_plan(
        "sd3",
        "shared_base_adapters",
        **{
            "algorithm.student_steps": 3,
            "algorithm.first_exit_probability": 1.0,
            "algorithm.gan_generator_weight": 0.7,
            "algorithm.gan_discriminator_weight": 0.5,
            "algorithm.gan_sigma_max": 0.3,
            "algorithm.gan_head": "conv",
            "algorithm.gan_heads": "per_exit_group",
            "batch.student.accumulation_steps": 2,
            "batch.fake_score.accumulation_steps": 2,
            "model.param_dtype": "bfloat16",
            "model.reduce_dtype": "float32",
        },
    )
    adapter = get_adapter("sd3")()
    computer = DMD2Computer(adapter, plan.algorithm, seed=plan.trainer.seed, rank=rank)
    engine = RoleEngine(plan, adapter, extra_modules=computer.extra_modules())
    runtime = DistillationRoleRuntime(engine, computer)
    done = []
    for phase, role in enumerate([Role.FAKE_SCORE, Role.STUDENT, Role.FAKE_SCORE]):
        batch = dmd2_batch(adapter, engine.module_for(role), PER_RANK * world_size, seed=phase)
        batch = {k: v for k, v in batch.items() if not k.startswith(REGRESSION_PREFIX)}
        request = PhaseRequest(role=role, global_step=0, role_step=phase, phase_index=phase)
        metrics = runtime.run_phase(request, local_part(batch, rank, world_size))
        done.append(f"{role.value}:{bool(metrics['stepped'])}")
    return done


def per_exit_metrics_with_accumulation(rank: int, world_size: int) -> list:
    """gan_heads=per_exit_group, two micro-batches per phase, each exit group drawn half the time: per phase,
    the exits its micro-batches drew and its GAN metrics (a phase may mix the two heads)."""
    plan = make_plan(
        "sd3",
        "shared_base_adapters",
        **{
            "algorithm.student_steps": 3,
            "algorithm.first_exit_probability": 0.5,
            "algorithm.gan_generator_weight": 0.7,
            "algorithm.gan_discriminator_weight": 0.5,
            "algorithm.gan_sigma_max": 0.3,
            "algorithm.gan_head": "conv",
            "algorithm.gan_heads": "per_exit_group",
            "batch.student.accumulation_steps": 2,
            "batch.fake_score.accumulation_steps": 2,
        },
    )
    adapter = get_adapter("sd3")()
    computer = DMD2Computer(adapter, plan.algorithm, seed=plan.trainer.seed, rank=rank)
    engine = RoleEngine(plan, adapter, extra_modules=computer.extra_modules())
    runtime = DistillationRoleRuntime(engine, computer)
    out = []
    for phase in range(12):
        role = Role.FAKE_SCORE if phase % 2 == 0 else Role.STUDENT
        state = computer.shared.get_state()  # the exits of the two micro-batches, peeked and put back
        exits = [computer.exit_index(), computer.exit_index()]
        computer.shared.set_state(state)
        batch = dmd2_batch(adapter, engine.module_for(role), PER_RANK * world_size, seed=phase)
        batch = {k: v for k, v in batch.items() if not k.startswith(REGRESSION_PREFIX)}
        request = PhaseRequest(role=role, global_step=0, role_step=phase, phase_index=phase)
        metrics = runtime.run_phase(request, local_part(batch, rank, world_size))
        out.append((role.value, exits, {k: v for k, v in metrics.items() if "/gan_" in k}))
    return out
