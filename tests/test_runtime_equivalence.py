"""2 gloo ranks of the role runtime equal an independent single-process reference.

The reference below shares no code with the runtime beyond the model adapter
and the batch generator: it holds a plain PEFT model (or plain copies), switches
adapters with diffusers' own API, takes gradients with `torch.autograd.grad`
over the role's parameters, clips, and steps a plain AdamW on the whole global
batch at once. The runtime instead shards with FSDP2, splits each rank's share
into micro-batches, accumulates without sync, reduce-scatters, and switches
roles through `use_role`.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from dist_harness import run_ranks
from peft import LoraConfig
from runtime_scenarios import (
    CASES,
    FAKE_UPDATE_RATIO,
    PHASES,
    WARMUP,
    all_cases,
    default_dtype,
    global_batch,
    make_plan,
    probe_batch,
)

from verl_dmd.adapters import get_adapter
from verl_dmd.adapters.base import ModelSource
from verl_dmd.controller import DistillationController
from verl_dmd.phases import Role

pytestmark = pytest.mark.slow
WORLD_SIZE = 2
# Tolerances fixed before any run. float32: the bound, for quantities a single
# phase produces from an identical state. float64: trajectories through Adam, whose
# first step g / (|g| + eps) amplifies rounding of near-zero gradients (measured: a plain
# float32 reference is 6e-5 away from float64 truth on such a tensor), so they are
# compared in float64 where rounding is ~1e-16.
TOLERANCE_FP32 = 1e-5
TOLERANCE_FP64 = 1e-9


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    results = run_ranks(all_cases, WORLD_SIZE, tmp_path_factory.mktemp("equivalence"))
    return results


def _lora(role_names, adapter):
    return {
        name: LoraConfig(
            r=4, lora_alpha=4, target_modules=list(adapter.default_lora_targets), init_lora_weights=True
        )
        for name in role_names
    }


class Reference:
    """Plain single-process training of the same plan."""

    def __init__(
        self, family: str, layout: str, dtype: torch.dtype = torch.float32, world_size: int = WORLD_SIZE
    ) -> None:
        self.world_size = world_size  # the global batch is that of this many ranks
        with default_dtype(dtype):
            self._build(family, layout)

    def _build(self, family: str, layout: str) -> None:
        self.plan = make_plan(family, layout)
        self.adapter = get_adapter(family)()
        self.layout = layout
        torch.manual_seed(self.plan.trainer.seed)
        teacher = self.adapter.build_model(ModelSource.of(self.plan.model.teacher))
        teacher.requires_grad_(False)
        configs = _lora(("student", "fake_score", "student_ema"), self.adapter)
        if layout == "shared_base_adapters":
            for name in ("student", "fake_score", "student_ema"):
                teacher.add_adapter(configs[name], adapter_name=name)
            self.models = {role: teacher for role in Role}
        else:
            student = copy.deepcopy(teacher)
            student.add_adapter(configs["student"], adapter_name="student")
            fake = copy.deepcopy(teacher)
            fake.add_adapter(configs["fake_score"], adapter_name="fake_score")
            self.models = {Role.TEACHER: teacher, Role.STUDENT: student, Role.FAKE_SCORE: fake}
        self.params = {}
        for role in (Role.STUDENT, Role.FAKE_SCORE, Role.STUDENT_EMA):
            if role is Role.STUDENT_EMA and layout == "independent":
                continue
            model = self.models[Role.STUDENT if role is Role.STUDENT_EMA else role]
            self.params[role] = {
                n: p for n, p in model.named_parameters() if f".{role.value}." in n and "lora_" in n
            }
        if layout == "shared_base_adapters":
            with torch.no_grad():
                for name, p in self.params[Role.STUDENT].items():
                    self.params[Role.STUDENT_EMA][name.replace(".student.", ".student_ema.")].copy_(p)
            self.ema = None
        else:
            self.ema = {n: p.detach().clone() for n, p in self.params[Role.STUDENT].items()}
        self.optimizers = {}
        for role in (Role.STUDENT, Role.FAKE_SCORE):
            spec = getattr(self.plan.optim, role.value)
            self.optimizers[role] = torch.optim.AdamW(
                list(self.params[role].values()),
                lr=spec.lr,
                betas=spec.betas,
                eps=spec.eps,
                weight_decay=spec.weight_decay,
                foreach=False,
            )

    def activate(self, role: Role):
        model = self.models[role]
        if self.layout == "shared_base_adapters":
            if role is Role.TEACHER:
                model.disable_adapters()
            else:
                model.enable_adapters()
                model.set_adapter(role.value)
        for params in self.params.values():  # diffusers' switches flip flags; the reference keeps all on
            for p in params.values():
                p.requires_grad_(True)
        return model

    def predict(self, role, batch):
        cond = {k[5:]: v for k, v in batch.items() if k.startswith("cond.")}
        model = self.activate(role)
        return self.adapter.predict(model, batch["x_t"], batch["sigma"], cond)

    def train(self) -> list[tuple[str, float]]:
        controller = DistillationController(fake_update_ratio=FAKE_UPDATE_RATIO, fake_warmup_steps=WARMUP)
        norms = []
        for phase in range(PHASES):
            role = controller.next_phase()
            batch = global_batch(self.adapter, self.models[role], self.world_size, phase)
            prediction = self.predict(role, batch)
            target = batch["target"]
            if role is Role.STUDENT:
                with torch.no_grad():
                    target = target + 0.1 * (
                        self.predict(Role.TEACHER, batch) - self.predict(Role.FAKE_SCORE, batch)
                    )
                self.activate(Role.STUDENT)
            loss = (prediction - target).square().mean()
            params = list(self.params[role].values())
            grads = torch.autograd.grad(loss, params)
            norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
            clip = getattr(self.plan.optim, role.value).grad_clip
            scale = clip / (norm + 1e-6) if norm > clip else 1.0
            for p, g in zip(params, grads, strict=True):
                p.grad = g * scale if scale != 1.0 else g
            self.optimizers[role].step()
            self.optimizers[role].zero_grad(set_to_none=True)
            if role is Role.STUDENT:
                self._ema_step()
            controller.record(role, stepped=True)
            norms.append((role.value, norm))
        return norms

    def _ema_step(self):
        weight = 1.0 - self.plan.ema.decay
        with torch.no_grad():
            for name, p in self.params[Role.STUDENT].items():
                if self.ema is None:
                    self.params[Role.STUDENT_EMA][name.replace(".student.", ".student_ema.")].lerp_(p, weight)
                else:
                    self.ema[name].lerp_(p, weight)

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Put another run's trained adapter weights into this reference (an identical state)."""
        with torch.no_grad():
            for role, params in self.params.items():
                for name, p in params.items():
                    p.copy_(weights[f"{role.value}:{name}"])
            for name, ema in (self.ema or {}).items():
                ema.copy_(weights[f"student_ema:{name}"])

    def student_grads(self, batch) -> dict[str, torch.Tensor]:
        """Gradients of one student phase on `batch` (the whole global batch at once)."""
        prediction = self.predict(Role.STUDENT, batch)
        with torch.no_grad():
            shift = 0.1 * (self.predict(Role.TEACHER, batch) - self.predict(Role.FAKE_SCORE, batch))
        self.activate(Role.STUDENT)
        loss = (prediction - (batch["target"] + shift)).square().mean()
        params = self.params[Role.STUDENT]
        grads = torch.autograd.grad(loss, list(params.values()))
        return {f"student:{name}": g for name, g in zip(params, grads, strict=True)}

    def weights(self) -> dict[str, torch.Tensor]:
        out = {
            f"{role.value}:{n}": p.detach() for role, params in self.params.items() for n, p in params.items()
        }
        out.update({f"student_ema:{n}": t for n, t in (self.ema or {}).items()})
        return out

    def forwards(self) -> dict[str, torch.Tensor]:
        probe = probe_batch(self.adapter, self.models[Role.STUDENT], self.world_size)
        out = {}
        with torch.no_grad():
            for role in (Role.STUDENT, Role.FAKE_SCORE, Role.TEACHER):
                out[role.value] = self.predict(role, probe)
            if self.ema is None:
                out["student_ema"] = self.predict(Role.STUDENT_EMA, probe)
            else:
                ema_model = copy.deepcopy(self.models[Role.STUDENT])
                params = dict(ema_model.named_parameters())
                for name, value in self.ema.items():
                    params[name].copy_(value)
                cond = {k[5:]: v for k, v in probe.items() if k.startswith("cond.")}
                out["student_ema"] = self.adapter.predict(ema_model, probe["x_t"], probe["sigma"], cond)
        return out


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12))


IDS = [f"{family}-{layout}" for family, layout in CASES]


@pytest.mark.parametrize(("family", "layout"), CASES, ids=IDS)
def test_float64_trajectory_equals_reference(sharded, family, layout):
    """After fake/student/fake/fake/student phases on 2 ranks (micro-batched, sharded), every
    role's weights, per-role forwards and gradient norms equal the single-process reference."""
    with default_dtype(torch.float64):
        reference = Reference(family, layout, torch.float64)
        ref_norms = reference.train()
        ref_forwards = reference.forwards()
    rank0, rank1 = (result[f"{family}/{layout}/float64"] for result in sharded)

    expected_roles = ["fake_score", "student", "fake_score", "fake_score", "student"]
    assert [r for r, _ in rank0["norms"]] == [r for r, _ in ref_norms] == expected_roles
    for (_, got), (_, want) in zip(rank0["norms"], ref_norms, strict=True):
        assert abs(got - want) / want < TOLERANCE_FP64
    # the student's clip is below its gradient norm: clipping was exercised
    clip = reference.plan.optim.student.grad_clip
    assert any(role == "student" and norm > clip for role, norm in ref_norms), ref_norms

    ref_weights = reference.weights()
    assert sorted(rank0["weights"]) == sorted(ref_weights)
    moved = 0
    for name, want in ref_weights.items():
        assert torch.equal(rank0["weights"][name], rank1["weights"][name]), f"ranks disagree on {name}"
        assert relative_error(rank0["weights"][name], want) < TOLERANCE_FP64, name
        moved += int(want.abs().sum() > 0)
    assert moved > len(ref_weights) // 2  # not a comparison of two untouched inits

    for role, want in ref_forwards.items():
        assert torch.equal(rank0["forwards"][role], rank1["forwards"][role]), role
        assert relative_error(rank0["forwards"][role], want) < TOLERANCE_FP64, role
    # the roles really differ after training: a role switch that did nothing would fail here
    assert relative_error(rank0["forwards"]["student"], rank0["forwards"]["teacher"]) > 1e-4
    assert relative_error(rank0["forwards"]["fake_score"], rank0["forwards"]["student"]) > 1e-4
    assert relative_error(rank0["forwards"]["student_ema"], rank0["forwards"]["student"]) > 1e-6


@pytest.mark.parametrize(("family", "layout"), CASES, ids=IDS)
def test_float32_gradients_and_forwards_from_identical_state(sharded, family, layout):
    """From the state the float32 runtime trained to, the reference (given those weights)
    produces the same per-role forwards and the same student gradients (rel. error < 1e-5)."""
    rank0, rank1 = (result[f"{family}/{layout}/float32"] for result in sharded)
    reference = Reference(family, layout, torch.float32)
    reference.load_weights(rank0["weights"])
    probe = probe_batch(reference.adapter, reference.models[Role.STUDENT], WORLD_SIZE)

    ref_forwards = reference.forwards()
    for role, want in ref_forwards.items():
        assert torch.equal(rank0["forwards"][role], rank1["forwards"][role]), role
        assert relative_error(rank0["forwards"][role], want) < TOLERANCE_FP32, role

    ref_grads = reference.student_grads(probe)
    assert sorted(rank0["grads"]) == sorted(ref_grads)
    nonzero = 0
    for name, want in ref_grads.items():
        assert torch.equal(rank0["grads"][name], rank1["grads"][name]), name
        assert relative_error(rank0["grads"][name], want) < TOLERANCE_FP32, name
        nonzero += int(want.abs().sum() > 0)
    assert nonzero == len(ref_grads)  # trained B matrices: every LoRA tensor has a gradient
