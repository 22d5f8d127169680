"""The package's imports go down the layers of the design, with no circle.

Every ``import`` in ``src/mono_ext`` (module level and inside functions: a lazy import is still
a dependency) is read from the source (AST), resolved to the module it names and checked:

* no circle between modules;
* imports go down only: engines -> serve -> models (each family's wing: its spec, driver,
  reference and kernel backends) -> kernels (generic device code) -> runtime -> core; ``plugins``, ``tools``, ``cli`` and ``demo`` sit on top;
* ``core`` imports no engine, no kernel language and no other layer, and torch (but never
  ``torch.cuda``) only inside the functions that need it: it imports on a CPU-only box.

"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "mono_ext"
RANK = {"core": 0, "runtime": 1, "kernels": 2, "models": 3, "serve": 4, "engines": 5}
TOP = {"plugins", "tools", "cli", "demo", "__init__"}
CORE_NEVER = ("vllm", "sglang", "triton", "flydsl")


def _modules() -> dict[str, Path]:
    out = {}
    for f in SRC.rglob("*.py"):
        parts = list(f.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts) or "__init__"] = f
    return out


MODULES = _modules()


def _resolve(full: str) -> str | None:
    """The mono_ext module ``full`` (a dotted name) is in, or None for another package."""
    if full != "mono_ext" and not full.startswith("mono_ext."):
        return None
    mod = full.removeprefix("mono_ext").removeprefix(".") or "__init__"
    while mod not in MODULES and "." in mod:
        mod = mod.rsplit(".", 1)[0]
    return mod if mod in MODULES else "__init__"


def _imports(name: str, path: Path) -> tuple[set[str], set[str], set[str]]:
    """(mono_ext modules ``name`` imports, other packages it imports anywhere, other packages
    it imports at module level)."""
    pkg = [] if name == "__init__" else name.split(".")
    if path.name != "__init__.py":
        pkg = pkg[:-1]
    tree = ast.parse(path.read_text())
    top_level = {id(n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))}
    ours, theirs, at_import = set(), set(), set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - (node.level - 1)] + ([node.module] if node.module else [])
                base_name = ".".join(["mono_ext", *base])
            else:
                base_name = node.module or ""
            for a in node.names:  # a submodule if there is one by that name, else the module
                sub = f"{base_name}.{a.name}"
                is_module = sub.removeprefix("mono_ext.") in MODULES
                names.append(sub if is_module else base_name)
        for full in names:
            mod = _resolve(full)
            if mod is None:
                theirs.add(full)
                if id(node) in top_level:
                    at_import.add(full)
            elif mod != name:
                ours.add(mod)
    return ours, theirs, at_import


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(name: str) -> str:
    return name.split(".")[0]


def test_the_walk_sees_the_package():
    assert {"core.spec", "serve.lifecycle", "engines.vllm.model", "runtime.failstop"} <= set(
        MODULES
    )
    assert "serve.lifecycle" in GRAPH["engines.vllm.model"][0]
    assert "torch" in GRAPH["engines.vllm.model"][1]


def test_no_import_circle():
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH[v][0]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert circles == []


def test_imports_go_down_the_layers():
    upward = set()
    for name, (ours, *_) in GRAPH.items():
        a = _layer(name)
        if a in TOP:
            continue
        assert a in RANK, f"{name}: layer {a!r} has no place in the design"
        for dep in ours:
            b = _layer(dep)
            if b in TOP or RANK[b] > RANK[a]:
                upward.add((name, dep))
    assert upward == set(), "imports that go up the layers"


def test_core_imports_no_engine_kernel_language_or_torch_at_import():
    for name, (ours, theirs, at_import) in GRAPH.items():
        if _layer(name) != "core":
            continue
        bad = {t for t in theirs if t.split(".")[0] in CORE_NEVER or t.startswith("torch.cuda")}
        bad |= {t for t in at_import if t.split(".")[0] == "torch"}
        bad |= {f"mono_ext.{m}" for m in ours if _layer(m) != "core"}
        assert not bad, f"{name} imports {sorted(bad)}"
