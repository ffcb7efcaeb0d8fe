"""What every ``nkv`` command shares: one-line output and errors, tables, progress bars, common
options, and the checks made before any work starts."""

from __future__ import annotations

import logging
import os
import signal
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer
from prefect.logging.handlers import PrefectConsoleHandler
from prefect.settings import get_current_settings
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)
from rich.table import Table
from rich.text import Text

from flows import output
from flows.cli.app import verbose
from flows.deploy import ServerUnavailable, check_server
from flows.output import CONTROL_ESCAPES, plain
from nestedkv.cache import check_group_size
from pipeline import models
from pipeline.documents import InputError, check_input
from pipeline.models import ModelLoadError, cache_dir_problem
from pipeline.paths import unwritable
from pipeline.spec import BatchSpec
from pipeline.store import Store, StoreError
from pipeline.store.errors import is_interrupt

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


_LOG_CONTROL = {c: e for c, e in CONTROL_ESCAPES.items() if chr(c) not in "\n\t"}  # log lines may span lines


class _PrintableLog(logging.Filter):
    """Prefect's log lines quote doc_ids and paths from the input: their control characters shown escaped."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        safe = msg.translate(_LOG_CONTROL)
        if safe != msg:
            record.msg, record.args = safe, None
        return True


def printable_prefect_logs() -> None:
    """Put ``_PrintableLog`` on Prefect's console handlers (importing its flow API, as ``flows.batch`` does,
    makes them)."""
    loggers = [logging.getLogger(), *(lg for lg in logging.Logger.manager.loggerDict.values()
                                      if isinstance(lg, logging.Logger))]
    for handler in {h for lg in loggers for h in lg.handlers if isinstance(h, PrefectConsoleHandler)}:
        if not any(isinstance(f, _PrintableLog) for f in handler.filters):
            handler.addFilter(_PrintableLog())


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


def check_environment(prefect: bool = True) -> None:
    """Environment faults, before any work: one line naming the variable and the fix. ``prefect``: the
    command runs a flow (Prefect's home must be writable, a configured server must answer)."""
    tmp = os.environ.get("TMPDIR")
    if tmp is not None:  # mlx, DuckDB and Prefect's subprocesses take it as it is
        why = "it is empty" if not tmp else unwritable(tmp) or (None if Path(tmp).is_dir() else "no such folder")
        if why:
            fail(f"TMPDIR={tmp}: {why}; point TMPDIR at a writable folder or unset it")
    problem = cache_dir_problem()  # where models are converted, by this command or its flow runs
    if problem:
        fail(problem)
    if not prefect:
        return
    home = os.environ.get("PREFECT_HOME")
    try:
        folder = Path(home) if home else Path.home() / ".prefect"
    except RuntimeError:  # no HOME and no password entry
        fail("HOME is unset and Prefect keeps its files under it; set HOME or PREFECT_HOME to a writable folder")
    why = unwritable(folder)
    if why:
        var = f"PREFECT_HOME={home}" if home else f"HOME={Path.home()} (Prefect keeps its files in ~/.prefect)"
        fail(f"{var}: {why}; set PREFECT_HOME to a writable folder")
    if get_current_settings().api.url:
        try:
            check_server(hint="start it (`prefect server start`) or unset PREFECT_API_URL to run with a "
                              "temporary server of this command's own")
        except ServerUnavailable as exc:
            fail(str(exc))


def exit_on_sigterm() -> None:
    """A terminated flow run still stops Prefect's temporary server (its atexit hook), instead of orphaning it.
    Ctrl-C (SIGINT) stops the batch the same clean way even when the command inherited SIGINT ignored, as a
    non-interactive shell's background job does: Python then keeps it ignored, and the interrupted command went
    on holding the store."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def check_input_early(input: str) -> None:
    """Fail on a missing or damaged input before a flow (and Prefect's temporary server) starts."""
    with user_errors():
        check_input(input, pages=True)


def check_before_flow(spec: BatchSpec, data_path: Optional[str] = None, load: bool = True) -> None:
    """What can be checked before a flow starts is checked here, so an expected error is one line and
    leaves nothing behind: the input's pages, the model (loaded: only loading finds missing weights or a
    damaged file; the flow reuses this process's copy), and that the store opens for writing.
    ``load=False`` (a fan-out, whose workers load the model): the reference is only resolved."""
    check_input_early(spec.input)
    db = spec.db
    with user_errors():
        # a bad reference fails before any loading
        loaded = (models.load_model if load else models.check_reference)(spec.model)
        if load:
            check_kv_group_size(loaded[0], spec.configs())
        with Store(db, wait_s=spec.options.wait, data_path=data_path, on_wait=lambda waited, total: say(
                f"{db} is held by another writer; waited {waited:.0f} of {total:.0f} s", style="yellow")):
            pass


def check_kv_group_size(model, configs) -> None:
    """A quantization group that does not divide the model's head dimension: one line, before any prefill."""
    for size in sorted({c.kv_group_size for c in configs if c.kv_bits is not None}):
        try:
            check_group_size(model, size)
        except ValueError as exc:
            fail(f"--kv-group-size: {exc}")

