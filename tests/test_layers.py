"""The package's import graph, read from its source: no import from a higher layer, no import cycle.

The layer of each module is declared once, in `verl_dmd.layers`; imports inside
functions count (a lazy import is still a dependency, and the circle this test was
written against ran through one).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from verl_dmd.layers import LAYERS, NAMES, layer_of

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "verl_dmd"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a (possibly relative) `from ... import` names."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imports_of(path: Path, modules: set[str]) -> dict[str, int]:
    """The verl_dmd modules `path` imports (anywhere in the file), each with the first line importing it."""
    name = module_name(path)
    found: dict[str, int] = {}

    def add(target: str, line: int) -> None:
        # `from verl_dmd.runtime import lora` imports verl_dmd.runtime.lora; the longest existing name wins
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target.startswith("verl_dmd") and target != name:
            found.setdefault(target, line)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(name, path.name == "__init__.py", node)
            for alias in node.names:
                add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base, node.lineno)
    return found


def graph() -> dict[str, dict[str, int]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: imports_of(path, set(files)) for name, path in files.items()}


def test_every_module_has_a_declared_layer():
    for name in graph():
        assert layer_of(name) in NAMES, name


def test_no_module_imports_from_a_higher_layer():
    wrong = [
        f"{name} (layer {layer_of(name)}) imports {target} (layer {layer_of(target)}) at line {line}"
        for name, targets in graph().items()
        for target, line in targets.items()
        if layer_of(target) > layer_of(name)
    ]
    assert not wrong, "\n".join(wrong)


def find_cycle(edges: dict[str, dict[str, int]]) -> list[str] | None:
    """One import cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(edges.get(node, {})):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_package_has_no_import_cycle():
    """Every edge counts, a package's __init__ importing its own submodules included (a submodule that
    imported its package back would be a cycle: the package is half initialised then)."""
    edges = graph()
    assert find_cycle(edges) is None, " -> ".join(find_cycle(edges) or [])


# Rules inside and across layers that a layer number cannot say. A module matching the first pattern may
# not import one matching the second, unless the target is listed as allowed.
FORBIDDEN = [
    # methods are reached through their registry: no runtime, checkpoint, worker or driver module names one
    ("verl_dmd", "verl_dmd.algorithms", ("verl_dmd.algorithms", "verl_dmd.algorithms.registry",
                                         "verl_dmd.algorithms.sampling")),
    # the two axes are independent: a method gets its adapter as an object, an adapter finds its method by
    # name (the registry is its only way in)
    ("verl_dmd.algorithms", "verl_dmd.adapters", ()),
    ("verl_dmd.adapters", "verl_dmd.algorithms", ("verl_dmd.algorithms.registry",)),
]  # fmt: skip


def _matches(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_no_module_crosses_a_forbidden_edge():
    wrong = []
    for name, targets in graph().items():
        for source, target_prefix, allowed in FORBIDDEN:
            if not _matches(name, source) or (
                target_prefix == "verl_dmd.algorithms" and _matches(name, target_prefix)
            ):
                continue
            for target, line in targets.items():
                if _matches(target, target_prefix) and target not in allowed:
                    wrong.append(f"{name} imports {target} at line {line}")
    assert not wrong, "\n".join(wrong)


EXTERNAL = {"ray": 6, "verl": 6, "torch.distributed": 4}
"""The lowest layer allowed to import each outside package (the workers and above talk to ray and verl; the
runtime and above to torch.distributed)."""


def external_imports(path: Path) -> dict[str, int]:
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            for package in EXTERNAL:
                if _matches(name, package):
                    found.setdefault(package, node.lineno)
    return found


def test_low_layers_import_no_distribution_ray_or_verl():
    wrong = [
        f"{module_name(path)} (layer {layer_of(module_name(path))}) imports {package} at line {line}"
        for path in PACKAGE.rglob("*.py")
        for package, line in external_imports(path).items()
        if layer_of(module_name(path)) < EXTERNAL[package]
    ]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(
    ("edges", "cycle"),
    [
        ({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}}, ["a", "b", "c", "a"]),
        ({"a": {"b": 1}, "b": {}}, None),
    ],
)
def test_the_cycle_finder_finds_cycles(edges, cycle):
    """The checker itself: a planted circle is found (the circle adapters.base <-> algorithms.dmd2 was one)."""
    assert find_cycle(edges) == cycle


def test_a_planted_upward_import_is_caught(tmp_path):
    """The walk sees imports inside functions and relative imports: a lazy import of the trainer from the
    runtime, and a relative one, are both reported as verl_dmd.trainer imports."""
    source = tmp_path / "verl_dmd" / "runtime"
    source.mkdir(parents=True)
    planted = source / "planted.py"
    planted.write_text(
        "def f():\n    from verl_dmd.trainer.ray_trainer import DistillationRayTrainer\n"
        "def g():\n    from ..trainer import registry\n"
    )
    modules = {"verl_dmd", "verl_dmd.runtime", "verl_dmd.runtime.planted", "verl_dmd.trainer",
               "verl_dmd.trainer.ray_trainer", "verl_dmd.trainer.registry"}  # fmt: skip
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        found = imports_of(planted, modules)
    finally:
        ROOT = saved
    assert found == {"verl_dmd.trainer.ray_trainer": 2, "verl_dmd.trainer.registry": 4}
    assert all(layer_of(t) > layer_of("verl_dmd.runtime.planted") for t in found)


def test_the_architecture_page_names_every_layer_entry():
    """docs/architecture.md draws the layers of verl_dmd.layers: every declared module prefix is on it."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    missing = [
        name for name in LAYERS if name != "verl_dmd" and f"`{name.removeprefix('verl_dmd.')}" not in text
    ]
    assert not missing, f"docs/architecture.md does not mention {missing}"
