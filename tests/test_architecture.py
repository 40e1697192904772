"""The house rules of docs/ARCHITECTURE.md, read off the code: imports run down the floors.

bsrun's modules are walked with `ast` (every import statement, also those inside
functions: a lazy import is still a dependency), so a new circle or an import up a floor
fails here, not in a reviewer's head.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "bsrun"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def bsrun_modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The bsrun modules `path` imports (a `from package import name` of a submodule counts
    as that submodule)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                found.add(submodule if submodule in modules else source)
    return {m for m in found if m in modules and m != name}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = bsrun_modules()
    return {name: imports_of(path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module, or a module importing itself."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_walk_sees_real_imports(graph):
    """The walker itself: it finds imports of every form (a guard against a test that
    passes because it sees nothing)."""
    assert "bsrun.sched.task" in graph["bsrun.sched.core"]          # from bsrun.sched.task import ...
    assert "bsrun.inject.state" in graph["bsrun.inject.patches"]    # from bsrun.inject import state
    assert "bsrun.inject.bootstrap" in graph["bsrun.inject.site.sitecustomize"]  # inside a function
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_among_bsrun_modules(graph):
    assert cycles(graph) == []


FORBIDDEN = {
    # sched/ is the framework-free scheduler: it may use the config, errors and fsutil below it
    "bsrun.sched": ("bsrun.inject", "bsrun.launch", "bsrun.profile", "bsrun.tune", "bsrun.bench", "bsrun.cli",
                    "bsrun.child", "bsrun.console", "bsrun.dry_run"),
    # inject/ runs inside the workers: nothing of the tools that run beside or above a launch
    "bsrun.inject": ("bsrun.profile", "bsrun.tune", "bsrun.bench", "bsrun.cli", "bsrun.launch", "bsrun.child",
                     "bsrun.console", "bsrun.dry_run"),
    "bsrun.launch": ("bsrun.profile", "bsrun.tune", "bsrun.bench", "bsrun.cli"),
    "bsrun.profile": ("bsrun.tune", "bsrun.bench", "bsrun.cli"),
}


@pytest.mark.parametrize("floor", sorted(FORBIDDEN))
def test_no_import_runs_up_a_floor(graph, floor):
    bad = sorted(f"{module} -> {target}" for module, targets in graph.items()
                 if module == floor or module.startswith(floor + ".")
                 for target in targets
                 if any(target == f or target.startswith(f + ".") for f in FORBIDDEN[floor]))
    assert bad == []


def test_the_trace_event_table_and_the_worker_state_are_leaves(graph):
    """What both sides of a contract share imports nothing that does work."""
    assert graph["bsrun.inject.state"] <= {"bsrun.config"}
    assert graph.get("bsrun.trace_events", set()) == set()
    assert graph["bsrun.sched.task"] <= {"bsrun.sched.partition"}


def test_no_module_is_over_400_lines_and_each_says_its_job():
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        assert len(text.splitlines()) <= 420, f"{path} has {len(text.splitlines())} lines"
        if text.strip():
            doc = ast.get_docstring(ast.parse(text))
            assert doc and doc.splitlines()[0].strip(), f"{path} has no first docstring line saying its job"
