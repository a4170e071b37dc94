"""The package's layering holds (docs/ARCHITECTURE.md): read from the source, every import counted.

Every import counts: top-level, under ``TYPE_CHECKING`` and inside functions. A cycle even at type
level means two modules cannot be understood or changed apart.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "oom_magic"
GLUE = {"oom_magic.notebook.magics", "oom_magic.notebook.extension", "oom_magic.notebook.widget"}
# Modules over the size limit must say why in their docstring (none today).
LINE_LIMIT = 600


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
GLUE = {name for name in MODULES if name.startswith("oom_magic.notebook")}
# The package's capabilities, top to bottom: a package imports only packages below it (or itself).
PACKAGE_LAYERS = ("notebook", "cli", "guard", "fit", "sizing", "heap", "checkpoints", "device", "render", "records", "common")
# The command sits beside the notebook glue: neither imports the other.
TOP = {"oom_magic", "oom_magic.__main__"}


def _imports(name: str) -> set[str]:
    """The other package modules ``name`` imports, and the outside top-level packages (prefixed '!')."""
    path = MODULES[name]
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else (node.module or "")
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            continue
        for target in targets:
            if not target.startswith("oom_magic"):
                found.add("!" + target.split(".")[0])
                continue
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target not in (name, "oom_magic"):
                found.add(target)
    return found


GRAPH = {name: _imports(name) for name in MODULES}


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in GRAPH:
        if start in index:
            continue
        work = [(start, iter(sorted(n for n in GRAPH[start] if n in GRAPH)))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(n for n in GRAPH[child] if n in GRAPH))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_import_graph_is_read_from_every_module() -> None:
    # The check below means something only if the graph is real: the guard reaches the records and facts.
    assert {"oom_magic.records.guard", "oom_magic.device.reading"} <= GRAPH["oom_magic.guard.pipeline"] | {
        m for n in GRAPH["oom_magic.guard.pipeline"] for m in GRAPH.get(n, ())}
    assert len(MODULES) > 50


def _package(name: str) -> str:
    return name.split(".")[1]


def test_the_package_shows_its_capabilities_as_folders() -> None:
    entries = {p.name for p in PACKAGE.iterdir() if not p.name.startswith((".", "_")) and p.name != "py.typed"}
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(PACKAGE_LAYERS) - {"cli"}
    assert entries == folders | {"cli.py", "data"}
    for folder in folders:  # each one says its job in its __init__
        assert len(ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text())) or "") > 80, folder


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n not in TOP))
def test_a_package_imports_only_the_capabilities_below_it(name: str) -> None:
    rank = PACKAGE_LAYERS.index(_package(name))
    above = {n for n in GRAPH[name] if not n.startswith("!") and n not in TOP and PACKAGE_LAYERS.index(_package(n)) < rank}
    assert above == set(), f"{name} imports {sorted(above)}, above it in {PACKAGE_LAYERS}"


def test_render_units_is_a_leaf() -> None:
    assert {n for n in GRAPH["oom_magic.render.units"] if not n.startswith("!")} <= {"oom_magic.common.sizes"}


def test_no_import_cycle_even_at_type_level() -> None:
    assert _cycles() == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    GRAPH["oom_magic.records.oom"].add("oom_magic.guard.oom")  # oom.py imports records.oom: a two-module loop
    try:
        assert ["oom_magic.guard.oom", "oom_magic.records.oom"] in _cycles()
    finally:
        GRAPH["oom_magic.records.oom"].discard("oom_magic.guard.oom")


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith("oom_magic.records")))
def test_a_record_module_imports_no_renderer_and_no_use_case(name: str) -> None:
    allowed = {n for n in MODULES if n.startswith("oom_magic.records")} | {
        "oom_magic.common.errors", "oom_magic.common.sizes", "oom_magic.common.dtypes"}
    assert {n for n in GRAPH[name] if not n.startswith("!")} <= allowed


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith("oom_magic.render")))
def test_a_renderer_imports_records_not_the_code_that_makes_them(name: str) -> None:
    above = {"oom_magic.guard.pipeline", "oom_magic.fit.preflight", "oom_magic.heap.cleanup", "oom_magic.heap.snapshot",
             "oom_magic.notebook.watch", "oom_magic.notebook.magics", "oom_magic.notebook.widget", "oom_magic.guard.diagnose"}
    assert not GRAPH[name] & above


@pytest.mark.parametrize("name", sorted(MODULES))
def test_only_the_glue_imports_ipython_or_ipywidgets_and_nothing_imports_torch(name: str) -> None:
    forbidden = {"!torch"} | (set() if name in GLUE else {"!IPython", "!ipywidgets"})
    # hf_rules imports transformers' submodules only once the user's process holds transformers (or in its child).
    forbidden |= set() if name == "oom_magic.checkpoints.hf_rules" else {"!transformers", "!accelerate"}
    assert not GRAPH[name] & forbidden


@pytest.mark.parametrize("name", sorted(MODULES))
def test_a_long_module_says_why_in_its_docstring(name: str) -> None:
    source = MODULES[name].read_text()
    if source.count("\n") > LINE_LIMIT:
        docstring = ast.get_docstring(ast.parse(source)) or ""
        assert "lines" in docstring, f"{name} is over {LINE_LIMIT} lines: split it by job or say why"
