"""The phase contract: roles, phase requests, phase outputs and the loss-normalizer rules.

A *phase* is one optimizer update of one trainable role (the student or the fake
score), made of one or more micro-batches. The driver sends a `PhaseRequest`, the
runtime calls a `PhaseComputer` once per micro-batch, and the computer returns a
`PhaseOutput`. This module is pure Python plus torch tensors: no distribution.
"""

from __future__ import annotations

import enum
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

import torch


class Role(enum.StrEnum):
    """A named role of the distillation. Only the student and the fake score train."""

    STUDENT = "student"
    FAKE_SCORE = "fake_score"
    TEACHER = "teacher"
    STUDENT_EMA = "student_ema"

    @property
    def trainable(self) -> bool:
        return self in TRAINABLE_ROLES


TRAINABLE_ROLES: tuple[Role, ...] = (Role.STUDENT, Role.FAKE_SCORE)


class PhaseContractError(ValueError):
    """A phase computer broke the contract (bad loss, bad metric, bad normalizer)."""


@dataclass(frozen=True)
class PhaseRequest:
    """What the driver asks one worker group to do: one phase of one trainable role.

    The counters are the controller's *before* the phase runs, so a computer can
    derive per-step randomness or schedules from them without a shared context.
    """

    role: Role
    global_step: int
    """Successful student optimizer steps so far (== controller.global_step)."""
    role_step: int
    """Successful optimizer steps of `role` so far; the step this phase would take is role_step + 1."""
    phase_index: int
    """Phases attempted so far (successes + skips); unique per request within a run."""

    def __post_init__(self) -> None:
        role = self.role
        if not isinstance(role, Role):
            try:
                role = Role(role)
            except ValueError:
                raise PhaseContractError(
                    f"PhaseRequest.role = {self.role!r}: not a role; allowed: "
                    f"{[r.value for r in TRAINABLE_ROLES]}"
                ) from None
            object.__setattr__(self, "role", role)
        if not role.trainable:
            raise PhaseContractError(
                f"PhaseRequest.role = {role.value!r}: only trainable roles run phases; allowed: "
                f"{[r.value for r in TRAINABLE_ROLES]} (the teacher and student_ema never step)"
            )
        for name in ("global_step", "role_step", "phase_index"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise PhaseContractError(f"PhaseRequest.{name} = {value!r}: must be a non-negative integer")


@dataclass(frozen=True)
class PhaseOutput:
    """What a phase computer returns for one micro-batch.

    `loss` is one graph-bearing scalar for the request's role. `metrics` are
    python floats or detached 1-element real tensors (kept on their device; the
    runtime reads them back once per phase); each is logged as its mean over the
    micro-batches, of every rank, that reported it, so a metric may be reported by
    some micro-batches only, as long as every rank's phase reports the same keys in
    the same order. `loss_normalizer` selects the accumulation mode:
    ``None`` means `loss` is already a mean over the micro-batch's samples (the
    runtime averages micro-batches); a positive finite number means `loss` is a
    mean over that many counted units (e.g. tokens, pixels, valid samples) and the
    runtime weighs it by the count, then divides by the data-parallel mean count.
    """

    loss: torch.Tensor
    metrics: Mapping[str, float | torch.Tensor] = field(default_factory=dict)
    loss_normalizer: float | None = None

    def __post_init__(self) -> None:
        loss = self.loss
        if not isinstance(loss, torch.Tensor):
            raise PhaseContractError(f"PhaseOutput.loss is a {type(loss).__name__}: must be a torch.Tensor")
        if loss.dim() != 0:
            raise PhaseContractError(
                f"PhaseOutput.loss has shape {tuple(loss.shape)}: must be a 0-dim scalar; reduce it in the computer"
            )
        if not loss.is_floating_point():
            raise PhaseContractError(f"PhaseOutput.loss has dtype {loss.dtype}: must be floating point")
        object.__setattr__(self, "metrics", MappingProxyType(_detached_metrics(self.metrics)))
        object.__setattr__(self, "loss_normalizer", validate_loss_normalizer(self.loss_normalizer))


def _detached_metrics(metrics: Mapping[str, Any]) -> dict[str, float | torch.Tensor]:
    """Python numbers and host tensors become floats; 1-element device tensors stay where they are, as
    0-dim detached tensors.

    Reading a device tensor back (`.item()`) makes the host wait for the device and drains its queue, so
    tensors are kept as they are and the runtime reads every metric back once, at the end of the phase.
    """
    if not isinstance(metrics, Mapping):
        raise PhaseContractError(
            f"PhaseOutput.metrics is a {type(metrics).__name__}: must be a mapping str -> float"
        )
    out: dict[str, float | torch.Tensor] = {}
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise PhaseContractError(f"PhaseOutput.metrics key {key!r}: must be a string")
        if isinstance(value, torch.Tensor):
            if value.requires_grad:
                raise PhaseContractError(
                    f"PhaseOutput.metrics[{key!r}] requires grad: metrics must be detached (call .detach() or .item())"
                )
            if value.numel() != 1:
                raise PhaseContractError(
                    f"PhaseOutput.metrics[{key!r}] has shape {tuple(value.shape)}: must be a scalar"
                )
            if value.dtype == torch.bool or value.is_complex():
                raise PhaseContractError(
                    f"PhaseOutput.metrics[{key!r}] has dtype {value.dtype}: must be a real number "
                    "(float, int or 1-element real tensor)"
                )
            if value.device.type != "cpu":
                out[key] = value.detach().reshape(())
                continue
            value = value.item()  # a host tensor: nothing to wait for
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise PhaseContractError(
                f"PhaseOutput.metrics[{key!r}] = {value!r}: must be a real number (float, int or 1-element tensor)"
            )
        out[key] = float(value)
    return out


def validate_loss_normalizer(normalizer: Any) -> float | None:
    """Return the normalizer as ``None`` or a positive finite float; raise otherwise.

    Zero, negative, NaN, infinite, boolean, non-scalar and gradient-bearing values
    fail closed: each would silently rescale or zero the update.
    """
    if normalizer is None:
        return None
    if isinstance(normalizer, torch.Tensor):
        if normalizer.requires_grad:
            raise PhaseContractError("PhaseOutput.loss_normalizer requires grad: it must be a detached count")
        if normalizer.numel() != 1:
            raise PhaseContractError(
                f"PhaseOutput.loss_normalizer has shape {tuple(normalizer.shape)}: must be a scalar count"
            )
        normalizer = normalizer.item()
    if isinstance(normalizer, bool) or not isinstance(normalizer, numbers.Real):
        raise PhaseContractError(
            f"PhaseOutput.loss_normalizer = {normalizer!r}: must be None (sample mean) or a positive finite count"
        )
    value = float(normalizer)
    if not math.isfinite(value) or value <= 0.0:
        raise PhaseContractError(
            f"PhaseOutput.loss_normalizer = {value!r}: must be None (sample mean) or a positive finite count; "
            "a micro-batch with nothing to count must not return a loss"
        )
    return value


class LossNormalizerTracker:
    """Accumulation arithmetic of one phase, without any communication.

    Mode ``mean`` (every micro-batch returned ``None``): micro-batch ``i``'s loss is
    weighted ``1 / num_micro_batches`` and the gradient is divided by nothing more.
    Mode ``count`` (every micro-batch returned a count ``n_i``): loss ``i`` is
    weighted ``n_i`` and, once the data-parallel mean of the local totals is known,
    the gradient is divided by it. With gradients averaged across ``W`` ranks this
    gives sum(n_i * loss_i over all ranks) / sum(n_i over all ranks): every counted
    unit weighs the same, however the batch was split. Mixing modes within a
    phase fails closed.
    """

    def __init__(self, num_micro_batches: int) -> None:
        if (
            isinstance(num_micro_batches, bool)
            or not isinstance(num_micro_batches, int)
            or num_micro_batches < 1
        ):
            raise PhaseContractError(f"num_micro_batches = {num_micro_batches!r}: must be an integer >= 1")
        self.num_micro_batches = num_micro_batches
        self.mode: str | None = None
        self.local_count = 0.0
        self.recorded = 0

    def loss_weight(self, normalizer: float | None) -> float:
        """Record one micro-batch's normalizer and return the factor its loss is multiplied by."""
        if self.recorded >= self.num_micro_batches:
            raise PhaseContractError(
                f"micro-batch {self.recorded + 1} recorded but the phase has {self.num_micro_batches}"
            )
        normalizer = validate_loss_normalizer(normalizer)
        mode = "mean" if normalizer is None else "count"
        if self.mode is not None and mode != self.mode:
            raise PhaseContractError(
                f"micro-batch {self.recorded} returned loss_normalizer={normalizer!r} ({mode} mode) but earlier "
                f"micro-batches of this phase used {self.mode} mode: a phase must use one mode throughout"
            )
        self.mode = mode
        self.recorded += 1
        if normalizer is None:
            return 1.0 / self.num_micro_batches
        self.local_count += normalizer
        return normalizer

    def gradient_divisor(self, data_parallel_mean_count: float | None = None) -> float:
        """The factor the accumulated gradients are divided by before clipping and the step.

        ``data_parallel_mean_count`` is the mean over ranks of `local_count` (in count
        mode, required); in mean mode it must be omitted.
        """
        if self.recorded != self.num_micro_batches:
            raise PhaseContractError(
                f"gradient_divisor asked after {self.recorded} of {self.num_micro_batches} micro-batches"
            )
        if self.mode == "mean":
            if data_parallel_mean_count is not None:
                raise PhaseContractError("mean mode takes no data-parallel count")
            return 1.0
        if data_parallel_mean_count is None:
            raise PhaseContractError("count mode needs the data-parallel mean of the local counts")
        divisor = float(data_parallel_mean_count)
        if not math.isfinite(divisor) or divisor <= 0.0:
            raise PhaseContractError(
                f"data-parallel mean count = {divisor!r}: must be positive and finite "
                "(a rank reported an invalid count, or ranks disagree on the mode)"
            )
        return divisor


@dataclass(frozen=True)
class ExtraModule:
    """A trainable module a phase computer needs besides the roles' models (DMD2's GAN head).

    The role engine builds it with `build(model)` from the model that holds `owner`'s weights (the fake
    score: the one owner supported), before
    sharding (TRAPS: a module added later would never synchronise its gradients), attaches it there as
    submodule `name`, shards it as its own FSDP2 unit, and puts its parameters in `owner`'s optimizer.
    The computer reaches it through `PhaseRuntime.extra_module(name)`.
    """

    name: str
    owner: Role
    build: Callable[[torch.nn.Module], torch.nn.Module]

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise PhaseContractError(f"ExtraModule.name = {self.name!r}: must be a Python identifier")
        owner = Role(self.owner)
        if owner is not Role.FAKE_SCORE:
            # A student-owned module would need an EMA copy and an export path, which do not exist yet.
            raise PhaseContractError(
                f"ExtraModule {self.name!r}: owner {owner.value!r}; allowed: fake_score (the role whose phases "
                "train a discriminator-like module; student-owned modules are not supported)"
            )
        object.__setattr__(self, "owner", owner)


@runtime_checkable
class PhaseRuntime(Protocol):
    """All a phase computer may use of the runtime; the runtime hands computers exactly this.

    - `use_role(role)`: a context in which forwards run as `role` (frozen roles under no_grad); it
      yields the module to call.
    - `module_for(role)`: the module holding `role`'s weights, without switching (the phase's own role
      is active for the whole phase).
    - `extra_module(name)`: a module the computer declared (`ExtraModule`).
    - `adapter`: the model adapter: `predict`, `predict_with_features`, and the conversions of its
      parameterization (`to_x0`, `add_noise`, `prediction_target`, `ode_step`).
    - `rank`, `world_size`: this rank's place in the data-parallel group.
    """

    @property
    def adapter(self) -> Any: ...

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def use_role(self, role: Role | str) -> AbstractContextManager[torch.nn.Module]: ...

    def module_for(self, role: Role | str) -> torch.nn.Module: ...

    def extra_module(self, name: str) -> torch.nn.Module: ...


@runtime_checkable
class PhaseComputer(Protocol):
    """Computes one micro-batch of one phase; never calls backward or an optimizer.

    It runs frozen roles (teacher, fake score during a student phase) inside
    ``runtime.use_role(role)`` under ``torch.no_grad``, and uses nothing of the
    runtime but `PhaseRuntime`. Loop facts arrive as keyword arguments. Its own
    state (RNG streams, counters) goes through ``state_dict``/``load_state_dict``
    so resumes continue bit-for-bit; `reseed(salt)` gives it fresh streams when a
    resume cannot restore them (another world size). `extra_modules()` declares
    the trainable modules it needs besides the roles' models (none: an empty tuple).
    """

    def compute_phase(
        self,
        request: PhaseRequest,
        batch: Any,
        runtime: PhaseRuntime,
        *,
        micro_batch_index: int,
        num_micro_batches: int,
    ) -> PhaseOutput: ...

    def extra_modules(self) -> Sequence[ExtraModule]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...

    def reseed(self, salt: int) -> None: ...
