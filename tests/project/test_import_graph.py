"""No import cycles between fedreid's modules, counting imports inside functions too.

A module's imports are read from its source (every ``import`` statement,
top-level or inside a function, except under ``if TYPE_CHECKING:``); an
import names the deepest fedreid module it loads (``from fedreid.fl.local
import base`` -> ``fedreid.fl.local.base``; ``from fedreid.fl.local.base
import X`` -> ``fedreid.fl.local.base``). A package's ``__init__`` that
re-exports its submodules is not a cycle with them; a submodule that imports
the package's ``__init__`` back is.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "fedreid"


def module_files() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imported_modules(name: str, path: Path, modules: set[str]) -> set[str]:
    """The fedreid modules that module ``name`` (source at ``path``) imports."""
    found: set[str] = set()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            subs = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules]
            found.update(subs)
            if len(subs) < len(node.names):
                found.add(base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imported_modules(name, path, set(files)) for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def test_the_detector_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_imports_inside_functions_and_type_checking_blocks(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from fedreid.config import Config\n"
        "def f():\n    from fedreid.fl import server\n    import fedreid.options\n"
    )
    modules = {"fedreid.config", "fedreid.fl", "fedreid.fl.server", "fedreid.options"}
    assert imported_modules("fedreid.m", source, modules) == {"fedreid.fl.server", "fedreid.options"}


def test_fedreid_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 50 and "fedreid.fl.federation" in graph
    found = cycles(graph)
    assert not found, "import cycles between modules: " + "; ".join(" <-> ".join(c) for c in found)


#: Layers, lowest first: a module imports only from its own layer or below. Rooms are matched by
#: their longest dotted prefix under ``fedreid.``. The order is ../shared/DESIGN.md's, with one
#: refinement the code asks for: the config checks component names and options against the
#: registries of the dataset parsers, client objectives and server hooks, so it sits above those
#: components (data, models and fl's state, update, aggregation, objectives and hooks, none of which
#: imports the config) and below everything that runs them. The configuration reference documents
#: every layer, so it sits at the top.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("utils", "errors"),
    ("options", "registry"),
    ("data",),
    ("models",),
    ("fl.state", "fl.update", "fl.aggregate", "fl.local", "fl.server_hooks"),
    ("config",),
    ("inference",),
    ("eval",),
    ("fl",),
    ("retrieval",),
    ("flower", "reproduce"),
    ("commands", "__main__", "docs_reference"),
)


def layer_of(module: str) -> int:
    """The layer index of ``fedreid.<room>...`` (longest matching room); the package ``fedreid`` itself is the lowest."""
    parts = module.split(".")[1:]
    if not parts:
        return 0
    for depth in range(len(parts), 0, -1):
        room = ".".join(parts[:depth])
        for rank, rooms in enumerate(LAYERS):
            if room in rooms:
                return rank
    raise AssertionError(f"{module}: its room {parts[0]!r} has no layer in tests/project/test_import_graph.py LAYERS")


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps if layer_of(d) > layer_of(m))


def test_the_layer_check_finds_an_upward_import():
    graph = {"fedreid.eval.metrics": {"fedreid.fl.server", "fedreid.utils.io"}, "fedreid.fl.server": {"fedreid.eval"},
             "fedreid.fl.local.fedprox": {"fedreid.config"}, "fedreid.config": {"fedreid.fl.local.objectives"}}
    assert layer_violations(graph) == ["fedreid.eval.metrics -> fedreid.fl.server",
                                       "fedreid.fl.local.fedprox -> fedreid.config"]


def test_no_module_imports_from_a_higher_layer():
    found = layer_violations(import_graph())
    assert not found, "imports running up the layers: " + "; ".join(found)


def test_inference_imports_no_evaluation_retrieval_or_training():
    graph = import_graph()
    inference = {m: deps for m, deps in graph.items() if m.startswith("fedreid.inference")}
    assert inference, "fedreid.inference is missing"
    bad = sorted(f"{m} -> {d}" for m, deps in inference.items() for d in deps
                 if d.split(".")[1] in ("eval", "retrieval", "fl", "flower", "reproduce", "commands"))
    assert not bad, "; ".join(bad)
