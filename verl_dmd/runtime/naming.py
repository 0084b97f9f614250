"""The public naming contract of a role engine's state: what each tensor is called, and whose it is.

Checkpoints, export and sleep/wake read the engine's state through these names
instead of re-deriving them:

- a parameter's *full name* is ``<model>.<parameter name>`` with the segments that
  activation-checkpoint wrappers insert removed (`canonical_name`), so a checkpoint
  saved with activation checkpointing on loads with it off; ``<model>`` is the
  layout's model name (``base`` in the shared layout; ``teacher``, ``student``,
  ``fake_score`` in the independent one);
- state keys: ``param/<full name>`` (trainable weights of every role, declared extra
  modules included; never frozen ones), ``ema/<full name of the student parameter>``
  (an EMA that holds its own tensors), ``optim/<role>/<full name>/<step|exp_avg|exp_avg_sq>``;
- `RoleTensors`: where one role's weights live among those keys (the prefix of
  its keys, and the LoRA adapter that selects them), which export uses to read a role
  in one process.

Layer 3 (no distribution needed).
"""

from __future__ import annotations

from dataclasses import dataclass

from verl_dmd.phases import Role

PARAM, EMA, OPTIM = "param/", "ema/", "optim/"
"""Prefixes of the three kinds of state keys."""

ADAM_KEYS = ("step", "exp_avg", "exp_avg_sq")
"""AdamW's state entries per parameter, each saved under its own key."""

BASE, TEACHER = "base", "teacher"
"""Model names: the shared layout's one model, and the independent layout's frozen teacher (its other models
are named after their role)."""

_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.",)


def canonical_name(param_name: str) -> str:
    """A parameter's name without the segments that activation-checkpoint wrappers insert."""
    for prefix in _WRAPPER_PREFIXES:
        param_name = param_name.replace(prefix, "")
    return param_name


def full_name(model_name: str, param_name: str) -> str:
    """``<model>.<canonical parameter name>``: the name a parameter has in every state key."""
    return f"{model_name}.{canonical_name(param_name)}"


def param_key(name: str) -> str:
    return f"{PARAM}{name}"


def ema_key(name: str) -> str:
    return f"{EMA}{name}"


def optim_key(role: Role, name: str, entry: str) -> str:
    return f"{OPTIM}{Role(role).value}/{name}/{entry}"


@dataclass(frozen=True)
class RoleTensors:
    """Where a role's weights are among the state keys: keys starting with `prefix`, and of those only the
    parameters of LoRA adapter `adapter` (None: every parameter under the prefix, a full-weight model)."""

    prefix: str
    adapter: str | None
    model_name: str
