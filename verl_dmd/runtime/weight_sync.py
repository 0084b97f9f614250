"""Publishing one role's weights to an inference replica: the declared `WeightSyncPlan`, and the role's full
weights gathered from the sharded engine one tensor at a time.

A sync says which role (student, student_ema, teacher, fake_score), which of the replica's components it
covers (the engine holds the transformer: ``("transformer",)``), how the tensors travel (``in_process``: the
replica lives in the process of rank 0, which copies each gathered tensor into it), and optionally a blend
(``decay * replica + (1 - decay) * role``, an old-policy copy). What the replica does with it (stop
admitting requests, check, copy, bump the component's version, drop that component's caches, admit again)
is the replica's (`verl_dmd.workers.replica`); this module gives it the plan, the manifest it checks before
any transfer, and the tensors.

A role's *full weights* are what its forwards compute with, as one plain model: every parameter of the
bare model (LoRA layers' ``base_layer`` segments dropped), and for a LoRA layer with the role's adapter
active its base weight plus the adapter's delta (``B @ A`` times the scaling, PEFT's arithmetic) added in
float32 (a bf16 base widened first) and rounded once, to the receiver's dtype: with float32 weights, the
exported merged model's bit for bit.

Gathering is collective: every rank walks the same parameters in the same order and takes part in each
``full_tensor`` all-gather; only one parameter's full tensor (and its LoRA factors) is alive at a time, never
a full copy of the model per rank.

Layer 4 (torch.distributed through DTensor).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from verl_dmd.phases import Role
from verl_dmd.runtime import lora
from verl_dmd.runtime.naming import canonical_name

TRANSPORTS = ("in_process",)
"""How the tensors travel: in the process of rank 0 (where the replica lives). Another process's replica
(shared memory, NCCL) is not built yet."""

ENGINE_COMPONENTS = ("transformer",)
"""The replica components the role engine holds weights for."""


class WeightSyncError(ValueError):
    """A sync that cannot run as declared; the message is one line, and nothing was transferred."""


@dataclass(frozen=True)
class WeightSyncPlan:
    """One sync: `role`'s weights into the replica's `components`, by `transport`, optionally blended.

    ``blend = decay`` makes the replica ``decay * replica + (1 - decay) * role`` (a lagged copy); None
    copies the role."""

    role: Role
    components: tuple[str, ...] = ENGINE_COMPONENTS
    transport: Literal["in_process"] = "in_process"
    blend: float | None = None

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "role", Role(self.role))
        except ValueError:
            allowed = ", ".join(r.value for r in Role)
            raise WeightSyncError(
                f"weight sync role = {self.role!r}: no such role; allowed: {allowed}"
            ) from None
        components = tuple(self.components)
        if not components or any(not isinstance(c, str) or not c for c in components):
            raise WeightSyncError(
                f"weight sync components = {list(components)}: must name at least one component"
            )
        if len(set(components)) != len(components):
            raise WeightSyncError(f"weight sync components = {list(components)}: a component is named twice")
        object.__setattr__(self, "components", components)
        if self.transport not in TRANSPORTS:
            raise WeightSyncError(
                f"weight sync transport = {self.transport!r}: allowed: {', '.join(TRANSPORTS)} (the replica in "
                "rank 0's process)"
            )
        if self.blend is not None and (
            isinstance(self.blend, bool)
            or not isinstance(self.blend, int | float)
            or not math.isfinite(self.blend)
            or not 0.0 <= self.blend < 1.0
        ):
            raise WeightSyncError(
                f"weight sync blend = {self.blend!r}: the decay must be in [0, 1) (0 copies the role), or null"
            )

    def describe(self) -> str:
        blend = "" if self.blend is None else f", blended with decay {self.blend}"
        return f"{self.role.value} -> {', '.join(self.components)} ({self.transport}{blend})"


# --------------------------------------------------------------------------- a role's full weights


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor (an all-gather for a sharded DTensor: every rank must call it in the same order)."""
    full = getattr(tensor, "full_tensor", None)
    return (full() if full is not None else tensor).detach()


def _active_adapter(layer: nn.Module) -> str | None:
    """The adapter a PEFT layer's forward applies now (None: adapters disabled, the base alone)."""
    if layer.__dict__.get("_disable_adapters", False):
        return None
    active = layer.__dict__.get("_active_adapter")
    names = [active] if isinstance(active, str) else list(active or [])
    present = [name for name in names if name in getattr(layer, "lora_A", {})]
    if len(present) > 1:
        raise WeightSyncError(
            f"a LoRA layer applies {len(present)} adapters at once ({present}); one is synced"
        )
    return present[0] if present else None


def _delta(layer: nn.Module, adapter: str) -> torch.Tensor:
    """The adapter's weight delta as PEFT's merge computes it (B @ A, transposed for fan_in_fan_out, times
    the scaling), in float32."""
    b = _full(layer.lora_B[adapter].weight).float()
    a = _full(layer.lora_A[adapter].weight).float()
    delta = b @ a
    if getattr(layer, "fan_in_fan_out", False):
        delta = delta.T
    return delta * layer.scaling[adapter]


def _bare_names(engine, module: nn.Module) -> Iterator[tuple[str, str, nn.Parameter, nn.Module | None]]:
    """(bare name, parameter name, parameter, its PEFT layer if it is a LoRA layer's base weight) for every
    parameter of the model as a plain model: LoRA factors and modules a method attached (a GAN head) skipped,
    ``base_layer`` segments dropped."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    attached = {id(p) for extra in engine.extra_modules.values() for p in extra.parameters()}
    modules = dict(module.named_modules())
    for name, param in module.named_parameters():
        if lora.adapter_of(name) is not None or id(param) in attached:
            continue
        owner_name, _, leaf = name.rpartition(".")
        layer = None
        if owner_name.endswith("base_layer"):
            parent = modules.get(owner_name.rpartition(".")[0] if "." in owner_name else "")
            if isinstance(parent, BaseTunerLayer) and leaf == "weight":
                layer = parent
                if not isinstance(parent.get_base_layer(), nn.Linear) or getattr(
                    parent, "lora_embedding_A", None
                ):
                    raise WeightSyncError(
                        f"{owner_name.rpartition('.')[0]}: a LoRA on a {type(parent.get_base_layer()).__name__}; a sync "
                        "merges LoRA on linear layers only; fix: target linear layers (model.<role>.lora.target_modules)"
                    )
        bare = canonical_name(name).replace(".base_layer.", ".")
        yield bare, name, param, layer


def role_manifest(engine, role: Role) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The names, full shapes and dtypes of `role`'s full weights, read from the sharded engine without
    gathering (what a replica checks before any transfer)."""
    with engine.use_role(role) as module:
        return {bare: (tuple(param.shape), param.dtype) for bare, _, param, _ in _bare_names(engine, module)}


def gather_role_weights(
    engine, role: Role, stats: dict[str, float] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """`role`'s full weights, one (bare name, full tensor) at a time, on every rank (collective: every rank
    must consume the whole iterator). `stats` gets ``gathered_peak_bytes``: the most bytes of full tensors
    alive at once (a weight, its LoRA factors and delta)."""
    with engine.use_role(role) as module, torch.no_grad():
        for bare, _, param, layer in _bare_names(engine, module):
            full = _full(param)
            held = full.numel() * full.element_size()
            adapter = _active_adapter(layer) if layer is not None else None
            if adapter is not None:  # merged in float32 (a bf16 base widened): rounded once, by the receiver
                merged = full.to(
                    torch.float32, copy=True
                )  # a copy: `full` may be the parameter's own storage
                delta = _delta(layer, adapter)
                held += merged.numel() * 4 * 2
                merged += delta
                full = merged
            if stats is not None:
                stats["gathered_peak_bytes"] = max(stats.get("gathered_peak_bytes", 0.0), float(held))
            yield bare, full
