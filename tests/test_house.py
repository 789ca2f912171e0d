"""The layers of the house (docs/architecture.md, "Layers"): every import arrow of the product's source, read with
`ast` (function-level imports and `importlib.import_module("...")` with a constant name included), points down the
table below, and no import cycle joins files of different packages."""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOP = ("v4jax", "pallas_kernels", "sharding", "checkpoints")

# layer -> the layers it may import (itself always). Data flows down; bench and training sit above the product.
ALLOWED = {
    "cli": {"serve", "api", "engine", "memory", "config", "util", "sharding", "checkpoints", "bench", "training"},
    "bench": {"cli", "serve", "api", "engine", "cache", "memory", "model", "kernels", "sharding", "checkpoints", "config",
              "util", "training"},
    "training": {"api", "model", "checkpoints", "sharding", "config", "util"},
    "serve": {"api", "engine", "sharding", "config", "util"},  # sharding: the multi-host step channel
    "api": {"engine", "model", "checkpoints", "sharding", "memory", "config", "util"},
    "engine": {"cache", "model", "sharding", "config"},
    "memory": {"cache", "model", "sharding", "config"},
    "cache": {"sharding", "config"},
    "model": {"kernels", "sharding", "config"},
    "kernels": {"config"},
    "sharding": {"config"},
    "checkpoints": {"config"},
    "util": {"config"},
    "config": set(),
}


def layer_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "pallas_kernels":
        return "kernels"
    if parts[0] in ("sharding", "checkpoints"):
        return parts[0]
    if len(parts) == 1:  # v4jax/__init__.py: the public names of the API
        return "api"
    sub = parts[1]
    if sub in ("serve", "engine", "cache", "model", "bench", "training"):
        return sub
    # fields.py: the bounds of every user-given value, a leaf beside the config
    return {"cli": "cli", "api": "api", "memory": "memory", "config": "config", "fields": "config",
            "__main__": "cli"}.get(sub, "util")


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: pathlib.Path, module: str) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            # `from pkg import mod` imports pkg.mod where that is a module of ours, else pkg (_graph resolves)
            out.update(f"{target}.{a.name}" for a in node.names)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args and isinstance(node.args[0], ast.Constant)):
            out.add(node.args[0].value)
    return {m for m in out if m.split(".")[0] in TOP}


PACKAGES: set[str] = set()  # modules that are packages (their __init__.py)


def _graph() -> dict[str, set[str]]:
    files = {}
    for top in TOP:
        for path in (ROOT / top).rglob("*.py"):
            files[_module_name(path)] = path
            if path.name == "__init__.py":
                PACKAGES.add(_module_name(path))
    graph = {}
    for mod, path in files.items():
        deps = set()
        for imp in _imports(path, mod):
            # resolve to the longest module of ours that the name denotes (a module, or a package's __init__)
            while imp and imp not in files:
                imp = imp.rpartition(".")[0]
            if imp and imp != mod:
                deps.add(imp)
        graph[mod] = deps
    return graph


def test_imports_point_down():
    bad = []
    for mod, deps in sorted(_graph().items()):
        src = layer_of(mod)
        for dep in sorted(deps):
            dst = layer_of(dep)
            if dst != src and dst not in ALLOWED[src]:
                bad.append(f"{mod} ({src}) -> {dep} ({dst})")
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def _package(mod: str) -> str:
    return mod if mod in PACKAGES else mod.rpartition(".")[0]


def test_no_cycle_across_packages():
    graph = _graph()
    index, low, stack, on, sccs = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
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
            sccs.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    crossing = [sorted(c) for c in sccs if len({_package(m) for m in c}) > 1]
    assert not crossing, f"import cycles across packages: {crossing}"


def test_the_checker_sees_a_forbidden_arrow(tmp_path):
    """The rules are not vacuous: the layer table forbids what DESIGN forbids, and relative imports resolve."""
    assert "cache" not in ALLOWED["model"] and "memory" not in ALLOWED["cache"]
    assert "memory" not in ALLOWED["engine"] and ALLOWED["kernels"] == {"config"}
    assert not {"bench", "training"} & (ALLOWED["api"] | ALLOWED["engine"] | ALLOWED["serve"])
    f = tmp_path / "m.py"
    f.write_text("from . import sibling\nfrom ..cache import pools\nimport importlib\n"
                 "importlib.import_module('pallas_kernels.topk')\ndef f():\n    from v4jax.memory import x\n")
    got = _imports(f, "v4jax.model.m")
    assert {"v4jax.model.sibling", "v4jax.cache.pools", "pallas_kernels.topk", "v4jax.memory.x"} <= got
    assert layer_of("v4jax.model.transformer") == "model" and layer_of("pallas_kernels.topk") == "kernels"
