"""Generate the key tables of docs/configuration.md from the plan's field docstrings.

The plan dataclasses are the single source of truth for keys, types, defaults
and meanings; this module renders them so the documentation cannot drift.
Run ``python -m verl_dmd.config_docs --write`` after changing verl_dmd/plan/specs.py;
a test fails while the file is stale.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import sys
import types
import typing
from pathlib import Path

from verl_dmd.plan import RESUME_MUTABLE_KEYS, DistillationPlan, _defaults_without_validation
from verl_dmd.plan import specs as plan_module
from verl_dmd.plan.schema import to_plain

BEGIN = "<!-- BEGIN GENERATED KEY TABLES (python -m verl_dmd.config_docs --write) -->"
END = "<!-- END GENERATED KEY TABLES -->"


def _field_docs() -> dict[tuple[str, str], str]:
    """(class name, field name) -> the string literal that follows the field in plan/specs.py."""
    tree = ast.parse(inspect.getsource(plan_module))
    docs: dict[tuple[str, str], str] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        body = node.body
        for stmt, nxt in zip(body, [*body[1:], None], strict=True):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[(node.name, stmt.target.id)] = " ".join(nxt.value.value.split())
    return docs


def _type_text(tp: typing.Any) -> str:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Literal:
        return " \\| ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_text(a) for a in args)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"list of {_type_text(args[0])}"
        return f"list of {len(args)} {_type_text(args[0])}"
    if origin is not None:
        return "mapping"
    return {int: "int", float: "float", bool: "bool", str: "string"}.get(tp, str(tp))


def _mutable(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in RESUME_MUTABLE_KEYS)


def _rows(obj: typing.Any, prefix: str, docs: dict[tuple[str, str], str]) -> list[str]:
    rows: list[str] = []
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        key = f"{prefix}.{f.name}" if prefix else f.name
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            rows.extend(_rows(value, key, docs))
            continue
        doc = docs.get((type(obj).__name__, f.name))
        if doc is None:
            raise SystemExit(
                f"plan field {type(obj).__name__}.{f.name} has no docstring; document it in verl_dmd/plan/specs.py"
            )
        default = json.dumps(to_plain(value))
        resume = "yes" if _mutable(key) else "no"
        meaning = doc.replace("|", "\\|")
        rows.append(f"| `{key}` | {_type_text(hints[f.name])} | `{default}` | {resume} | {meaning} |")
    return rows


def render() -> str:
    """The generated block, markers included."""
    docs = _field_docs()
    defaults = _defaults_without_validation()
    parts = [BEGIN, ""]
    for section in DistillationPlan.SECTIONS:
        spec = getattr(defaults, section)
        title = (type(spec).__doc__ or "").strip().splitlines()[0] if type(spec).__doc__ else ""
        parts.append(f"### `{section}`" + (f": {title}" if title else ""))
        parts.append("")
        parts.append("| key | type | default | resume may change | meaning |")
        parts.append("|---|---|---|---|---|")
        parts.extend(_rows(spec, section, docs))
        parts.append("")
    parts.append(END)
    return "\n".join(parts)


def updated(text: str) -> str:
    """`text` with its generated block replaced by a fresh one."""
    if BEGIN not in text or END not in text:
        raise SystemExit(f"the markers {BEGIN!r} and {END!r} are missing")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return head + render() + tail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--doc", type=Path, default=Path("docs/configuration.md"))
    parser.add_argument("--write", action="store_true", help="rewrite the file instead of checking it")
    args = parser.parse_args(argv)
    text = args.doc.read_text()
    fresh = updated(text)
    if args.write:
        args.doc.write_text(fresh)
        return 0
    if fresh != text:
        print(f"{args.doc} is stale: run python -m verl_dmd.config_docs --write", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
