"""The layers of docs/architecture.md hold: an AST walk over jaxckpt/ (nothing is imported).

Every import counts, function-level ones included. Rules:
  - ``_format`` (the on-disk vocabulary) imports neither jax nor tensorstore;
  - ``_planning`` never imports tensorstore or storage, sources, the manager or the CLI;
  - ``_storage`` never imports jax or planning (of the runtime, only its thread pools and
    its libc);
  - ``_sources`` reach the load path only through storage's ``Reader`` protocol: no jax, no
    planning (of the runtime, only ``progress``, the one display of long work);
  - ``_runtime`` imports no tensorstore and nothing above it; of ``_format``, only ``grid``:
    the host buffers it stages start on the data layout's ``ALIGN``, a constant of the
    on-disk layout that the in-place reads share (numpy only, so the runtime gains nothing
    else by it);
  - ``_api`` (the public entry points) never imports the layers built on it: the local tier
    (``_tiers``), the manager or the CLI;
  - ``_tiers`` (the local tier and elastic recovery) may import what ``_manager`` may, but
    not ``_manager`` (the run that uses it); ``_manager`` may import ``_tiers``, and neither
    imports the CLI;
  - no import cycles, no module uses another module's ``_private`` name, no function is
    longer than 60 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "jaxckpt"
UPPER = ("jaxckpt._api", "jaxckpt._tiers", "jaxckpt._manager", "jaxckpt._cli", "jaxckpt._sources")


def _name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in sorted(ROOT.rglob("*.py"))}
TREES = {m: ast.parse(p.read_text(), str(p)) for m, p in MODULES.items()}


def _imports(module: str) -> set[str]:
    """Absolute names of everything ``module`` imports (modules, or module.name)."""
    out = set()
    is_pkg = MODULES[module].name == "__init__.py"
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + is_pkg]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            out.add(src)
            out.update(f"{src}.{a.name}" for a in node.names)
    return out


def _jaxckpt_deps(module: str) -> set[str]:
    deps = set()
    for name in _imports(module):
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name and name != module and not module.startswith(name + "."):
            deps.add(name)
    return deps - {"jaxckpt"}


def _layer(prefix: str) -> list[str]:
    return [m for m in MODULES if m == prefix or m.startswith(prefix + ".")]


def _uses(module: str, roots: tuple[str, ...], allowed: tuple[str, ...] = ()) -> list[str]:
    """What ``module`` imports under ``roots``, but for ``allowed`` modules (their names and
    the packages they are imported from: ``from jaxckpt._runtime import pools``)."""

    def ok(n: str) -> bool:
        return any(a == n or a.startswith(n + ".") or n.startswith(a + ".") for a in allowed)

    under = (n for n in _imports(module) if any(n == r or n.startswith(r + ".") for r in roots))
    return sorted(n for n in under if not ok(n))


FORBIDDEN = {
    "jaxckpt._format": ("jax", "jaxlib", "tensorstore", "jaxckpt._planning", "jaxckpt._storage",
                        "jaxckpt._runtime", *UPPER),
    "jaxckpt._planning": ("tensorstore", "jaxckpt._storage", *UPPER),
    "jaxckpt._storage": ("jax", "jaxlib", "jaxckpt._planning", *UPPER, "jaxckpt._runtime"),
    "jaxckpt._sources": ("jax", "jaxlib", "jaxckpt._planning", "jaxckpt._api", "jaxckpt._tiers",
                         "jaxckpt._manager", "jaxckpt._cli", "jaxckpt._runtime"),
    "jaxckpt._runtime": ("tensorstore", "jaxckpt._format", "jaxckpt._planning", "jaxckpt._storage",
                         *UPPER),
    "jaxckpt._api": ("jaxckpt._tiers", "jaxckpt._manager", "jaxckpt._cli"),
    "jaxckpt._tiers": ("jaxckpt._manager", "jaxckpt._cli"),
    "jaxckpt._manager": ("jaxckpt._cli",),
}  # fmt: skip
# The exceptions to FORBIDDEN, by layer: modules of a forbidden layer that it may import.
ALLOWED = {
    "jaxckpt._storage": ("jaxckpt._runtime.pools", "jaxckpt._runtime.libc"),
    "jaxckpt._runtime": ("jaxckpt._format.grid",),
    # progress of long work: one implementation for every layer's long calls (stdlib only)
    "jaxckpt._sources": ("jaxckpt._runtime.progress",),
}


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports(layer):
    bad = {m: _uses(m, FORBIDDEN[layer], ALLOWED.get(layer, ())) for m in _layer(layer)}
    assert not {m: b for m, b in bad.items() if b}, f"{layer} imports what its layer may not"


def test_every_layer_is_a_documented_subpackage():
    flat = [m for m, p in MODULES.items() if p.parent == ROOT and p.name != "__init__.py"]
    assert len(flat) <= 5, flat
    for pkg in (p for p in ROOT.iterdir() if p.is_dir() and p.name.startswith("_")):
        if pkg.name == "__pycache__":
            continue
        doc = ast.get_docstring(TREES[_name(pkg / "__init__.py")])
        assert doc and "May import" in doc, f"{pkg.name}/__init__.py must say what it may import"


def test_no_import_cycles():
    graph = {m: _jaxckpt_deps(m) for m in MODULES}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(d) :] + [d]))
            if d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_no_private_reach_ins():
    found = []
    for m, tree in TREES.items():
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxckpt"):
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    if full in MODULES:
                        aliases[a.asname or a.name] = full
                    elif a.name.startswith("_") and not a.name.startswith("__"):
                        found.append(f"{m}: from {node.module} import {a.name}")
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and f"{aliases[node.value.id]}.{node.attr}" not in MODULES
            ):
                found.append(f"{m}: {node.value.id}.{node.attr}")
    assert not found, found


MAX_FUNCTION_LINES = 60


def _docstring_lines(tree: ast.Module) -> set[int]:
    """The line numbers of every module, class and function docstring."""
    found: set[int] = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            d = n.body[0] if n.body else None
            if isinstance(d, ast.Expr) and isinstance(getattr(d, "value", None), ast.Constant):
                if isinstance(d.value.value, str):
                    found.update(range(d.lineno, (d.end_lineno or d.lineno) + 1))
    return found


def _code_lines(lines: list[str], node: ast.AST, docs: set[int]) -> int:
    """Lines of code of ``node``: docstrings, comments and blank lines do not count (house
    rule: documentation never counts against a size limit, never shorten one to fit)."""
    return sum(
        1
        for i in range(node.lineno, node.end_lineno + 1)
        if i not in docs and (t := lines[i - 1].strip()) and not t.startswith("#")
    )


def test_no_function_is_longer_than_60_lines():
    # Lines of code from the def line to the last: a longer one is split at its phase boundaries
    long = []
    for m, tree in TREES.items():
        lines, docs = MODULES[m].read_text().splitlines(), _docstring_lines(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = _code_lines(lines, node, docs)
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{m}.{node.name} (line {node.lineno}): {n} lines of code")
    assert not long, long
