"""Imports go one way: flows -> pipeline -> nestedkv -> (mlx, mlx_lm). Checked on the source (lazy imports
inside functions count too) and on what importing a package really loads."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "nestedkv": {"pipeline", "flows", "prefect", "duckdb", "pyarrow", "typer"},
    "pipeline": {"flows", "prefect", "typer"},
}


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_module_imports_upward(package):
    bad = {str(p.relative_to(ROOT)): sorted(imported_roots(p) & FORBIDDEN[package])
           for p in sorted((ROOT / package).glob("*.py"))}
    assert {k: v for k, v in bad.items() if v} == {}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_importing_a_package_loads_nothing_above_it(package):
    code = (f"import sys, {package}; "
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({sorted(FORBIDDEN[package])!r})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
