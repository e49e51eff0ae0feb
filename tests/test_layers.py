"""The package's layers only point down, and no modules import each other in a circle.

Every import is read from the AST of every module under ``dsv4lab/`` -- lazy imports inside
function bodies included, which is where back-edges used to hide. A module's layer is the first
entry of ``LAYERS`` whose prefix it falls under; an import of a module in a HIGHER layer is a
back-edge. Within a layer imports are free, but the module graph as a whole must have no cycles
(a package ``__init__`` that imports its submodules counts as importing them).
"""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# lowest first; see docs/architecture.md
LAYERS: list[tuple[str, ...]] = [
    ("dsv4lab.config", "dsv4lab.patterns", "dsv4lab.handles", "dsv4lab.lanes"),
    ("dsv4lab.quant",),
    ("dsv4lab.checkpoint",),
    ("dsv4lab.model",),
    ("dsv4lab.kernels",),
    ("dsv4lab.decode", "dsv4lab.analysis", "dsv4lab.dump", "dsv4lab.text", "dsv4lab.multidevice", "dsv4lab.train",
     "dsv4lab.plan"),
    ("dsv4lab.bugzoo", "dsv4lab.precision"),
    ("dsv4lab.workbench", "dsv4lab.loading"),
    ("dsv4lab.triage",),
    ("dsv4lab.cli", "dsv4lab.__main__", "dsv4lab"),
]


def module_files() -> dict[str, pathlib.Path]:
    out = {}
    for p in sorted((ROOT / "dsv4lab").rglob("*.py")):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = module_files()


def layer_of_module(mod: str) -> int:
    best, best_len = None, -1
    for i, prefixes in enumerate(LAYERS):
        for pre in prefixes:
            if (mod == pre or mod.startswith(pre + ".")) and len(pre) > best_len:
                best, best_len = i, len(pre)
    if best is None:
        raise AssertionError(f"module {mod} is in no layer: add its package to LAYERS in tests/test_layers.py")
    return best


def _known(name: str) -> str | None:
    while name and name not in MODULES:
        if "." not in name:
            return None
        name = name.rsplit(".", 1)[0]
    return name


def imports_of(mod: str, path: pathlib.Path) -> list[tuple[str, int]]:
    """(imported module, line) for every import statement anywhere in the file."""
    is_pkg = path.name == "__init__.py"
    here = mod.split(".") if is_pkg else mod.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            targets = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in MODULES else prefix for a in node.names]
        else:
            continue
        for t in targets:
            k = _known(t)
            if k is not None and k != mod:
                out.append((k, node.lineno))
    return out


GRAPH = {m: imports_of(m, p) for m, p in MODULES.items()}


def test_every_module_has_a_layer():
    for m in MODULES:
        layer_of_module(m)


def test_no_back_edges():
    bad = []
    for mod, deps in GRAPH.items():
        for dep, line in deps:
            if layer_of_module(dep) > layer_of_module(mod):
                bad.append(f"{MODULES[mod].relative_to(ROOT)}:{line} {mod} -> {dep}")
    assert not bad, "imports that point up a layer:\n" + "\n".join(sorted(bad))


def cycles(graph: dict[str, list[tuple[str, int]]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w, _ in graph.get(v, []):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_cycles():
    found = cycles(GRAPH)
    assert not found, "modules that import each other in a circle:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_checker_sees_back_edges_and_cycles():
    g = {"dsv4lab.quant.a": [("dsv4lab.triage.b", 1)], "dsv4lab.triage.b": [("dsv4lab.quant.a", 2)]}
    assert cycles(g) == [["dsv4lab.quant.a", "dsv4lab.triage.b"]]
    assert layer_of_module("dsv4lab.triage.b") > layer_of_module("dsv4lab.quant.a")
    assert layer_of_module("dsv4lab.kernels.x") > layer_of_module("dsv4lab.model.x")


@pytest.mark.parametrize("mod", sorted(MODULES))
def test_no_private_names_across_modules(mod):
    """``from X import _name`` across modules hides a shared helper without a public name."""
    path = MODULES[mod]
    bad = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("dsv4lab")):
            bad += [f"line {node.lineno}: {a.name}" for a in node.names if a.name.startswith("_") and a.name != "__version__"]
    assert not bad, f"{mod} imports private names: {bad}"
