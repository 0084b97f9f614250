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
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from verl_dmd.checkpoint.engine_state import load_engine, load_schedule_state, save_engine, schedule_state
from verl_dmd.checkpoint.safe_io import VerifiedReader, load_tensor_file, read_verified
from verl_dmd.checkpoint.store import Checkpoint, CheckpointError, CheckpointStore
from verl_dmd.seeding import stream_seed

ENGINE_DIR = "engine"
RNG_DIR = "rng"
TRAINER_STATE = "trainer_state.json"

T = TypeVar("T")


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


def _broadcast(value: Any) -> Any:
    """Rank 0's `value` on every rank (collective)."""
    holder = [value]
    dist.broadcast_object_list(holder, src=0)  # our own strings, within the job's process group
    return holder[0]


def _agreed(fn: Callable[[], T], *, rank0_only: bool = False) -> T | None:
    """`fn()` on this rank (on rank 0 alone with `rank0_only`; None elsewhere), then agreement (collective).

    When `fn` raised on any rank, every rank raises, so that none is left waiting in a later collective for
    a rank that failed. A rank raises its own error when it is the only one (or any error but a
    CheckpointError); otherwise a CheckpointError joining every rank's message: a CheckpointError's as it
    is (identical ones once), any other error's as "rank R failed (Type: first line)".
    """
    rank = dist.get_rank()
    result, own, messages = None, None, []
    if not rank0_only or rank == 0:
        try:
            result = fn()
        except CheckpointError as err:
            own, messages = err, [str(err)]
        except Exception as err:
            own, messages = err, [f"rank {rank} failed ({_first_line(err)})"]
    messages = _agree(messages)
    if own is not None and (not isinstance(own, CheckpointError) or messages == [str(own)]):
        raise own
    if messages:
        raise CheckpointError("; ".join(messages)) from own
    return result


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
    staging = Path(_broadcast(_agreed(lambda: str(store.begin(global_step)), rank0_only=True)))
    save_engine(engine, staging / ENGINE_DIR)  # DCP: a failure on one rank raises on every rank
    store.fault("engine")

    def write_own_files() -> None:
        (staging / RNG_DIR).mkdir(exist_ok=True)
        torch.save(rank_state, staging / RNG_DIR / f"rank_{rank}.pt")
        store.fault("rng")
        if rank == 0:
            state = {"trainer": trainer_state, "schedule": schedule_state(engine)}
            (staging / TRAINER_STATE).write_text(json.dumps(state, sort_keys=True, indent=1) + "\n")
            store.fault("trainer_state")

    _agreed(write_own_files)  # (also the barrier: every rank's files are written before the publication)

    def publish() -> str:
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
        return str(checkpoint.path)

    return Path(_broadcast(_agreed(publish, rank0_only=True)))


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


def all_damaged(root: Path, damaged: list[str]) -> CheckpointError:
    """The error of a resume whose checkpoints all turned out damaged (nothing is set aside)."""
    return CheckpointError(
        f"checkpoint.resume found {len(damaged)} checkpoint(s) under {root} and none is intact: "
        + "; ".join(damaged)
        + "; nothing was set aside or deleted; fix: restore the damaged files, point checkpoint.resume at "
        "a copy, or set checkpoint.resume=disable to start afresh deliberately"
    )


def preflight_resume(plan) -> None:
    """On the driver, before anything starts: `checkpoint.resume` resolves (see `CheckpointStore.candidates`),
    and the newest candidate was written under this plan; else one-line CheckpointError. The file hashes
    are checked by the load itself, in the same pass that reads them."""
    root = checkpoint_root(plan)
    found = CheckpointStore(root).candidates(plan.checkpoint.resume)
    if found.checkpoints:
        check_plan(found.checkpoints[0], plan)
    elif found.damaged:
        raise all_damaged(found.root or root, found.damaged)


class _Damaged(Exception):
    """A candidate checkpoint with a damaged file (every rank raises it, with the same message)."""


def _agree(errors: list[str]) -> list[str]:
    """Every rank's errors, on every rank (collective), without duplicates, in rank order."""
    gathered: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, errors)  # our own strings, within the job's process group
    seen: dict[str, None] = {}
    for part in gathered:
        seen.update(dict.fromkeys(part or []))
    return list(seen)


def _load_verified(checkpoint: Checkpoint, engine, plan) -> tuple[dict[str, Any], dict | None]:
    """Load `checkpoint` into the engine, checking each file's SHA-256 while it is read (collective).

    Returns (trainer state, this rank's tensors or None at another world size); raises `_Damaged` on every
    rank when any rank found a damaged file (the engine then holds a partial load: load another over it).
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    files = checkpoint.manifest["files"]
    verify = plan.checkpoint.verify_hashes

    def sha(relative: str) -> str | None:
        if not verify:
            return None
        if relative not in files:
            raise CheckpointError(f"{checkpoint.path / relative}: not listed in the manifest (refused)")
        return files[relative]["sha256"]

    engine_prefix = f"{ENGINE_DIR}/"
    expected = (
        {k[len(engine_prefix) :]: v["sha256"] for k, v in files.items() if k.startswith(engine_prefix)}
        if verify
        else None
    )
    errors, reader = [], None
    try:
        reader = VerifiedReader(checkpoint.path / ENGINE_DIR, expected)
    except CheckpointError as err:
        errors.append(str(err))
    errors = _agree(errors)
    if errors:
        raise _Damaged("; ".join(errors))
    try:
        load_engine(engine, checkpoint.path / ENGINE_DIR, reader=reader)
    except (Exception, CheckpointException) as err:  # DCP's own error derives from BaseException
        errors.append(
            f"{checkpoint.path / ENGINE_DIR}: does not load ({type(err).__name__}: {_first_line(err)})"
        )
    errors.extend(reader.damaged)
    read = {engine_prefix + name for name in reader.verified}
    state, rank_state = None, None
    try:
        state = json.loads(read_verified(checkpoint.path / TRAINER_STATE, sha(TRAINER_STATE)))
        read.add(TRAINER_STATE)
        if not isinstance(state, dict) or not {"trainer", "schedule"} <= state.keys():
            raise CheckpointError(f"{checkpoint.path / TRAINER_STATE}: not a verl_dmd trainer state")
    except (CheckpointError, ValueError) as err:
        errors.append(str(err) if isinstance(err, CheckpointError) else
                      f"{checkpoint.path / TRAINER_STATE}: not JSON ({err})")  # fmt: skip
    if int(checkpoint.manifest["world_size"]) == world_size:
        relative = f"{RNG_DIR}/rank_{rank}.pt"
        try:
            rank_state = load_tensor_file(checkpoint.path / relative, sha(relative))
            read.add(relative)
        except CheckpointError as err:
            errors.append(str(err))
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, (errors, sorted(read)))
    if rank == 0 and verify:  # the files no rank read (another world size's RNG files): checked here
        seen = set().union(*(set(part[1]) for part in gathered))
        for relative in sorted(set(files) - seen):
            try:
                read_verified(checkpoint.path / relative, sha(relative))
            except CheckpointError as err:
                errors.append(str(err))
    errors = _agree(errors + [e for part in gathered for e in part[0]])
    if errors:
        raise _Damaged("; ".join(errors))
    load_schedule_state(engine, state["schedule"])
    return state, rank_state


def _first_line(err: BaseException) -> str:
    """One line for `err`; for DCP's CheckpointException, each failing rank's own error."""
    if isinstance(err, CheckpointException):
        return "; ".join(f"rank {rank}: {_first_line(failure[0])}" for rank, failure in err.failures.items())
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"


def _warn(messages: list[str]) -> None:
    """Rank 0's warnings of a load, inside an agreement: under ``-W error`` a warning raises, on every rank."""
    for message in messages:
        warnings.warn(message, stacklevel=4)


def _new_timeline(store: CheckpointStore, plan, global_step: int) -> None:
    store.set_aside_newer_than(global_step)
    store.apply_retention(keep_last=plan.checkpoint.keep_last, keep_every=plan.checkpoint.keep_every)


def load_checkpoint(store: CheckpointStore, engine, plan) -> LoadedCheckpoint | None:
    """Resolve `plan.checkpoint.resume` and load the newest intact candidate into the engine, in place.

    Rule (docs/checkpoint-format.md): ``auto`` with no checkpoint starts afresh (None); a candidate whose
    files do not match the manifest is skipped with a warning naming the file and the next older one is
    loaded over it; when checkpoints exist and none is intact, CheckpointError naming each damaged file
    (nothing set aside). A path that names one checkpoint loads that one or fails. After a load, newer
    checkpoints of this root are set aside (a new timeline starts) and retention is re-applied (a save
    cut short by a crash may have published without it).
    """

    def listed() -> dict[str, Any]:
        found = store.candidates(plan.checkpoint.resume)
        return {"paths": [str(c.path) for c in found.checkpoints], "damaged": found.damaged,
                "explicit": found.explicit, "root": str(found.root or store.root)}  # fmt: skip

    listing = _broadcast(_agreed(listed, rank0_only=True))
    damaged = list(listing["damaged"])
    if damaged:  # manifests that do not check out, or files of the wrong size (the same list on every rank)
        _agreed(partial(_warn, [f"skipping damaged checkpoint: {err}" for err in damaged]), rank0_only=True)

    def trusted(found: str) -> Checkpoint:
        checkpoint = CheckpointStore.verify(found)  # every rank reads the manifest it will trust
        check_plan(checkpoint, plan)  # before any weight is read (and before anything is set aside)
        return checkpoint

    for found in listing["paths"]:
        checkpoint = _agreed(partial(trusted, found))
        try:
            state, rank_state = _load_verified(checkpoint, engine, plan)
        except _Damaged as err:
            if listing["explicit"]:
                raise CheckpointError(f"config key 'checkpoint.resume' = {found!r}: {err}") from None
            damaged.append(str(err))
            _agreed(
                partial(_warn, [f"skipping damaged checkpoint {checkpoint.path.name}: {err}"]),
                rank0_only=True,
            )
            continue
        # A new timeline starts here: later (abandoned or damaged) checkpoints are set aside (only this
        # run's root is touched, whichever root the checkpoint came from). Also the barrier.
        _agreed(partial(_new_timeline, store, plan, checkpoint.global_step), rank0_only=True)
        return LoadedCheckpoint(checkpoint.path, checkpoint.global_step, state["trainer"], rank_state,
                                int(checkpoint.manifest["world_size"]))  # fmt: skip
    if damaged:
        raise all_damaged(Path(listing["root"]), damaged)
    # A new timeline starts at 0: earlier runs' checkpoints are set aside (then the barrier, as above).
    _agreed(partial(store.set_aside_newer_than, -1), rank0_only=True)
    return None
