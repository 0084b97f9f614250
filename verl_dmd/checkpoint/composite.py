"""One composite checkpoint per save: engine state (DCP), trainer state, per-rank RNG; one atomic publication.

Layout inside ``global_step_<N>/`` (see docs/checkpoint-format.md):

- ``engine/``: `verl_dmd.checkpoint.engine_state` through DCP (any world size on load);
- ``trainer_state.json``: what the driver passes (controller counters, data
  position, ...) and the engine's scheduler counters and learning rates;
- ``rng/rank_<r>.pt``: what each rank passes as tensors (its RNG states, the phase
  computer's generators), read back only at the same world size;
- ``manifest.json``: written by the store, with the plan's semantic dict, so a
  resume under a different plan fails before any weight is read, naming each key.

Every function here is collective over the default process group.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from verl_dmd.checkpoint.engine_state import load_engine, load_schedule_state, save_engine, schedule_state
from verl_dmd.checkpoint.store import Checkpoint, CheckpointError, CheckpointStore
from verl_dmd.seeding import stream_seed

ENGINE_DIR = "engine"
RNG_DIR = "rng"
TRAINER_STATE = "trainer_state.json"


def checkpoint_root(plan) -> Path:
    """Where this run's checkpoints live: checkpoint.root, else <trainer.output_dir>/checkpoints."""
    return Path(plan.checkpoint.root or Path(plan.trainer.output_dir) / "checkpoints")


def capture_rng() -> dict[str, torch.Tensor]:
    """This process's torch (CPU and CUDA), numpy and python RNG states, as tensors only."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    _, keys, position, has_gauss, cached = np.random.get_state()
    state["numpy_keys"] = torch.from_numpy(np.asarray(keys, dtype=np.int64))
    state["numpy_rest"] = torch.tensor([position, has_gauss], dtype=torch.int64)
    state["numpy_gauss"] = torch.tensor([cached], dtype=torch.float64)
    version, internal, gauss = random.getstate()
    state["python"] = torch.tensor([version, *internal], dtype=torch.int64)
    state["python_gauss"] = torch.tensor([float("nan") if gauss is None else gauss], dtype=torch.float64)
    return state


def restore_rank_state(loaded: LoadedCheckpoint, *, seed: int, rank: int, computer=None) -> None:
    """Put this rank's random streams where the checkpoint left them.

    Same world size: the saved torch/numpy/python states and the computer's
    generators (saved under ``computer.<name>`` keys) come back exactly. Another
    world size: ranks do not map one to one, so every stream is re-seeded from
    (trainer.seed, global step, rank): fresh draws, never a replay of the run's
    first ones; such a resume is deterministic but not bitwise equal to an
    uninterrupted run (its global batch differs anyway).
    """
    if loaded.rank_state is not None:
        restore_rng(loaded.rank_state)
        if computer is not None:
            prefix = "computer."
            computer.load_state_dict(
                {k[len(prefix) :]: v for k, v in loaded.rank_state.items() if k.startswith(prefix)}
            )
        return
    torch.manual_seed(stream_seed(seed, "torch", loaded.global_step, rank))
    np.random.seed(stream_seed(seed, "numpy", loaded.global_step, rank) % 2**32)
    random.seed(stream_seed(seed, "python", loaded.global_step, rank))
    if computer is not None:
        computer.reseed(loaded.global_step)


def restore_rng(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    position, has_gauss = (int(v) for v in state["numpy_rest"])
    keys = state["numpy_keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, position, has_gauss, float(state["numpy_gauss"][0])))
    version, *internal = (int(v) for v in state["python"])
    gauss = float(state["python_gauss"][0])
    random.setstate((version, tuple(internal), None if gauss != gauss else gauss))


def _broadcast_path(path: str | None) -> str | None:
    holder = [path]
    dist.broadcast_object_list(holder, src=0)  # our own strings, within the job's process group
    return holder[0]


def save_checkpoint(
    store: CheckpointStore,
    engine,
    plan,
    *,
    global_step: int,
    trainer_state: dict[str, Any],
    rank_state: dict[str, torch.Tensor],
) -> Path:
    """Write and publish the checkpoint of `global_step`; returns its directory on every rank."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    staging = Path(_broadcast_path(str(store.begin(global_step)) if rank == 0 else None))
    save_engine(engine, staging / ENGINE_DIR)
    store.fault("engine")
    (staging / RNG_DIR).mkdir(exist_ok=True)
    torch.save(rank_state, staging / RNG_DIR / f"rank_{rank}.pt")
    store.fault("rng")
    if rank == 0:
        state = {"trainer": trainer_state, "schedule": schedule_state(engine)}
        (staging / TRAINER_STATE).write_text(json.dumps(state, sort_keys=True, indent=1) + "\n")
        store.fault("trainer_state")
    dist.barrier()
    published = None
    if rank == 0:
        checkpoint = store.publish(
            staging,
            global_step=global_step,
            fingerprint=plan.fingerprint(),
            world_size=world_size,
            counters={k: v for k, v in trainer_state.get("controller", {}).items() if isinstance(v, int)},
            keep_last=plan.checkpoint.keep_last,
            keep_every=plan.checkpoint.keep_every,
            extra={"plan": plan.semantic_dict()},
        )
        published = str(checkpoint.path)
    return Path(_broadcast_path(published))


@dataclass(frozen=True)
class LoadedCheckpoint:
    path: Path
    global_step: int
    trainer_state: dict[str, Any]
    rank_state: dict[str, torch.Tensor] | None
    """This rank's saved tensors; None when the world size changed (ranks do not map one to one)."""
    saved_world_size: int


def check_plan(checkpoint: Checkpoint, plan) -> None:
    """Fail, naming every differing semantic key with both values, if the checkpoint's plan differs.

    A key the checkpoint's plan lacks because a later verl_dmd added it is no difference while this
    plan holds it at its default (`DistillationPlan.semantic_differences`), so checkpoints written
    before a key existed still resume.
    """
    if checkpoint.manifest["plan_fingerprint"] == plan.fingerprint():
        return
    saved = checkpoint.manifest.get("plan")
    if not isinstance(saved, dict):
        raise CheckpointError(f"{checkpoint.path}: written under another plan (fingerprint differs)")
    differences = plan.semantic_differences(saved)
    if not differences:
        return
    listed = "; ".join(f"{key}: checkpoint {old!r}, now {new!r}" for key, old, new in differences)
    raise CheckpointError(
        f"{checkpoint.path} was written under a different plan ({listed}); fix: resume with the "
        "checkpoint's values for these keys, or set checkpoint.resume=disable to start afresh"
    )


def load_checkpoint(store: CheckpointStore, engine, plan) -> LoadedCheckpoint | None:
    """Resolve `plan.checkpoint.resume`, check the plan, then load the engine state in place."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    found = None
    if rank == 0:
        checkpoint = store.resolve(plan.checkpoint.resume, hashes=plan.checkpoint.verify_hashes)
        found = None if checkpoint is None else str(checkpoint.path)
    found = _broadcast_path(found)
    if found is None:
        if rank == 0:  # a new timeline starts at 0: earlier runs' checkpoints are set aside
            store.set_aside_newer_than(-1)
        return None
    checkpoint = CheckpointStore.verify(found)  # every rank reads the manifest it will trust
    check_plan(checkpoint, plan)  # before any weight is read (and before anything is set aside)
    if rank == 0:
        # A new timeline starts here: later (abandoned or damaged) checkpoints are set aside.
        store.set_aside_newer_than(checkpoint.global_step)
    state = json.loads((checkpoint.path / TRAINER_STATE).read_text())
    load_engine(engine, checkpoint.path / ENGINE_DIR)
    load_schedule_state(engine, state["schedule"])
    saved_world_size = int(checkpoint.manifest["world_size"])
    rank_state = None
    if saved_world_size == world_size:
        rank_state = torch.load(checkpoint.path / RNG_DIR / f"rank_{rank}.pt", weights_only=True)
    dist.barrier()
    return LoadedCheckpoint(
        checkpoint.path, checkpoint.global_step, state["trainer"], rank_state, saved_world_size
    )
