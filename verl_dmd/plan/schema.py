"""The generic machinery under the plan: typed coercion of config values into frozen dataclasses.

Nothing here knows a plan key. `build(cls, data, prefix)` turns a mapping into the
dataclass `cls`, checking every value against its annotation (scalars, Literals,
unions, tuples, opaque mappings, nested dataclasses) and freezing it; unknown
keys and wrong types fail with one line naming the dotted key (`PlanError`),
with a did-you-mean where one fits. The specs that use it are in
`verl_dmd.plan.specs`.

Layer 1: the standard library only.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal


class PlanError(ValueError):
    """A user-fixable problem in the configuration; the message is one line."""


def show(value: Any) -> str:
    text = repr(value).replace("\n", " ")
    return text if len(text) <= 80 else text[:77] + "..."


def error(key: str, value: Any, allowed: str, fix: str | None = None) -> PlanError:
    message = f"config key '{key}' = {show(value)}: {allowed}"
    if fix:
        message += f"; fix: {fix}"
    return PlanError(message)


def check_int(key: str, value: Any, *, minimum: int, fix: str | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise error(key, value, f"must be an integer >= {minimum}", fix)


def check_float(key: str, value: float, allowed: str, *, low: float, closed: bool = False) -> None:
    ok = math.isfinite(value) and (value >= low if closed else value > low)
    if not ok:
        raise error(key, value, f"must be {allowed}")


SCALARS = (int, float, bool, str)


def type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else type_name(a) for a in typing.get_args(tp))
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a list of {type_name(args[0])}"
        return f"a list of {len(args)} values"
    if origin is not None and issubclass(origin, Mapping):
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, str(tp))


def coerce(tp: Any, value: Any, key: str) -> Any:
    """Check `value` against the annotation `tp`; return it in canonical (frozen) form."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, key)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        non_null = [a for a in args if a is not type(None)]
        for candidate in non_null:
            try:
                return coerce(candidate, value, key)
            except PlanError:
                if len(non_null) == 1:
                    raise
        raise error(key, value, f"must be {type_name(tp)}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if isinstance(value, str) and value in allowed:
            return value
        suggestion = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
        fix = f"did you mean {suggestion[0]!r}?" if suggestion else None
        raise error(key, value, f"allowed: {', '.join(str(a) for a in allowed)}", fix)
    if origin is tuple:
        if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, (list, tuple)):
            raise error(key, value, f"must be {type_name(tp)}")
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(coerce(args[0], item, f"{key}[{i}]") for i, item in enumerate(value))
        if len(value) != len(args):
            raise error(key, list(value), f"must be {type_name(tp)}")
        return tuple(
            coerce(a, item, f"{key}[{i}]") for i, (a, item) in enumerate(zip(args, value, strict=True))
        )
    if origin is not None and isinstance(origin, type) and issubclass(origin, Mapping):
        if not isinstance(value, Mapping):
            raise error(key, value, "must be a mapping")
        return freeze(value, key)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise error(key, value, "must be true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise error(key, value, "must be an integer")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise error(key, value, "must be a number", "write it unquoted, e.g. 1.0e-4")
    if tp is str:
        if isinstance(value, str):
            return value
        raise error(key, value, "must be a string")
    if tp is Any:
        return freeze(value, key)
    raise TypeError(f"plan field {key} has an unsupported annotation {tp!r}")  # a bug in this module


def freeze(value: Any, key: str) -> Any:
    """Deep-freeze an opaque mapping (model configs): dicts become read-only, lists tuples."""
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise error(f"{key}.{k}", k, "mapping keys must be strings")
            out[k] = freeze(v, f"{key}.{k}")
        return types.MappingProxyType(out)
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v, f"{key}[{i}]") for i, v in enumerate(value))
    if value is None or isinstance(value, SCALARS):
        if isinstance(value, float) and not math.isfinite(value):
            raise error(key, value, "must be finite")
        return value
    raise error(key, value, "must be a number, string, boolean, null, list or mapping")


def build(cls: type, data: Any, prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if not isinstance(data, Mapping):
        raise error(prefix or "<root>", data, f"must be a mapping with keys {', '.join(fields)}")
    for name in data:
        if name not in fields:
            key = f"{prefix}.{name}" if prefix else str(name)
            close = difflib.get_close_matches(str(name), list(fields), n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"allowed keys here: {', '.join(fields)}"
            raise PlanError(f"config key '{key}' is unknown; {hint}")
    kwargs = {}
    for name in fields:
        if name in data:
            kwargs[name] = coerce(hints[name], data[name], f"{prefix}.{name}" if prefix else name)
    return cls(**kwargs)


def check_types(obj: Any, prefix: str) -> None:
    """Re-check annotations for plans built directly (not through from_config)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        key = f"{prefix}.{f.name}" if prefix else f.name
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            if not isinstance(value, hints[f.name]):
                raise error(key, value, f"must be a {hints[f.name].__name__}")
            check_types(value, key)
        else:
            canonical = coerce(hints[f.name], value, key)
            if canonical is not value:
                object.__setattr__(obj, f.name, canonical)


def to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {k: to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    return obj


def without_keys(tree: dict[str, Any], dotted_keys: tuple[str, ...]) -> dict[str, Any]:
    out = json.loads(json.dumps(tree))  # deep copy of plain data
    for dotted in dotted_keys:
        node = out
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.get(part, {})
        node.pop(leaf, None)
    return out


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted-key view of a nested dict; leaves (including lists and model configs) stay whole.

    Model configs are leaves so that a changed config shows as one key.
    """
    out: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}.{key}" if prefix else key
        if isinstance(value, Mapping) and not dotted.endswith(".config"):
            out.update(flatten(value, dotted))
        else:
            out[dotted] = value
    return out
