"""Rank side of the weight-sync tests: a rank session on a tiny SD3 pipeline's transformer, its LoRA roles set
to known values, synced to the inference replica of rank 0."""

from __future__ import annotations

import zlib

import torch
from runtime_scenarios import make_plan

from verl_dmd.phases import Role
from verl_dmd.runtime import lora


def sync_plan(pipeline_dir: str, layout: str, output_dir: str):
    return make_plan("sd3", layout, **{
        "model.teacher.config": None, "model.teacher.path": pipeline_dir, "model.teacher.subfolder": "transformer",
        "ema.start_step": 0, "trainer.output_dir": output_dir,
    })  # fmt: skip


def set_roles(engine) -> None:
    """Every LoRA factor (and an EMA's own tensors) set to values drawn from its name, the same whatever the
    world size: the roles differ from each other and from the teacher (B is no longer zero)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    def fill(name: str, tensor: torch.Tensor) -> None:
        generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        full = torch.randn(tuple(tensor.shape), generator=generator) * 0.05
        if isinstance(tensor, DTensor):
            full = distribute_tensor(full, tensor.device_mesh, tensor.placements).to_local()
            tensor.to_local().copy_(full)
        else:
            tensor.copy_(full)

    with torch.no_grad():
        for model_name, model in engine.models.items():
            for name, param in model.named_parameters():
                if lora.adapter_of(name) is not None:
                    fill(f"{model_name}.{name}", param)
        if engine.ema is not None:
            for i, tensor in enumerate(engine.ema.own_tensors):
                fill(f"ema.{i}", tensor)


def transformer_weights(session) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in session._replica().components["transformer"].named_parameters()}


def sync_scenario(rank: int, world_size: int, pipeline_dir: str, layout: str, output_dir: str) -> dict | None:
    """Sync student_ema, then student blended into it (decay 0.25); save a checkpoint of the same state."""
    from verl_dmd.workers.session import RankSession

    session = RankSession(sync_plan(pipeline_dir, layout, output_dir), rank=rank, world_size=world_size)
    set_roles(session.engine)
    path = session.save_checkpoint(0, {})
    first = session.sync_replica(Role.STUDENT_EMA.value)
    ema = transformer_weights(session) if rank == 0 else None
    blended = session.sync_replica(Role.STUDENT.value, blend=0.25)
    after_blend = transformer_weights(session) if rank == 0 else None
    state = session.replica_state()
    if rank != 0:
        assert first is None and blended is None and state is None
        return None
    return {"checkpoint": path, "first": first, "blended": blended, "ema": ema, "after_blend": after_blend,
            "state": state}  # fmt: skip


def failing_sync_scenario(rank: int, world_size: int, pipeline_dir: str, output_dir: str) -> dict | None:
    """Rank 0's replica fails after two tensors of a sync: every rank returns (no rank left in a gather), the
    engine's active role is restored, and the next sync completes."""
    from verl_dmd.workers.replica import InferenceReplica
    from verl_dmd.workers.session import RankSession

    session = RankSession(
        sync_plan(pipeline_dir, "shared_base_adapters", output_dir), rank=rank, world_size=world_size
    )
    set_roles(session.engine)
    failed = None
    if rank == 0:
        real = InferenceReplica.sync

        def broken(self, plan, manifests, tensors):
            def two_then_fail():
                for i, item in enumerate(tensors):
                    if i == 2:
                        raise OSError("disk full (injected)")
                    yield item

            return real(self, plan, manifests, two_then_fail())

        InferenceReplica.sync = broken
        try:
            session.sync_replica(Role.STUDENT_EMA.value)
        except OSError as err:
            failed = str(err)
        finally:
            InferenceReplica.sync = real
        incomplete = session.replica_state()["versions"]["transformer"]
    else:
        assert session.sync_replica(Role.STUDENT_EMA.value) is None
    active = session.engine.active_role
    done = session.sync_replica(Role.STUDENT_EMA.value)
    if rank != 0:
        return None
    return {"failed": failed, "incomplete": incomplete, "active": active, "done": done}
