"""The role engine's state as one flat DCP state dict: trainable parameters, EMA, both optimizers.

Keys are the engine's public names (`verl_dmd.runtime.naming`), never positions:

- ``param/<model>.<name>``: every parameter of the student, fake-score and (shared
  layout) student_ema roles, declared extra modules (DMD2's GAN head) included;
  frozen weights (the teacher or the shared base) are not saved, they come from
  ``model.teacher`` again;
- ``ema/<model>.<name>``: the EMA's own tensors (independent layout);
- ``optim/<role>/<model>.<name>/{step,exp_avg,exp_avg_sq}``: AdamW state.

The template is built from the engine's explicit per-role parameter lists, not
from ``requires_grad``, so a freshly built engine asks DCP for every entry of
both optimizers (TRAPS: a template taken while one role is frozen silently
restores nothing for it). An optimizer that has not stepped yet gets the zero
state AdamW would create at its first step, so saving never changes the math.
DCP reshards DTensors on load: a checkpoint written at one world size loads at
another. The schedulers' own `state_dict` (plain numbers) and the learning rates
are kept in the trainer state (`schedule_state`).
"""

from __future__ import annotations

from typing import Any

import torch

from verl_dmd.phases import TRAINABLE_ROLES, Role
from verl_dmd.runtime.naming import ADAM_KEYS, ema_key, optim_key, param_key


def _adam_state(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> dict[str, torch.Tensor]:
    """The optimizer's state for `param`, created as AdamW's own first step would if it is missing."""
    state = optimizer.state[param]
    if not state:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    missing = [k for k in ADAM_KEYS if k not in state]
    if missing:
        raise RuntimeError(f"optimizer state without {missing}: only AdamW without amsgrad is saved")
    return state


def engine_state(engine) -> dict[str, torch.Tensor]:
    """The engine's tensors by stable name (the same object each call: DCP saves from / loads into them)."""
    names = engine.param_names
    state: dict[str, torch.Tensor] = {}
    roles = [*TRAINABLE_ROLES, *([Role.STUDENT_EMA] if engine.params.get(Role.STUDENT_EMA) else [])]
    for role in roles:
        for param in engine.params[role]:
            state[param_key(names[id(param)])] = param
    if engine.ema is not None and engine.ema.owns_tensors:  # else the student_ema adapter: saved above
        for param, ema in zip(engine.params[Role.STUDENT], engine.ema.own_tensors, strict=True):
            state[ema_key(names[id(param)])] = ema
    for role in TRAINABLE_ROLES:
        optimizer = engine.optimizers[role]
        for param in engine.params[role]:
            adam = _adam_state(optimizer, param)
            for key in ADAM_KEYS:
                state[optim_key(role, names[id(param)], key)] = adam[key]
    return state


# The entries of LambdaLR.state_dict() that hold plain numbers (its lambdas are functions: not saved).
_SCHEDULER_KEYS = (
    "base_lrs",
    "last_epoch",
    "_step_count",
    "_last_lr",
    "_get_lr_called_within_step",
    "_is_initial",
)


def schedule_state(engine) -> dict[str, Any]:
    """Per role: the scheduler's own state_dict (its plain numbers) and the current learning rates."""
    out = {}
    for role in TRAINABLE_ROLES:
        scheduler = engine.schedulers[role].state_dict()
        out[role.value] = {
            "scheduler": {k: scheduler[k] for k in _SCHEDULER_KEYS if k in scheduler},
            "lr": [group["lr"] for group in engine.optimizers[role].param_groups],
        }
    return out


def load_schedule_state(engine, state: dict[str, Any]) -> None:
    """Put `schedule_state` back; also reads the counters written before schedulers were saved whole
    (``last_epoch``, ``step_count``, ``lr``: checkpoints of verl_dmd up to commit 1018912)."""
    for role in TRAINABLE_ROLES:
        entry = state[role.value]
        scheduler, optimizer = engine.schedulers[role], engine.optimizers[role]
        if len(entry["lr"]) != len(optimizer.param_groups):
            raise ValueError(f"schedule state of {role.value}: {len(entry['lr'])} param groups, engine has "
                             f"{len(optimizer.param_groups)}")  # fmt: skip
        if "scheduler" in entry:
            saved = scheduler.state_dict()
            saved.update(entry["scheduler"])
            scheduler.load_state_dict(saved)
        else:  # the earlier format: the counters alone
            scheduler.last_epoch = int(entry["last_epoch"])
            scheduler._step_count = int(entry["step_count"])
            scheduler._last_lr = [float(lr) for lr in entry["lr"]]
        for group, lr in zip(optimizer.param_groups, entry["lr"], strict=True):
            group["lr"] = float(lr)


def save_engine(engine, directory) -> None:
    """Collective: every rank writes its shards of `engine_state` to `directory` with DCP (the same bytes
    for the same state: `verl_dmd.checkpoint.safe_io.DeterministicWriter`)."""
    import torch.distributed.checkpoint as dcp

    from verl_dmd.checkpoint.safe_io import DeterministicWriter

    dcp.save(engine_state(engine), storage_writer=DeterministicWriter(str(directory)))


def load_engine(engine, directory, *, reader=None) -> None:
    """Collective: fill the engine's tensors in place from `directory` (any world size), through `reader`
    (a `verl_dmd.checkpoint.safe_io.VerifiedReader`; one without hash checks when None)."""
    import torch.distributed.checkpoint as dcp

    from verl_dmd.checkpoint.safe_io import VerifiedReader

    engine.reshard()
    state = engine_state(engine)
    with torch.no_grad():
        dcp.load(state, storage_reader=reader or VerifiedReader(directory))
