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


def _leaf_commands(group=None, path=()):
    group = group or get_command(app)
    ctx = typer.Context(group)
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        if hasattr(cmd, "list_commands"):
            yield from _leaf_commands(cmd, path + (name,))
        else:
            yield path + (name,), cmd


# What no declaration holds: the model and input references (the batch spec's options), where a command writes
# its own output, and the batch commands' own fan-out and comparison switches.
HAND_WRITTEN = {"model", "input", "out", "task", "db", "data_path", "pool", "shards", "shard_size", "compare_full"}


def test_every_option_is_its_declarations_and_declared_once():
    """Each generated option defaults to its declaration's default (unless its command sets its own, a suite's
    grid say), and what stays hand-written in a command is only what no declaration holds; the suite, tasks,
    ablation and every bench command are generated from their settings model or benchmark signature."""
    from flows.options import cli_default, declared

    generated = 0
    for path, cmd in _leaf_commands():
        fields, overridden = declared(cmd.callback)
        own = {p.name for p in cmd.params if p.name not in fields and p.name != "help"}
        assert not own & set(fields), (path, own & set(fields))
        if path[0] in ("bench", "suite", "tasks", "ablation"):
            assert own <= HAND_WRITTEN, (path, own - HAND_WRITTEN)
            assert fields, path
        for p in cmd.params:
            field = fields.get(p.name)
            if field is None or p.name in overridden:
                continue
            generated += 1
            want = cli_default(field)
            assert (p.default is None if want is None else str(p.default) == str(want)), (path, p.name, p.default, want)
    assert generated > 100


def test_a_list_option_is_comma_separated_and_a_bad_item_names_its_flag():
    result = CliRunner().invoke(app, ["bench", "memory", "--lengths", "1024,x"])
    assert result.exit_code == 2 and "--lengths" in result.output and "int" in result.output


def test_a_generated_option_reaches_the_benchmark(monkeypatch):
    from bench import rope

    seen = {}
    monkeypatch.setattr(rope, "run", lambda *a, **kw: seen.update(args=a, kw=kw))
    result = CliRunner().invoke(app, ["bench", "rope", "--context", "2048", "--seed", "3"])
    assert result.exit_code == 0, result.output
    assert seen["kw"]["context"] == 2048 and seen["kw"]["seed"] == 3 and seen["kw"]["step"] == 512

def test_help_lists_every_registered_task_and_variant():
    from pipeline.suite.variants import VARIANTS
    from pipeline.tasks import KNOWN

    root = get_command(app)
    params = {p.name: p for p in root.get_command(typer.Context(root), "suite").params}
    assert all(t in params["tasks"].help for t in KNOWN)
    ablation = {p.name: p for p in root.get_command(typer.Context(root), "ablation").params}
    assert all(v in ablation["variants"].help for v in VARIANTS)
