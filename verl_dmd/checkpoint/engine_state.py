"""The role engine's state as one flat DCP state dict: trainable parameters, EMA, both optimizers.

Keys are stable names, never positions:

- ``param/<model>.<name>``: every parameter of the student, fake-score and (shared
  layout) student_ema roles, the GAN head included; frozen weights (the teacher or
  the shared base) are not saved, they come from ``model.teacher`` again;
- ``ema/<model>.<name>``: the independent layout's EMA shards;
- ``optim/<role>/<model>.<name>/{step,exp_avg,exp_avg_sq}``: AdamW state.

The template is built from the engine's explicit per-role parameter lists, not
from ``requires_grad``, so a freshly built engine asks DCP for every entry of
both optimizers (TRAPS: a template taken while one role is frozen silently
restores nothing for it). An optimizer that has not stepped yet gets the zero
state AdamW would create at its first step, so saving never changes the math.
DCP reshards DTensors on load: a checkpoint written at one world size loads at
another. Learning rates and scheduler counters are plain numbers
(`schedule_state`), kept in the trainer state.
"""

from __future__ import annotations

from typing import Any

import torch

from verl_dmd.phases import Role

TRAINABLE_ROLES = (Role.STUDENT, Role.FAKE_SCORE)
ADAM_KEYS = ("step", "exp_avg", "exp_avg_sq")


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
            state[f"param/{names[id(param)]}"] = param
    if engine.independent_ema:  # independent layout; the shared layout's EMA is the student_ema adapter
        for param, ema in zip(engine.params[Role.STUDENT], engine.independent_ema, strict=True):
            state[f"ema/{names[id(param)]}"] = ema
    for role in TRAINABLE_ROLES:
        optimizer = engine.optimizers[role]
        for param in engine.params[role]:
            adam = _adam_state(optimizer, param)
            for key in ADAM_KEYS:
                state[f"optim/{role.value}/{names[id(param)]}/{key}"] = adam[key]
    return state


def schedule_state(engine) -> dict[str, Any]:
    """Per role: the scheduler's counters and the current learning rates (plain numbers)."""
    return {
        role.value: {
            "last_epoch": engine.schedulers[role].last_epoch,
            "step_count": engine.schedulers[role]._step_count,
            "lr": [group["lr"] for group in engine.optimizers[role].param_groups],
        }
        for role in TRAINABLE_ROLES
    }


def load_schedule_state(engine, state: dict[str, Any]) -> None:
    for role in TRAINABLE_ROLES:
        entry = state[role.value]
        scheduler, optimizer = engine.schedulers[role], engine.optimizers[role]
        if len(entry["lr"]) != len(optimizer.param_groups):
            raise ValueError(f"schedule state of {role.value}: {len(entry['lr'])} param groups, engine has "
                             f"{len(optimizer.param_groups)}")  # fmt: skip
        scheduler.last_epoch = int(entry["last_epoch"])
        scheduler._step_count = int(entry["step_count"])
        for group, lr in zip(optimizer.param_groups, entry["lr"], strict=True):
            group["lr"] = float(lr)
        scheduler._last_lr = [float(lr) for lr in entry["lr"]]


def save_engine(engine, directory) -> None:
    """Collective: every rank writes its shards of `engine_state` to `directory` with DCP."""
    import torch.distributed.checkpoint as dcp

    dcp.save(engine_state(engine), checkpoint_id=str(directory))


def load_engine(engine, directory) -> None:
    """Collective: fill the engine's tensors in place from `directory` (any world size)."""
    import torch.distributed.checkpoint as dcp

    engine.reshard()
    state = engine_state(engine)
    with torch.no_grad():
        dcp.load(state, checkpoint_id=str(directory))
