"""What every ``nkv`` command shares: one-line output and errors, tables, progress bars and common options
(the checks before a flow or a model: ``flows.cli.checks``)."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Optional

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)
from rich.table import Table
from rich.text import Text

from flows import output
from flows.cli.app import verbose
from flows.output import plain
from pipeline.documents import InputError
from pipeline.errors import ModelLoadError
from pipeline.spec import BatchSpec
from pipeline.store.errors import StoreError, is_interrupt

console = Console(stderr=True)
# Tables go to stdout; piped output gets each table at its own width (no column lost to a default 80).
out_console = Console(width=None if sys.stdout.isatty() else 100_000)


def spec_option(name: str, default=None, help: Optional[str] = None):
    """The option for one of the spec's own fields (``--input``, ``--model``...): its default and help."""
    field = BatchSpec.model_fields[name]
    return typer.Option(field.default if default is None else default, "--" + name.replace("_", "-"),
                        help=help or field.description)


ModelOpt, DbOpt, InputOpt, TaskOpt = (spec_option(n) for n in ("model", "db", "input", "task"))
DataPathOpt = typer.Option(None, "--data-path", help="folder (shared by every worker) for a new lake's Parquet files")


def say(*parts, style: Optional[str] = None) -> None:
    """One line to stderr. Strings are literal (never Rich markup) and control characters are escaped;
    ``(text, style)`` pairs are styled. soft_wrap: one line even when stderr is not a terminal."""
    line = Text.assemble(*((plain(p[0]), p[1]) if isinstance(p, tuple) else plain(p) for p in parts))
    if style:
        line.stylize(style)
    console.print(line, highlight=False, soft_wrap=True)


def fail(message: str, code: int = 2) -> None:
    say(("error:", "red"), " ", message)
    raise typer.Exit(code)


def markup_safe(text) -> str:
    """User text inside a Rich markup string (progress descriptions)."""
    return escape(plain(text))


@contextmanager
def user_errors():
    """Bad input, a held database or an unloadable model end the command with one line, exit 2."""
    try:
        yield
    except (InputError, StoreError, ModelLoadError) as exc:
        if verbose["on"]:
            console.print_exception()
        fail(str(exc))


@contextmanager
def interrupted_exits(what: str):
    """Ctrl-C anywhere inside (opening the store, the statement, writing rows, closing): one line, exit 130."""
    try:
        yield
    except (KeyboardInterrupt, RuntimeError, OSError) as exc:
        if not is_interrupt(exc):
            raise
        fail(f"{what} interrupted (Ctrl-C)", 130)


def progress_bars() -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),  # the prefill bar: tokens read of the document's total, and when it ends
        console=console,
        transient=False,
    )


def print_table(table, fmt: str = "table", title: Optional[str] = None) -> None:
    """Print a pyarrow Table as a terminal table, CSV or JSON (stdout)."""
    print_result(table.schema, table.to_batches(), fmt, title)


def print_result(schema, batches, fmt: str = "table", title: Optional[str] = None) -> bool:
    """Record batches as a terminal table, CSV or JSON (stdout), written as they come; a table shows at most
    ``output.TABLE_ROWS`` rows. True when rows were left out (the caller may stop the query)."""
    if fmt in ("csv", "json"):
        output.write_result(fmt, schema, batches, sys.stdout)
        return False
    cells, more = output.table_rows(batches)
    out = Table(title=title, show_lines=False)
    for i, name in enumerate(schema.names):
        # Short columns (ids, numbers) never wrap; long text folds.
        widest = max([len(name)] + [len(c[i]) for c in cells])
        out.add_column(Text(plain(name)), overflow="fold", min_width=min(widest, 28))
    for c in cells:
        out.add_row(*(Text(v) for v in c))
    out_console.print(out)
    return more


def split_list(value: Optional[str], cast, flag: str) -> list:
    try:
        return [cast(v.strip()) for v in (value or "").split(",") if v.strip()]
    except ValueError:
        fail(f"{flag}: expected a comma-separated list, got {value!r}")


def _given(error: dict) -> str:
    """The value a type error refused, where pydantic's message does not say it."""
    value = error.get("input")
    if error["type"].endswith("_parsing") or error["type"] in ("bool_type", "int_type", "float_type"):
        if isinstance(value, (str, int, float)) and len(repr(value)) <= 40:
            return f" (got {value!r})"
    return ""


def invalid(exc: Exception) -> None:
    if isinstance(exc, ValidationError):
        # removeprefix: pydantic's wording for a validator's ValueError, noise to a user
        fail("invalid options: " + "; ".join(f"{'.'.join(map(str, e['loc'])) or 'config'}: "
                                             f"{e['msg'].removeprefix('Value error, ')}{_given(e)}"
                                             for e in exc.errors()))
    fail(f"invalid options: {exc}")


