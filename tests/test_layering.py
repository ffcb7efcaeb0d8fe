"""Imports go one way: flows -> bench -> pipeline -> nestedkv -> (mlx, mlx_lm), and no module imports itself back
through others (no import circle, inside a package too), and every import is at its module's top. Checked on the
source and on what importing a package really loads."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "nestedkv": {"pipeline", "bench", "flows", "prefect", "duckdb", "pyarrow", "typer"},
    "pipeline": {"bench", "flows", "prefect", "typer"},
    "bench": {"flows", "prefect", "typer"},
}
PACKAGES = ("nestedkv", "pipeline", "bench", "flows")


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def imports_in_functions(source: str) -> list[int]:
    """The lines of the imports inside a function (a method or a nested function too)."""
    functions = [n for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return sorted({n.lineno for f in functions for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))})


def test_imports_in_functions_are_found():
    source = "import os\n\nclass C:\n    def f(self):\n        if os:\n            from json import dumps\n"
    assert imports_in_functions(source) == [6] and imports_in_functions("import os\n") == []


def test_product_modules_import_at_their_top():
    # The CPU opt-in runs on importing flows (flows/__init__.py), and the CLI loads its command modules through
    # one table (flows.cli.app, with importlib): no import waits inside a function.
    found = {str(p.relative_to(ROOT)): lines for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))
             if (lines := imports_in_functions(p.read_text()))}
    assert found == {}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_module_imports_upward(package):
    bad = {str(p.relative_to(ROOT)): sorted(imported_roots(p) & FORBIDDEN[package])
           for p in sorted((ROOT / package).rglob("*.py"))}  # subpackages too
    assert {k: v for k, v in bad.items() if v} == {}


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The product modules ``path`` imports: ``from pkg import name`` is ``pkg.name`` when that is a module,
    else ``pkg`` (its ``__init__``)."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
    return out & modules


def module_graph() -> dict[str, set[str]]:
    files = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}
    return {name: imported_modules(path, set(files)) - {name} for name, path in files.items()}


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan): each holds at least one circle."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_circle_finder_finds_circles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"f"}, "f": {"e"}, "g": set()}
    assert import_circles(graph) == [["a", "b", "c"], ["e", "f"]]
    assert import_circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles_between_product_modules():
    graph = module_graph()
    assert {"pipeline.config", "flows.batch", "nestedkv.cache"} <= set(graph)
    assert "pipeline.config" in graph["pipeline.engine"]  # the graph sees imports
    circles = import_circles(graph)
    assert len(circles) == 0, circles


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_importing_a_package_loads_nothing_above_it(package):
    code = (f"import sys, {package}; "
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({sorted(FORBIDDEN[package])!r})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_every_product_package_is_shipped():
    # an explicit package list drops subpackages from a wheel (pip install ., not -e): pipeline.store would be missing
    import fnmatch

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for pkg in PACKAGES for p in (ROOT / pkg).rglob("__init__.py")}
    missing = {name for name in on_disk if not any(fnmatch.fnmatchcase(name, pat) for pat in find["include"])}
    assert {"pipeline.store", "nestedkv.press", "flows.cli"} <= on_disk and not missing, missing


def test_benchmarks_live_in_bench_and_each_is_an_nkv_bench_command():
    import typer
    from typer.main import get_command

    from flows.cli import app

    lab = [p.name for p in (ROOT / "pipeline").glob("*.py")
           if p.name.startswith(("bench", "peer_", "ablation"))]
    assert lab == []
    root = get_command(app)
    group = root.get_command(typer.Context(root), "bench")
    helpers = {"__init__", "peer_export", "peer_worker", "rss", "ablation", "blas"}  # used by commands, not commands
    # A command's name spells its module's underscores as hyphens (press_cost.py is `nkv bench press-cost`).
    modules = {p.stem.replace("_", "-") for p in (ROOT / "bench").glob("*.py") if p.stem not in helpers}
    assert modules and modules <= set(group.commands), modules - set(group.commands)
