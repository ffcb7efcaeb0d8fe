"""The ``nkv`` app's command table (flows.cli.app): listing loads no command module, each command is found in
the module the table names, with the table's help."""

import importlib
import subprocess
import sys
import typing

import duckdb
import pytest
import typer
from typer.main import get_command
from typer.testing import CliRunner

from flows.cli.app import COMMANDS, app, command, group

ROOT_MODULES = ("flows.cli.", "mlx", "prefect", "matplotlib", "transformers", "pipeline", "bench")


def test_listing_the_commands_loads_none_of_their_modules():
    code = ("import sys; from typer.testing import CliRunner; from flows.cli import app; "
            "r = CliRunner().invoke(app, ['--help']); print(r.exit_code); print(r.output); "
            f"print(sorted(m for m in sys.modules if m.startswith({ROOT_MODULES!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    lines = out.strip().splitlines()
    assert lines[0] == "0"
    assert all(f" {name} " in out for name in COMMANDS)
    assert lines[-1] == "['flows.cli.app']"


def test_a_query_loads_neither_the_model_stack_nor_prefect(tmp_path):
    # nkv query is the interactive command: what it imports is what every query waits for.
    db = tmp_path / "q.duckdb"
    code = ("import sys; from typer.testing import CliRunner; from flows.cli import app; "
            f"r = CliRunner().invoke(app, ['query', 'select 6 * 7 as answer', '--db', {str(db)!r}, '--format', 'csv']); "
            "print(r.exit_code); print(r.output); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'mlx_lm', 'transformers', 'prefect', 'matplotlib'}))")
    duckdb.connect(str(db)).close()
    lines = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                           check=True).stdout.strip().splitlines()
    assert lines[0] == "0" and "42" in lines
    assert lines[-1] == "[]"


@pytest.mark.parametrize("name", list(COMMANDS))
def test_each_command_is_in_its_tables_module_with_the_tables_help(name):
    root = get_command(app)
    cmd = root.get_command(typer.Context(root), name)
    assert cmd is not None and cmd.name == name and cmd.help == COMMANDS[name].help


def test_the_table_names_every_command_of_every_group_module():
    modules = {entry.module for entry in COMMANDS.values()}
    found = {}
    for module in modules:
        commands = get_command(importlib.import_module(module).cli)
        names = commands.commands if hasattr(commands, "commands") else {commands.name: commands}
        found.update(dict.fromkeys(names, module))
    assert found == {name: entry.module for name, entry in COMMANDS.items()}


def test_a_command_defined_outside_its_tables_module_is_refused():
    def run():
        pass

    with pytest.raises(RuntimeError, match=f"nkv run is defined in {__name__}; COMMANDS says flows.cli.batch"):
        command(group(), "run")(run)


def test_an_unknown_command_says_so():
    result = CliRunner().invoke(app, ["nosuch"])
    assert result.exit_code == 2 and "No such command 'nosuch'" in result.output


@pytest.mark.parametrize("name", ["run", "eval", "sweep"])
def test_help_lists_every_press_and_every_way_of_reading_a_long_document(name):
    import nestedkv
    from pipeline.config import LongDocs

    root = get_command(app)
    params = {p.name: p for p in root.get_command(typer.Context(root), name).params}
    for press in nestedkv.PRESSES:
        assert press in params["press"].help
    for way in typing.get_args(LongDocs):
        assert way in params["long_docs"].help


def test_bench_options_show_their_benchmarks_own_defaults():
    """A bench option left out keeps the benchmark function's default; its help shows that default, read from
    the function, never a number copied beside it."""
    import inspect
    import re
    from pathlib import Path

    from bench import kernels, quant

    source = (Path(__file__).resolve().parents[1] / "flows/cli/bench.py").read_text()
    assert not re.search(r"\(default [0-9]", source)
    bench = get_command(app).get_command(typer.Context(get_command(app)), "bench")
    ctx = typer.Context(bench)
    helps = {(c, p.name): p.help for c in ("kernels", "quant") for p in bench.get_command(ctx, c).params}
    assert helps[("kernels", "chunk")].endswith(f"(default {inspect.signature(kernels.run).parameters['chunk'].default})")
    assert helps[("kernels", "sizes")].endswith("(default " + ",".join(map(str, kernels.SIZES)) + ")")
    assert helps[("quant", "docs")].endswith(f"(default {inspect.signature(quant.run).parameters['docs'].default})")
