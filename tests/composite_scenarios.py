"""Rank side of the composite checkpoint tests: the DMD2 stack on digits-shaped data, saved and resumed."""

from __future__ import annotations

import dataclasses
import warnings

import torch
from runtime_scenarios import full, make_plan

from verl_dmd.adapters import get_adapter
from verl_dmd.checkpoint.composite import (
    _Damaged,
    capture_rng,
    load_checkpoint,
    restore_rank_state,
    save_checkpoint,
)
from verl_dmd.checkpoint.engine_state import engine_state, schedule_state
from verl_dmd.checkpoint.store import CheckpointError, CheckpointStore
from verl_dmd.controller import DistillationController
from verl_dmd.data.digits import DigitsConditionStream
from verl_dmd.phases import PhaseRequest, Role
from verl_dmd.runtime.engine import RoleEngine
from verl_dmd.runtime.runtime import DistillationRoleRuntime

PHASES = 5  # fake (warm-up), student, fake, fake, student: both optimizers hold state at the save


class Stack:
    def __init__(self, rank: int, world_size: int, layout: str, **overrides) -> None:
        settings = {"algorithm.fake_update_ratio": 2, "algorithm.fake_warmup_steps": 1,
                    "algorithm.student_steps": 2, "checkpoint.keep_last": 2, **overrides}  # fmt: skip
        self.plan = make_plan("dit", layout, **settings)
        self.rank, self.world_size = rank, world_size
        adapter = get_adapter("dit")()
        self.engine = RoleEngine(self.plan, adapter)
        self.computer = adapter.build_distribution_matching_computer(self.plan.model, self.plan, rank=rank)
        self.runtime = DistillationRoleRuntime(self.engine, self.computer)
        self.controller = DistillationController(fake_update_ratio=2, fake_warmup_steps=1)
        self.stream = DigitsConditionStream(torch.arange(50) % 10, null_class=10, seed=self.plan.trainer.seed)

    def run(self, phases: int, between=None) -> None:
        for _ in range(phases):
            if between is not None:
                between()
            role = self.controller.next_phase()
            step = self.controller.student_steps if role is Role.STUDENT else self.controller.fake_steps
            request = PhaseRequest(role=role, global_step=self.controller.global_step, role_step=step,
                                   phase_index=self.controller.phase_index)  # fmt: skip
            spec = getattr(self.plan.batch, role.value)
            size = spec.micro_batch_size * spec.accumulation_steps
            batch = self.stream.next_batch(size, rank=self.rank, world_size=self.world_size)
            metrics = self.runtime.run_phase(request, batch)
            self.controller.record(role, stepped=metrics["stepped"])
            torch.rand(3)  # the global RNG moves too: its state must come back on resume

    def save(self, root: str, store: CheckpointStore | None = None):
        return save_checkpoint(
            store or CheckpointStore(root), self.engine, self.plan, global_step=self.controller.global_step,
            trainer_state={"controller": self.controller.state_dict(), "data": self.stream.state_dict()},
            rank_state={**capture_rng(), **{f"computer.{k}": v for k, v in self.computer.state_dict().items()}},
        )  # fmt: skip

    def load(self, root: str):
        loaded = load_checkpoint(CheckpointStore(root), self.engine, self.plan)
        if loaded is None:
            return None
        self.controller.load_state_dict(loaded.trainer_state["controller"])
        self.stream.load_state_dict(loaded.trainer_state["data"])
        restore_rank_state(loaded, seed=self.plan.trainer.seed, rank=self.rank, computer=self.computer)
        return loaded

    def snapshot(self) -> dict:
        return {
            "tensors": {k: full(v).detach().clone() for k, v in engine_state(self.engine).items()},
            "schedule": schedule_state(self.engine),
            "controller": self.controller.state_dict(),
            "data": self.stream.state_dict(),
            "computer": {k: v.clone() for k, v in self.computer.state_dict().items()},
            "torch_rng": torch.get_rng_state(),
        }


def straight(rank: int, world_size: int, layout: str, root: str) -> dict:
    stack = Stack(rank, world_size, layout)
    stack.run(PHASES)
    path = stack.save(root)
    saved = stack.snapshot()
    stack.run(PHASES)
    return {"saved": saved, "final": stack.snapshot(), "path": str(path)}


def resumed(rank: int, world_size: int, layout: str, root: str) -> dict:
    stack = Stack(rank, world_size, layout)
    fresh_start = {k: v.clone() for k, v in stack.computer.state_dict().items()}
    loaded = stack.load(root)
    assert loaded is not None and loaded.global_step == 2  # PHASES = warm-up + 2 cycles begun
    after_load = stack.snapshot()
    stack.run(PHASES)
    return {"loaded": after_load, "final": stack.snapshot(), "same_world": loaded.rank_state is not None,
            "fresh_start": fresh_start}  # fmt: skip


def resume_with(rank: int, world_size: int, layout: str, root: str, overrides: dict) -> dict:
    """Load under a changed plan; report the error (if any) and whether the engine was touched."""
    stack = Stack(rank, world_size, layout, **overrides)
    before = stack.snapshot()["tensors"]
    try:
        stack.load(root)
    except CheckpointError as err:
        after = stack.snapshot()["tensors"]
        return {"error": str(err), "untouched": all(torch.equal(before[k], after[k]) for k in before)}
    return {"error": None, "step": stack.controller.global_step}


def sharding_variant(rank: int, world_size: int, layout: str, overrides: dict) -> dict:
    """PHASES phases under FSDP2 settings that must not change the math (units, resharding)."""
    stack = Stack(rank, world_size, layout, **overrides)
    stack.run(PHASES)
    return stack.snapshot()


def describe_state(engine, offloader) -> dict:
    """Everything sleep/wake must preserve, as comparable values (object identities included)."""
    from torch.distributed.tensor import DTensor

    params = [p for params in engine.params.values() for p in params] + list(engine.frozen_params)
    tensors = offloader.state_tensors()
    groups: dict[int, list[int]] = {}
    for index, tensor in enumerate(tensors):
        groups.setdefault(tensor.untyped_storage().data_ptr(), []).append(index)
    return {
        "param_ids": [id(p) for p in params],
        "optimizer_bindings": [[id(p) for group in opt.param_groups for p in group["params"]] + [id(k) for k in opt.state]
                               for opt in engine.optimizers.values()],
        "specs": [(str(p.placements), tuple(p.device_mesh.shape), tuple(p.shape), p.stride()) if isinstance(p, DTensor)
                  else None for p in params],
        "requires_grad": [p.requires_grad for p in params],
        "locals": [(tuple(t.shape), t.stride(), str(t.dtype), t.storage_offset(), t.untyped_storage().nbytes())
                   for t in tensors],
        "aliasing": sorted(groups.values()),
        "values": [t.detach().clone() for t in tensors],
    }  # fmt: skip


def sleep_wake(rank: int, world_size: int, layout: str, every_phase: bool) -> dict:
    """PHASES phases, a sleep/wake round trip checked field by field, then PHASES more phases (with a
    sleep/wake before each when `every_phase`)."""
    from verl_dmd.runtime.offload import StateOffloader

    stack = Stack(rank, world_size, layout)
    offloader = StateOffloader(stack.engine)
    stack.run(PHASES)
    # The tiny test model's storages are all below the real 1 MB threshold; split them at the median
    # so both paths run: small ones as one staged block, the others one by one.
    # The smallest quarter is coalesced first (into shared buffers that then move as large storages).
    sizes = sorted(storage.nbytes() for storage in offloader._storages())
    offloader.small_block = sizes[len(sizes) // 2]
    offloader.coalesce_below = sizes[len(sizes) // 4]
    moved = offloader.coalesce()
    before = describe_state(stack.engine, offloader)
    info = offloader.sleep()
    paths = (offloader._small_count, len(offloader._slots) - offloader._small_count, moved)
    freed = all(t.untyped_storage().nbytes() == 0 for t in offloader.state_tensors())
    grads_dropped = all(p.grad is None for params in stack.engine.params.values() for p in params)
    offloader.wake()
    after = describe_state(stack.engine, offloader)
    mismatches = [k for k in before if k != "values" and before[k] != after[k]]
    mismatches += [f"values[{i}]" for i, (a, b) in enumerate(zip(before["values"], after["values"], strict=True))
                   if not torch.equal(a, b)]  # fmt: skip

    def round_trip():
        offloader.sleep()
        offloader.wake()

    stack.run(PHASES, between=round_trip if every_phase else None)
    return {"mismatches": mismatches, "freed": freed, "grads_dropped": grads_dropped, "bytes": info["bytes"],
            "final": stack.snapshot(), "paths": paths}  # fmt: skip


def overlapping_pairs(tensors) -> set[tuple[int, int]]:
    """Pairs of tensors (by index) whose bytes overlap: aliasing as the tensors see it, whatever storage."""
    spans = []
    for tensor in tensors:
        storage = tensor.untyped_storage()
        size = tensor.element_size()
        steps = zip(tensor.shape, tensor.stride(), strict=True)
        extent = 0 if tensor.numel() == 0 else size * (1 + sum((n - 1) * st for n, st in steps))
        start = tensor.data_ptr() - storage.data_ptr()
        spans.append((storage.data_ptr(), start, start + extent))
    return {(i, j) for i, a in enumerate(spans) for j, b in enumerate(spans)
            if i < j and a[0] == b[0] and a[1] < b[2] and b[1] < a[2]}  # fmt: skip


def coalesced(rank: int, world_size: int, layout: str, root: str) -> dict:
    """PHASES phases; coalescing with the default limit (every storage of the tiny model is below it),
    checked field by field; PHASES more with a sleep/wake before each; a checkpoint at the end."""
    from verl_dmd.runtime.offload import StateOffloader

    stack = Stack(rank, world_size, layout)
    offloader = StateOffloader(stack.engine)
    stack.run(PHASES)
    storages_before = len(offloader._storages())
    before = describe_state(stack.engine, offloader)
    pairs_before = overlapping_pairs(offloader.state_tensors())
    held = offloader.state_tensors()  # held across coalescing, as a caller (the benchmark) does
    moved = offloader.coalesce()
    del held
    after = describe_state(stack.engine, offloader)
    pairs_after = overlapping_pairs(offloader.state_tensors())
    # storage-level fields change by design (offsets, storage sizes, which storage); the rest may not
    same = ("param_ids", "optimizer_bindings", "specs", "requires_grad")
    mismatches = [k for k in same if before[k] != after[k]]
    mismatches += ["locals"] if [x[:3] for x in before["locals"]] != [x[:3] for x in after["locals"]] else []
    mismatches += ["aliasing"] if pairs_before != pairs_after else []
    mismatches += [f"values[{i}]" for i, (a, b) in enumerate(zip(before["values"], after["values"], strict=True))
                   if not torch.equal(a, b)]  # fmt: skip

    def round_trip():
        offloader.sleep()
        offloader.wake()

    stack.run(PHASES, between=round_trip)
    path = stack.save(root)
    return {"mismatches": mismatches, "moved": moved, "storages": (storages_before, len(offloader._storages())),
            "recoalesced": offloader.coalesce(), "final": stack.snapshot(), "path": str(path)}  # fmt: skip


def coalesced_again(rank: int, world_size: int, layout: str, overrides: dict) -> dict:
    """Coalescing in tiny runs (4 KB), first before the optimizers hold state (parameters only), then at
    a sleep after it (AdamW state and the first shared buffers, whose tensors sit at non-zero offsets);
    frozen weights in bfloat16 beside float32 ones; one parameter with a view held outside the state
    stays where it is; PHASES phases with a sleep/wake before each."""
    from verl_dmd.runtime.offload import StateOffloader

    stack = Stack(rank, world_size, layout, **overrides)
    offloader = StateOffloader(stack.engine, chunk_bytes=4096)
    param = stack.engine.params[Role.FAKE_SCORE][0]
    extra = param._local_tensor.view(-1)  # a holder the offloader does not know
    first = offloader.coalesce()
    first_rejected = offloader.last_coalesce["rejected"]
    first_buffers = len(offloader._storages())

    def round_trip():
        offloader.sleep()
        offloader.wake()

    stack.run(PHASES, between=round_trip)
    try:
        offloader.sleep()
        offloader.coalesce()
        asleep_error = None
    except RuntimeError as err:
        asleep_error = str(err)
    offloader.wake()
    return {"first": first, "first_rejected": first_rejected, "first_buffers": first_buffers,
            "later": dict(offloader.last_coalesce), "asleep_error": asleep_error,
            "extra_aliased": extra.data_ptr() == param._local_tensor.data_ptr()
            and torch.equal(extra, param._local_tensor.reshape(-1)),
            "final": stack.snapshot()}  # fmt: skip


def loaded_snapshot(rank: int, world_size: int, layout: str, root: str) -> dict:
    stack = Stack(rank, world_size, layout)
    assert stack.load(root) is not None
    return stack.snapshot()


def plain_run(rank: int, world_size: int, layout: str, phases: int) -> dict:
    stack = Stack(rank, world_size, layout)
    stack.run(phases)
    return stack.snapshot()


def session_offload_settings(rank: int, world_size: int, layout: str, packing: bool) -> dict:
    """How a worker's session sets up sleep/wake from `resources.offload_packing`, and a round trip."""
    from verl_dmd.workers.session import RankSession

    plan = make_plan("dit", layout, **{"resources.offload_packing": packing})
    session = RankSession(plan, rank=rank, world_size=world_size)
    session.sleep()
    moved = session.offloader.last["coalesced_storages"]
    session.wake()
    return {
        "pack": session.offloader.pack,
        "coalesce_below": session.offloader.coalesce_below,
        "moved": moved,
    }


def annotated_phases(rank: int, world_size: int, layout: str, trace: str) -> list[tuple[str, int]]:
    """Three phases under torch.profiler (CPU): the runtime's named ranges, in order, from the exported
    chrome trace (what scripts/trace_gaps.py reads)."""
    import json

    from torch.profiler import ProfilerActivity, profile

    stack = Stack(rank, world_size, layout)
    stack.run(1)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        stack.run(3)
    prof.export_chrome_trace(trace)
    with open(trace) as handle:
        events = json.load(handle)["traceEvents"]
    ranges = sorted((e["ts"], e["name"]) for e in events
                    if e.get("cat") == "user_annotation" and e["name"].startswith("verl_dmd."))  # fmt: skip
    return [name for _, name in ranges]


def optimizer_step_guards(rank: int, world_size: int, layout: str) -> dict:
    """AdamW on the local shards next to things it must not bypass or keep: PHASES phases; a wrapper put
    on the student optimizer's `step` (after the LR scheduler's) must see every student step, PHASES
    phases; the wrapper removed, PHASES phases (local steps again); then a moment of each optimizer
    replaced by a copy (as a load that makes new state objects would) and a sleep/wake: the replaced
    tensors must be gone (the offloader drops the shadows that held them)."""
    import gc
    import weakref

    from verl_dmd.runtime.offload import StateOffloader

    stack = Stack(rank, world_size, layout)
    offloader = StateOffloader(stack.engine)
    steps = stack.engine._local_steps
    stack.run(PHASES)
    student = stack.engine.optimizers[Role.STUDENT]
    scheduler_step = student.step
    calls = [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        return scheduler_step(*args, **kwargs)

    student.step = counted
    before = dict(steps[Role.STUDENT].counts)
    stack.run(PHASES)
    wrapped = {k: steps[Role.STUDENT].counts[k] - before[k] for k in before}
    student.step = scheduler_step
    before = dict(steps[Role.STUDENT].counts)
    stack.run(PHASES)
    unwrapped = {k: steps[Role.STUDENT].counts[k] - before[k] for k in before}
    replaced = []
    for optimizer in stack.engine.optimizers.values():
        state = optimizer.state[optimizer.param_groups[0]["params"][0]]
        replaced.append(weakref.ref(state["exp_avg"]._local_tensor))
        state["exp_avg"] = state["exp_avg"].clone()
    offloader.sleep()
    offloader.wake()
    gc.collect()
    return {"calls": calls[0], "wrapped": wrapped, "unwrapped": unwrapped,
            "replaced_alive": sum(ref() is not None for ref in replaced)}  # fmt: skip


def optimizer_step_path(rank: int, world_size: int, layout: str, local: bool) -> dict:
    """Under warmup-cosine schedules (the lr changes every step): PHASES phases, then one moment tensor
    of each optimizer replaced by a copy (as a load that makes new state objects would), PHASES more,
    then every model moved to float64 and back (FSDP2 gives each parameter a new local tensor), PHASES
    more; AdamW on the local shards (`local`) or on the DTensors."""
    schedule = {f"optim.{role}.scheduler.{k}": v for role in ("student", "fake_score")
                for k, v in (("name", "warmup_cosine"), ("warmup_steps", 2), ("decay_steps", 4))}  # fmt: skip
    stack = Stack(rank, world_size, layout, **schedule)
    stack.engine.local_optimizer_step = local
    stack.run(PHASES)
    for optimizer in stack.engine.optimizers.values():
        state = optimizer.state[optimizer.param_groups[0]["params"][0]]
        state["exp_avg"] = state["exp_avg"].clone()
    stack.run(PHASES)
    for model in stack.engine.models.values():
        model.to(torch.float64)
        model.to(torch.float32)
    stack.run(PHASES)
    counts = {role.value: dict(step.counts) for role, step in stack.engine._local_steps.items()}
    return {"final": stack.snapshot(), "counts": counts}


def _digest(snapshot: dict) -> str:
    import hashlib

    digest = hashlib.sha256()
    for key in sorted(snapshot["tensors"]):
        digest.update(key.encode())
        digest.update(snapshot["tensors"][key].reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def two_checkpoints(rank: int, world_size: int, layout: str, root: str) -> dict:
    """PHASES phases, a save, PHASES more, a save: two checkpoints; each one's state digest."""
    stack = Stack(rank, world_size, layout)
    digests = {}
    for _ in range(2):
        stack.run(PHASES)
        path = stack.save(root)
        digests[path.name] = _digest(stack.snapshot())
    return digests


def load_each(rank: int, world_size: int, layout: str, cases: list[tuple[str, dict]]) -> list[dict]:
    """Resume from each (root, plan overrides) in turn (a stack per overrides, loaded over and over): the
    step, state digest, warnings and error of each."""
    import warnings

    stacks: dict[str, Stack] = {}
    out = []
    for root, overrides in cases:
        key = repr(sorted(overrides.items()))
        if key not in stacks:
            stacks[key] = Stack(rank, world_size, layout, **overrides)
        stack = stacks[key]
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            try:
                loaded = stack.load(root)
            except CheckpointError as err:
                out.append({"error": str(err), "warnings": [str(w.message) for w in seen]})
                continue
        out.append({"step": None if loaded is None else loaded.global_step, "digest": _digest(stack.snapshot()),
                    "warnings": [str(w.message) for w in seen], "error": None})  # fmt: skip
    return out


def one_rank_fails(rank: int, world_size: int, layout: str, root: str) -> list[tuple[str, str, str]]:
    """A save, then saves and loads with a step that fails on one rank only (name, type and message of
    what each raised), then a load that works: no rank may be left waiting for the one that failed."""
    from contextlib import nullcontext
    from unittest import mock

    stack = Stack(rank, world_size, layout)
    stack.run(PHASES)
    stack.save(root)

    def on(failing: int, name: str, error: Exception):
        return (
            mock.patch.object(CheckpointStore, name, side_effect=error) if rank == failing else nullcontext()
        )

    def fault_on_1(point: str) -> None:
        if rank == 1 and point == "rng":
            raise OSError(28, "No space left on device")

    cases = {
        "verify": lambda: on(1, "verify", CheckpointError("manifest.json: unreadable on rank 1 alone")),
        "candidates": lambda: on(0, "candidates", PermissionError(13, "Permission denied", root)),
        "set_aside": lambda: on(0, "set_aside_newer_than", OSError(30, "Read-only file system")),
        "begin": lambda: on(0, "begin", CheckpointError("global_step = -1: must be an integer >= 0")),
        "publish": lambda: on(0, "publish", OSError(28, "No space left on device")),
    }
    out = []
    for name, patch in cases.items():
        try:
            with patch():
                stack.save(root) if name in ("begin", "publish") else stack.load(root)
            out.append((name, "none", ""))
        except Exception as err:
            out.append((name, type(err).__name__, str(err)))
    try:
        stack.save(root, store=CheckpointStore(root, fault_hook=fault_on_1))
        out.append(("rng", "none", ""))
    except Exception as err:
        out.append(("rng", type(err).__name__, str(err)))
    # rank 0 alone warns of damaged checkpoints; under -W error that warning raises, on rank 0 alone
    real_candidates = CheckpointStore.candidates

    def one_more_damaged(store, resume):
        return dataclasses.replace(
            real_candidates(store, resume), damaged=["global_step_9: manifest.json: not JSON"]
        )

    warned = {
        "warn_listed": lambda: mock.patch.object(CheckpointStore, "candidates", one_more_damaged),
        "warn_damaged": lambda: mock.patch(
            "verl_dmd.checkpoint.composite._load_verified",
            side_effect=_Damaged("engine: a hash does not match"),
        ),
    }
    for name, patch in warned.items():
        try:
            with warnings.catch_warnings(), patch():
                warnings.simplefilter("error" if rank == 0 else "ignore")
                stack.load(root)
            out.append((name, "none", ""))
        except Exception as err:
            out.append((name, type(err).__name__, str(err)))
    loaded = stack.load(root)
    out.append(("load", "none", str(loaded.global_step)))
    return out
