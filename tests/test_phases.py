"""The phase contract: roles, requests, outputs and the loss-normalizer arithmetic."""

from __future__ import annotations

import math

import pytest
import torch

from verl_dmd.phases import (
    TRAINABLE_ROLES,
    LossNormalizerTracker,
    PhaseComputer,
    PhaseContractError,
    PhaseOutput,
    PhaseRequest,
    Role,
    validate_loss_normalizer,
)


def test_roles():
    """Four roles; only the student and the fake score are trainable; names are the plan's strings."""
    assert [r.value for r in Role] == ["student", "fake_score", "teacher", "student_ema"]
    assert TRAINABLE_ROLES == (Role.STUDENT, Role.FAKE_SCORE)
    assert Role("fake_score") is Role.FAKE_SCORE and Role.STUDENT == "student"
    assert not Role.TEACHER.trainable and not Role.STUDENT_EMA.trainable


def test_phase_request_accepts_role_names_and_rejects_frozen_roles():
    """A request names a trainable role; strings convert; frozen roles and bad counters fail closed."""
    request = PhaseRequest(role="student", global_step=3, role_step=3, phase_index=20)
    assert request.role is Role.STUDENT
    for role in (Role.TEACHER, "student_ema", "critic"):
        with pytest.raises(PhaseContractError, match=r"PhaseRequest\.role"):
            PhaseRequest(role=role, global_step=0, role_step=0, phase_index=0)
    for name, value in (("global_step", -1), ("role_step", 1.0), ("phase_index", True)):
        kwargs = {"global_step": 0, "role_step": 0, "phase_index": 0, name: value}
        with pytest.raises(PhaseContractError, match=f"PhaseRequest.{name}"):
            PhaseRequest(role=Role.FAKE_SCORE, **kwargs)


def test_phase_output_validates_loss():
    """The loss must be a 0-dim floating tensor."""
    PhaseOutput(loss=torch.tensor(1.0, requires_grad=True))
    bad = [1.0, torch.ones(2), torch.tensor(1), torch.ones(1, 1)]
    for loss in bad:
        with pytest.raises(PhaseContractError, match=r"PhaseOutput\.loss") as info:
            PhaseOutput(loss=loss)
        assert "\n" not in str(info.value)


def test_phase_output_metrics_are_detached_floats():
    """Metrics become python floats; graph-bearing, non-scalar or non-numeric values are refused."""
    out = PhaseOutput(loss=torch.tensor(0.5), metrics={"a": torch.tensor(2.0), "b": 3, "c": 1.5})
    assert dict(out.metrics) == {"a": 2.0, "b": 3.0, "c": 1.5}
    assert all(type(v) is float for v in out.metrics.values())
    with pytest.raises(TypeError):
        out.metrics["d"] = 1.0  # type: ignore[index]
    bad_metrics = [
        {"g": torch.tensor(1.0, requires_grad=True)},
        {"v": torch.ones(3)},
        {"s": "fast"},
        {"b": True},
        {"t": torch.tensor(True)},
        {"z": torch.tensor(1 + 2j)},
        {1: 1.0},
    ]
    for metrics in bad_metrics:
        with pytest.raises(PhaseContractError, match="metrics"):
            PhaseOutput(loss=torch.tensor(0.0), metrics=metrics)


def test_device_metrics_are_kept_without_reading_back():
    """A metric on a device stays there (reading it back would make the host wait for the device); the
    meta device has no values, so any read-back (.item()) would raise here."""
    value = torch.empty((1,), device="meta")
    out = PhaseOutput(loss=torch.tensor(0.5), metrics={"m": value, "f": 2})
    kept = out.metrics["m"]
    assert isinstance(kept, torch.Tensor) and kept.device.type == "meta" and kept.shape == ()
    assert out.metrics["f"] == 2.0
    for bad in (torch.empty((2,), device="meta"), torch.empty((), device="meta", requires_grad=True)):
        with pytest.raises(PhaseContractError, match="metrics"):
            PhaseOutput(loss=torch.tensor(0.0), metrics={"m": bad})


@pytest.mark.parametrize("value", [1, 2.5, 1e9, torch.tensor(7.0), torch.tensor([3])])
def test_valid_normalizers(value):
    """Positive finite counts (numbers or 1-element detached tensors) are accepted as floats."""
    result = validate_loss_normalizer(value)
    assert isinstance(result, float) and result > 0


@pytest.mark.parametrize(
    "value",
    [
        0,
        0.0,
        -1,
        math.nan,
        math.inf,
        -math.inf,
        True,
        "3",
        torch.tensor(2.0, requires_grad=True),
        torch.ones(2),
    ],
    ids=["zero", "zero_float", "negative", "nan", "inf", "-inf", "bool", "string", "graph", "vector"],
)
def test_invalid_normalizers_fail_closed(value):
    """Zero, negative, non-finite, boolean, string, graph-bearing and non-scalar normalizers raise."""
    with pytest.raises(PhaseContractError, match="loss_normalizer") as info:
        validate_loss_normalizer(value)
    assert "\n" not in str(info.value)
    with pytest.raises(PhaseContractError):
        PhaseOutput(loss=torch.tensor(0.0), loss_normalizer=value)


def test_tracker_rejects_mixed_modes_and_miscounts():
    """Mixing None and counts in one phase, extra micro-batches and early divisors fail closed."""
    tracker = LossNormalizerTracker(2)
    tracker.loss_weight(None)
    with pytest.raises(PhaseContractError, match="one mode"):
        tracker.loss_weight(4.0)
    tracker = LossNormalizerTracker(2)
    tracker.loss_weight(4.0)
    with pytest.raises(PhaseContractError, match="one mode"):
        tracker.loss_weight(None)
    tracker = LossNormalizerTracker(1)
    tracker.loss_weight(3.0)
    with pytest.raises(PhaseContractError, match="recorded"):
        tracker.loss_weight(3.0)
    tracker = LossNormalizerTracker(2)
    tracker.loss_weight(3.0)
    with pytest.raises(PhaseContractError, match="after 1 of 2"):
        tracker.gradient_divisor(3.0)
    for bad in (0, True, 1.5):
        with pytest.raises(PhaseContractError, match="num_micro_batches"):
            LossNormalizerTracker(bad)


def test_tracker_divisor_rules():
    """Mean mode takes no count; count mode requires a positive finite data-parallel mean."""
    mean = LossNormalizerTracker(1)
    mean.loss_weight(None)
    assert mean.gradient_divisor() == 1.0
    with pytest.raises(PhaseContractError):
        mean.gradient_divisor(2.0)
    count = LossNormalizerTracker(1)
    count.loss_weight(5.0)
    assert count.local_count == 5.0 and count.gradient_divisor(2.5) == 2.5
    for bad in (None, 0.0, math.nan, math.inf):
        with pytest.raises(PhaseContractError):
            count.gradient_divisor(bad)


def _split(tensor: torch.Tensor, parts: int) -> list[torch.Tensor]:
    return list(torch.tensor_split(tensor, parts))


def _contract_gradient(per_rank_values: list[torch.Tensor], micro_batches: int, mode: str) -> torch.Tensor:
    """Gradient w.r.t. a shared parameter w, following the contract as the runtime will.

    Each element e contributes loss (w * e)^2 / 2. Each rank accumulates its
    micro-batches' weighted losses, gradients are averaged across ranks (what
    FSDP's reduce does), and count mode divides by the mean local count.
    """
    w = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    rank_grads, local_counts = [], []
    for values in per_rank_values:
        tracker = LossNormalizerTracker(micro_batches)
        total = torch.zeros((), dtype=torch.float64)
        for chunk in _split(values, micro_batches):
            loss = ((w * chunk) ** 2 / 2).mean()
            normalizer = None if mode == "mean" else float(chunk.numel())
            total = total + loss * tracker.loss_weight(normalizer)
        (grad,) = torch.autograd.grad(total, w)
        rank_grads.append(grad)
        local_counts.append(tracker.local_count)
        trackers_mode = tracker.mode
    mean_grad = torch.stack(rank_grads).mean()
    if trackers_mode == "count":
        divisor = sum(local_counts) / len(local_counts)
        mean_grad = mean_grad / divisor
    return mean_grad


@pytest.mark.parametrize("micro_batches", [1, 2, 4])
def test_count_mode_weighs_every_unit_equally(micro_batches):
    """Count mode gives the per-element mean over all ranks, however the batch is split and
    whatever each rank holds; the reference is the float64 mean over every element."""
    gen = torch.Generator().manual_seed(0)
    rank0 = torch.randn(8, generator=gen, dtype=torch.float64)
    rank1 = torch.randn(20, generator=gen, dtype=torch.float64)  # unequal counts per rank
    w = 1.5
    everything = torch.cat([rank0, rank1])
    reference = (w * everything**2).mean()  # d/dw of mean((w e)^2 / 2)
    got = _contract_gradient([rank0, rank1], micro_batches, "count")
    assert abs(got - reference) / abs(reference) < 1e-12


@pytest.mark.parametrize("micro_batches", [1, 2, 4])
def test_mean_mode_is_the_sample_mean_for_equal_splits(micro_batches):
    """Mean mode with equal micro-batches and equal ranks gives the sample mean over everything."""
    gen = torch.Generator().manual_seed(1)
    ranks = [torch.randn(16, generator=gen, dtype=torch.float64) for _ in range(2)]
    reference = (1.5 * torch.cat(ranks) ** 2).mean()
    got = _contract_gradient(ranks, micro_batches, "mean")
    assert abs(got - reference) / abs(reference) < 1e-12


def test_phase_computer_protocol_is_checkable():
    """A class with the protocol's five methods satisfies the runtime-checkable protocol; others do not."""

    class Computer:
        def compute_phase(self, request, batch, runtime, *, micro_batch_index, num_micro_batches):
            return PhaseOutput(loss=torch.tensor(0.0))

        def extra_modules(self):
            return ()

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

        def reseed(self, salt):
            pass

    assert isinstance(Computer(), PhaseComputer)
    assert not isinstance(object(), PhaseComputer)
