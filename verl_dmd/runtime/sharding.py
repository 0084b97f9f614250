"""FSDP2 for the role engine's models: mixed precision, units, CPU offload, activation checkpointing, compile.

Functions the role engine calls once per model at construction, in this order:
`store_frozen_in_compute_dtype`, `shard`, `compile_units`, then (after its
parameter lists exist) `finish_lazy_init`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from verl_dmd.plan import ModelSpec

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

COMPILE_CACHE_SIZE = 64
"""torch._dynamo's cache size limit while model.compile is on. One block's compiled forward needs a variant
per guard combination: role (adapters on/off, which adapter), grad mode, train/eval, and the blocks that
differ (e.g. SD3's last, context_pre_only); torch's default of 8 would make the rest run eagerly, silently."""


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local shard of a DTensor (or the tensor itself)."""
    return t.to_local() if isinstance(t, DTensor) else t


def store_frozen_in_compute_dtype(
    models: dict[str, nn.Module], spec: ModelSpec, is_trainable: Callable[[str, str], bool]
) -> None:
    """With low-precision compute (model.param_dtype), keep frozen weights in that dtype.

    FSDP2 casts every parameter to param_dtype at each all-gather, so a frozen weight stored in
    float32 only ever enters compute as its low-precision rounding: storing that rounding once gives
    the same forwards bit for bit, with half the memory and sleep/wake bytes, and no cast kernels per
    parameter at each gather. `is_trainable(model name, parameter name)` spares every role's
    parameters (and declared extra modules), which keep their float32 master copies.
    """
    dtype = DTYPES[spec.param_dtype]
    if dtype is torch.float32:
        return
    with torch.no_grad():
        for model_name, model in models.items():
            for name, param in model.named_parameters():
                if not is_trainable(model_name, name) and param.is_floating_point():
                    param.data = param.data.to(dtype)


def cast_inputs_hook(dtype: torch.dtype, keep: Iterable[str]):
    """A forward pre-hook casting a module's floating tensor inputs to `dtype`, except the keyword inputs
    named in `keep` (what FSDP2's cast_forward_inputs does, with exceptions)."""
    keep = frozenset(keep)

    def cast(value):
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
            return value.to(dtype)
        return value

    def hook(module, args, kwargs):
        return tuple(cast(a) for a in args), {k: v if k in keep else cast(v) for k, v in kwargs.items()}

    return hook


MESH_DIMS = ("replicate", "shard")
"""Names of the dimensions of a hybrid (HSDP) mesh."""


def mesh_shape(plan, world_size: int) -> tuple[int, int] | None:
    """(replicate, shard) sizes of the plan's model.fsdp_mesh at `world_size` ranks; None for plain sharding
    over all ranks (shard, or a mesh with one replica: the same thing)."""
    mesh, resources = plan.model.fsdp_mesh, plan.resources
    if mesh == "shard":
        return None
    if mesh == "replicate":
        return None if world_size == 1 else (world_size, 1)
    shape = (resources.nnodes, resources.workers_per_node) if mesh == "hybrid" else tuple(mesh)
    if shape[0] * shape[1] != world_size:
        source = (
            f"resources.nnodes x resources.workers_per_node = {shape[0]} x {shape[1]} ranks"
            if mesh == "hybrid"
            else f"{shape[0] * shape[1]} ranks"
        )
        raise ValueError(
            f"model.fsdp_mesh = {mesh if mesh == 'hybrid' else list(mesh)}: {source} do not match the "
            f"{world_size} ranks of the process group; fix: make the product the number of ranks launched, "
            "or set model.fsdp_mesh=shard"
        )
    return None if shape[0] == 1 else shape


def device_mesh(plan, device: torch.device):
    """The FSDP2 mesh of model.fsdp_mesh for this process group: None (FSDP2's own 1-D mesh over all ranks)
    or a 2-D (replicate, shard) mesh whose groups wait as long as the run's collectives may
    (trainer.rpc_timeout_s plus the workers' grace, like the world group; torch's default would let
    NCCL's watchdog kill a waiting rank after 10 minutes)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    shape = mesh_shape(plan, dist.get_world_size())
    if shape is None:
        return None
    from datetime import timedelta

    from torch.distributed.device_mesh import DeviceMesh

    timeout = timedelta(seconds=plan.trainer.rpc_timeout_s + PROCESS_GROUP_GRACE_S)
    ranks = torch.arange(shape[0] * shape[1]).reshape(shape)
    rank = dist.get_rank()
    mine: dict[int, object] = {}
    # Every rank creates every group, in the same order (new_group is collective over the world).
    for dim, lines in ((0, ranks.t()), (1, ranks)):  # replicate groups: columns; shard groups: rows
        for line in lines.tolist():
            group = dist.new_group(line, timeout=timeout)
            if rank in line:
                mine[dim] = group
    return DeviceMesh.from_group([mine[0], mine[1]], device.type, mesh=ranks, mesh_dim_names=MESH_DIMS)


PROCESS_GROUP_GRACE_S = 10.0
"""Process groups wait trainer.rpc_timeout_s plus this: a rank waiting in a collective for a rank that stopped
must still be waiting (and be reported as waiting) when the driver's deadline passes, instead of failing with
the backend's own timeout first and being named as the failed rank."""


def replicas(mesh) -> int:
    """Ranks that hold the same shard (the replicate dimension of a hybrid mesh; 1 otherwise)."""
    return 1 if mesh is None or mesh.ndim == 1 else mesh.size(0)


def shard(
    model: nn.Module,
    spec: ModelSpec,
    fsdp_units: Callable[[nn.Module], Sequence[nn.Module]],
    *,
    mesh,
    device: torch.device,
    offload: bool,
    extra_units: Iterable[nn.Module] = (),
    full_precision_inputs: Iterable[str] = (),
) -> None:
    """`fully_shard` every unit (the adapter's `fsdp_units(model)` unless model.fsdp_units=model, then
    `extra_units`), then the model as the root, with the plan's mixed precision, resharding and offload
    settings. With bf16 compute the root's floating inputs are cast to it, except the keyword inputs in
    `full_precision_inputs` (the adapter's: the timestep), which reach the model in float32. Activation checkpointing wraps the adapter's units first; the units are listed again after
    it, so FSDP2 shards the wrappers."""
    param_dtype = DTYPES[spec.param_dtype]
    reduce_dtype = DTYPES[spec.reduce_dtype]
    # Without low-precision parameters, "reduce in float32" means "reduce in the parameters'
    # own dtype": forcing float32 would round float64 gradients (seen in the float64 tests).
    mixed = param_dtype is not torch.float32
    mp_policy = MixedPrecisionPolicy(
        param_dtype=param_dtype if mixed else None,
        reduce_dtype=None if not mixed and reduce_dtype is torch.float32 else reduce_dtype,
    )
    kwargs = {"mesh": mesh, "mp_policy": mp_policy}
    if not spec.reshard_after_forward:
        # Keep gathered weights after forward; the engine reshards every unit itself when a phase
        # ends and at role switches outside phases. Otherwise FSDP2's default: non-root units reshard
        # after forward, the root keeps its weights until backward (passing True would reshard the
        # root too, and an autograd.grad through it after its forward then fails: TRAPS-like, seen
        # in the GAN generator term).
        kwargs["reshard_after_forward"] = False
    if offload and spec.teacher.cpu_offload:
        # pin_memory needs an accelerator (TRAPS: CPUOffloadPolicy on CPU).
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    if spec.activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

        ids = set(map(id, fsdp_units(model)))
        apply_activation_checkpointing(model, check_fn=lambda m: id(m) in ids)
    units = list(fsdp_units(model)) if spec.fsdp_units == "blocks" else []
    for unit in [*units, *extra_units]:
        fully_shard(unit, **kwargs)
    if mixed and full_precision_inputs:
        # The root casts its inputs itself, keeping the adapter's full-precision ones (the timestep) float32
        # as the family's pipeline does; the units keep FSDP2's cast (their inputs come from bf16 layers).
        root_policy = MixedPrecisionPolicy(
            param_dtype=mp_policy.param_dtype, reduce_dtype=mp_policy.reduce_dtype, cast_forward_inputs=False
        )
        fully_shard(model, **{**kwargs, "mp_policy": root_policy})
        model.register_forward_pre_hook(
            cast_inputs_hook(param_dtype, full_precision_inputs), with_kwargs=True
        )
    else:
        fully_shard(model, **kwargs)


def compile_units(units: Iterable[nn.Module], backend: str) -> None:
    """torch.compile the forward of every unit (model.compile).

    Only the unit's own `forward` is compiled (an instance attribute over the class's): FSDP2's hooks
    and activation-checkpoint wrappers stay outside the graph. Blocks of one class share their code,
    so one compilation per guard variant serves all of them; a role switch (PEFT's active adapter,
    adapters disabled, requires_grad) is a guard, so a stale graph cannot run. After this, never
    deepcopy a model: the copy's `forward` would still be the compiled function bound to the original.
    """
    from torch._dynamo import config as dynamo_config

    if dynamo_config.cache_size_limit < COMPILE_CACHE_SIZE:
        logger.info(
            "model.compile: raising torch._dynamo.config.cache_size_limit from %d to %d (process-wide)",
            dynamo_config.cache_size_limit,
            COMPILE_CACHE_SIZE,
        )
        dynamo_config.cache_size_limit = COMPILE_CACHE_SIZE
    for unit in units:
        inner = getattr(unit, "_checkpoint_wrapped_module", unit)
        inner.forward = torch.compile(inner.forward, backend=backend)


def gather_once(units: Iterable[nn.Module]) -> None:
    """Gather and release each FSDP2 unit once, one at a time.

    A unit whose forward has not run yet holds no unsharded parameters; a backward without gradient
    sync (a micro-batch before the last) then fails in FSDP2's end-of-backward pass over the root's
    units ("'FSDPParam' object has no attribute '_unsharded_param'", torch 2.13, bf16 parameters). A
    unit that only some micro-batches use, such as one of DMD2's GAN heads per exit group, meets that
    on the first phase that does not run it; gathered once here, it never does.
    """
    for unit in units:
        if isinstance(unit, FSDPModule):
            unit.unshard()
            unit.reshard()


def finish_lazy_init(models: Iterable[nn.Module], trainable: Iterable[nn.Parameter]) -> None:
    """Run FSDP2's lazy init now, with every `trainable` parameter marked trainable (left frozen after).

    FSDP2 fixes each group's gradient dtype at the first forward from the parameters requiring grad
    then; a first forward by a frozen role would leave low-precision gradients meeting fp32 shards
    later (TRAPS).
    """
    trainable = list(trainable)
    for p in trainable:
        p.requires_grad_(True)
    for model in models:
        model._get_fsdp_state()._lazy_init()
    for p in trainable:
        p.requires_grad_(False)
