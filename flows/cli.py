"""The ``nkv`` command line."""

from __future__ import annotations

import json
import logging
import sys
from contextlib import contextmanager
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.markup import escape
from rich.table import Table
from rich.text import Text

import nestedkv
from flows.options import generation_options, press_options
from flows.output import CONTROL_ESCAPES, plain
from flows.query import QUERY_TIMEOUT_S
from pipeline.config import DEFAULT_DB, DEFAULT_INPUT, DEFAULT_MODEL, RunConfig

app = typer.Typer(add_completion=False, no_args_is_help=True, help="NestedKV batch pipeline for long documents.")
console = Console(stderr=True)
# Tables go to stdout; piped output gets a wide console instead of rich's 80-column default.
out_console = Console(width=None if sys.stdout.isatty() else 160)
ModelOpt = typer.Option(DEFAULT_MODEL, "--model", help="smollm2-135m, an mlx-lm directory, a .gguf file or a HF repo id")
DbOpt = typer.Option(DEFAULT_DB, "--db", help="DuckDB file, or a lake: ducklake:sqlite:PATH, ducklake:postgres:CONNINFO")
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
    """Put ``_PrintableLog`` on Prefect's console handlers (once Prefect is imported: its import makes them)."""
    if "prefect" not in sys.modules:
        return
    from prefect.logging.handlers import PrefectConsoleHandler

    loggers = [logging.getLogger(), *(lg for lg in logging.Logger.manager.loggerDict.values()
                                      if isinstance(lg, logging.Logger))]
    for handler in {h for lg in loggers for h in lg.handlers if isinstance(h, PrefectConsoleHandler)}:
        if not any(isinstance(f, _PrintableLog) for f in handler.filters):
            handler.addFilter(_PrintableLog())


_verbose = {"on": False}  # set by the global --verbose option


@app.callback()
def _global_options(verbose: bool = typer.Option(False, "--verbose", help="show the traceback of an error "
                                                 "before its one-line message")):
    _verbose["on"] = verbose


@contextmanager
def user_errors():
    """Bad input, a held database or an unloadable model end the command with one line, exit 2."""
    from pipeline.documents import InputError
    from pipeline.models import ModelLoadError
    from pipeline.store import StoreError

    try:
        yield
    except (InputError, StoreError, ModelLoadError) as exc:
        if _verbose["on"]:
            console.print_exception()
        fail(str(exc))


def progress_bars() -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )


def print_table(table, fmt: str = "table", title: Optional[str] = None) -> None:
    """Print a pyarrow Table as a terminal table, CSV or JSON (stdout)."""
    print_result(table.schema, table.to_batches(), fmt, title)


def print_result(schema, batches, fmt: str = "table", title: Optional[str] = None) -> bool:
    """Record batches as a terminal table, CSV or JSON (stdout), written as they come; a table shows at most
    ``output.TABLE_ROWS`` rows. True when rows were left out (the caller may stop the query)."""
    from flows import output

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


InputOpt = typer.Option(DEFAULT_INPUT, "--input", help="Parquet file, glob or folder")
TaskOpt = typer.Option("summarize", "--task", help="summarize or qa")


def split_list(value: Optional[str], cast, flag: str) -> list:
    try:
        return [cast(v.strip()) for v in (value or "").split(",") if v.strip()]
    except ValueError:
        fail(f"{flag}: expected a comma-separated list, got {value!r}")


def invalid(exc: Exception) -> None:
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        # removeprefix: pydantic's wording for a validator's ValueError, noise to a user
        fail("invalid options: " + "; ".join(f"{'.'.join(map(str, e['loc'])) or 'config'}: "
                                             f"{e['msg'].removeprefix('Value error, ')}" for e in exc.errors()))
    fail(f"invalid options: {exc}")


def press_grid(press: dict) -> dict:
    """The press options as lists (the budget-sweep flow's parameters and ``make_configs``'s arguments);
    an empty head budget means each press's default."""
    from pipeline.config import parse_kv_bits, parse_press_param

    return {
        "presses": split_list(press["press"], str, "--press"),
        "compression_ratios": split_list(press["compression_ratio"], float, "--compression-ratio"),
        "budgets": split_list(press["budget"], int, "--budget") or None,
        "head_budgets": split_list(press["head_budget"], str, "--head-budget") or [None],
        "prefills": split_list(press["prefill"], str, "--prefill") or ["whole"],
        "press_params": dict(parse_press_param(p) for p in press["press_param"] or []),
        "kv_bits": [parse_kv_bits(b) for b in (press["kv_bits"] or "none").split(",") if b.strip()] or [None],
        "kv_group_sizes": split_list(press["kv_group_size"], int, "--kv-group-size") or [64],
    }


def build(task: str, model: str, press: dict, generation: dict):
    """The configurations (every combination of the press options) and the batch options."""
    from pipeline.config import BatchOptions
    from pipeline.engine import make_configs

    try:
        options = BatchOptions(**generation)
        grid = press_grid(press)
        base = RunConfig(task=task, model=model, **options.generation())
        configs = make_configs(base, grid["presses"], grid["compression_ratios"], grid["budgets"] or (),
                               grid["head_budgets"], grid["prefills"], grid["press_params"], grid["kv_bits"],
                               grid["kv_group_sizes"])
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        invalid(exc)
    return configs, options


@contextmanager
def batch_progress(configs_bar: bool = False):
    """Progress bars for documents, configurations and prefill chunks, as engine hooks."""
    from pipeline.engine import Hooks

    printable_prefect_logs()
    with progress_bars() as bars:
        docs = bars.add_task("documents", total=None)
        cfgs = bars.add_task("configurations", total=None, visible=configs_bar)
        chunks = bars.add_task("prefill", total=None)

        def on_config(i, n, cfg, res):
            bars.update(cfgs, completed=i, total=n, description=markup_safe(f"configurations ({cfg.label()}: {res.status})"))

        yield Hooks(
            on_start=lambda plan: bars.update(docs, total=len(plan.todo_docs)),
            on_prefill=lambda done, total: bars.update(chunks, completed=done, total=total),
            on_config=on_config,
            on_document=lambda i, n, doc, out: bars.update(docs, completed=i, total=n,
                                                           description=markup_safe(f"documents ({doc.doc_id})")),
        )


def print_summary(summary, db: str) -> None:
    import pyarrow as pa

    for err in summary.input_errors:
        say(f"skipped row {err.row} ({err.doc_id or 'no doc_id'}) in {err.source}: {err.field}: {err.message}",
            style="yellow")
    say(
        f"{len(summary.runs)} runs, {summary.n_processed} documents prefilled once each, {summary.n_ok} done, "
        f"{summary.n_failed} failed, {summary.n_skipped} already done, {len(summary.input_errors)} bad rows -> {db}")
    if summary.savings:
        print_table(pa.Table.from_pylist(summary.savings), title="memory savings")


def exit_unless_done(summary) -> None:
    """Exit 1 with one line unless every valid document is done, now or before (README: exit codes)."""
    if not summary.all_done:
        say(("error:", "red"), " ", summary.problem())
        raise typer.Exit(1)


@app.command()
@press_options()
@generation_options()
def run(input: str = InputOpt, task: str = TaskOpt, model: str = ModelOpt, db: str = DbOpt,
        data_path: Optional[str] = DataPathOpt,
        pool: Optional[str] = typer.Option(None, "--pool", help="fan out over this process work pool (needs a lake "
                                           "--db); workers: prefect worker start --pool POOL --limit 1"),
        shards: Optional[int] = typer.Option(None, "--shards", help="with --pool: this many shards"),
        shard_size: Optional[int] = typer.Option(None, "--shard-size", help="with --pool: documents per shard"),
        press: dict = None, generation: dict = None):
    """Run a batch through the Prefect flow and store outputs and per-layer KV memory (several press
    values: every combination, one run each)."""
    if pool or shards is not None or shard_size is not None:
        return run_pool(input, task, model, db, data_path, pool, shards, shard_size, press, generation)
    configs, options = build(task, model, press, generation)
    check_environment()
    from flows.batch import FLOWS, BatchNotStored, budget_sweep
    from flows.deploy import config_settings
    from flows.local_server import local_api

    check_before_flow(input, model, db, options.wait, data_path, configs=configs)
    exit_on_sigterm()
    with user_errors(), local_api(), batch_progress(configs_bar=len(configs) > 1) as hooks:
        try:
            if len(configs) == 1:
                c = configs[0]
                summary = FLOWS[c.task](**config_settings(c, input, db, options), hooks=hooks)
            else:
                summary = budget_sweep(input=input, **press_grid(press), task=task, model=model, db=db,
                                       reference=False, evaluate=False, options=options, hooks=hooks)
        except BatchNotStored as exc:  # the flow run ended Failed (documents not stored): say what it did
            summary = exc.summary
    print_summary(summary, db)
    exit_unless_done(summary)


def check_fan_out(db: str, pool: Optional[str], shards: Optional[int], shard_size: Optional[int]) -> None:
    """The fan-out flags and store, before any model loads or server is asked."""
    from flows.shards import ShardError, require_lake, shard_counts

    if not pool:
        fail("--shards/--shard-size fan out over a work pool: give --pool NAME")
    try:
        require_lake(db)
        shard_counts(1, shards, shard_size)
    except ShardError as exc:
        fail(str(exc))


def run_pool(input, task, model, db, data_path, pool, shards, shard_size, press, generation) -> None:
    """``nkv run --pool``: shards of the batch as flow runs on a work pool, progress per shard, the merged
    summary from the store."""
    check_fan_out(db, pool, shards, shard_size)
    configs, options = build(task, model, press, generation)
    check_environment()
    from flows.deploy import ServerUnavailable
    from flows.shards import ShardError, fan_out

    if len(configs) != 1:
        fail("a fanned-out batch runs one press configuration: give one value per press option")
    check_before_flow(input, model, db, options.wait, data_path, load=False)  # creates the lake with its data path
    with user_errors(), progress_bars() as bars:
        bar = {}

        def on_progress(shard_list):
            for s in shard_list:
                if s.index not in bar:
                    bar[s.index] = bars.add_task("", total=len(s.docs))
                bars.update(bar[s.index], completed=s.done, description=markup_safe(f"{s.label} ({s.status()})"))

        try:
            result = fan_out(input, configs[0], db, pool, options, shards=shards, shard_size=shard_size,
                             data_path=data_path, on_progress=on_progress, log=lambda m: say(m, style="yellow"))
        except (ShardError, ServerUnavailable) as exc:
            fail(str(exc))
    import pyarrow as pa

    for err in result.input_errors:
        say(f"skipped row {err.row} ({err.doc_id or 'no doc_id'}) in {err.source}: {err.field}: {err.message}",
            style="yellow")
    say(f"{result.summary()} -> {db}")
    if result.savings:
        print_table(pa.Table.from_pylist(result.savings), title="memory savings")
    if result.n_documents == 0 or result.n_ok < result.n_documents:  # as exit_unless_done: none done is no success
        raise typer.Exit(1)


@app.command()
@press_options(press="nestedkv,keydiff", compression_ratio="0.5,0.75,0.9")
@generation_options()
def sweep(input: str = InputOpt, task: str = TaskOpt, model: str = ModelOpt, db: str = DbOpt,
          evaluate: bool = typer.Option(True, "--evaluate/--no-evaluate", help="score each configuration against no_press"),
          press: dict = None, generation: dict = None):
    """Compare presses and budgets: one prefill per document, one stored run per configuration plus no_press."""
    configs, options = build(task, model, press, generation)
    check_environment()
    from flows.batch import BatchNotStored, budget_sweep
    from flows.local_server import local_api

    check_before_flow(input, model, db, options.wait, configs=configs)
    exit_on_sigterm()
    say(f"{len(configs)} configurations + the no_press reference, one prefill per document")
    with user_errors(), local_api(), batch_progress(configs_bar=True) as hooks:
        try:
            summary = budget_sweep(input=input, **press_grid(press), task=task, model=model, db=db,
                                   evaluate=evaluate, options=options, hooks=hooks)
        except BatchNotStored as exc:  # the flow run ended Failed (documents not stored): say what it did
            summary = exc.summary
    print_summary(summary, db)
    exit_unless_done(summary)


@app.command()
@press_options()
@generation_options(exclude=("batch_decode",))
def serve(
    cron: str = typer.Option("0 2 * * *", "--cron", help="when to run, as a cron expression"),
    name: str = typer.Option("nightly", "--name", help="deployment name: <flow>/<name>"),
    input: str = InputOpt,
    task: str = typer.Option("summarize", "--task", help="summarize (flow summarize-batch) or qa (qa-batch)"),
    model: str = ModelOpt,
    db: str = DbOpt,
    data_path: Optional[str] = DataPathOpt,
    pool: Optional[str] = typer.Option(None, "--pool", help="register in this process work pool instead of "
                                       "serving here; run it with `prefect worker start --pool POOL --limit 1`"),
    shards: Optional[int] = typer.Option(None, "--shards", help="with --pool: serve a scheduled fan-out here that "
                                         "splits each run into this many shards on the pool"),
    shard_size: Optional[int] = typer.Option(None, "--shard-size", help="with --pool: documents per shard"),
    press: dict = None,
    generation: dict = None,
):
    """Serve the batch flow as a scheduled deployment (needs a Prefect server: `prefect server start`)."""
    from flows.deploy import ServerUnavailable, check_server, config_settings, deploy_batch, serve_batch
    from flows.sharded import serve_sharded

    configs, options = build(task, model, press, generation)
    if len(configs) != 1:
        fail("a deployment runs one press configuration: give one value per press option")
    if not pool:  # the runs start here and inherit the environment: a fault is said now, not in tomorrow's run
        check_environment(prefect=False)
    sharded = shards is not None or shard_size is not None
    if sharded:
        check_fan_out(db, pool, shards, shard_size)
    c = configs[0]
    params = dict(name=name, cron=cron, **config_settings(c, input, db, options))
    try:
        check_server()  # first: without a server nothing else matters
        if pool and data_path:  # create the lake with its data path
            from pipeline.store import Store

            with user_errors(), Store(db, data_path=data_path):
                pass
        if sharded:  # the fan-out reads the input here; the shards go beside the lake's data
            check_input_early(input)
            say(f"serving sharded-batch/{name} ({cron}): each run fans out over work pool {pool!r}; start one "
                f"worker per machine: prefect worker start --pool {pool} --limit 1")
            serve_sharded(c.task, pool=pool, shards=shards, shard_size=shard_size, data_path=data_path, **params)
        elif pool:  # the input lives where the workers run
            deployment_id = deploy_batch(c.task, pool=pool, **params)
            say(f"deployment {c.task}-batch/{name} ({deployment_id}) is in work pool {pool!r}; start one "
                f"worker per machine: prefect worker start --pool {pool} --limit 1")
        else:
            check_input_early(input)  # runs start here, so the input must be here
            serve_batch(c.task, **params)
    except ServerUnavailable as exc:
        fail(str(exc))


def check_environment(prefect: bool = True) -> None:
    """Environment faults, before any work: one line naming the variable and the fix. ``prefect``: the
    command runs a flow (Prefect's home must be writable, a configured server must answer)."""
    import os
    from pathlib import Path

    from pipeline.paths import unwritable

    tmp = os.environ.get("TMPDIR")
    if tmp is not None:  # mlx, DuckDB and Prefect's subprocesses take it as it is
        why = "it is empty" if not tmp else unwritable(tmp) or (None if Path(tmp).is_dir() else "no such folder")
        if why:
            fail(f"TMPDIR={tmp}: {why}; point TMPDIR at a writable folder or unset it")
    from pipeline.models import cache_dir_problem

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
    from prefect.settings import get_current_settings

    if get_current_settings().api.url:
        from flows.deploy import ServerUnavailable, check_server

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
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def check_input_early(input: str) -> None:
    """Fail on a missing or damaged input before a flow (and Prefect's temporary server) starts."""
    from pipeline.documents import check_input

    with user_errors():
        check_input(input, pages=True)


def check_before_flow(input: str, model: str, db: str, wait: float = 0.0, data_path: Optional[str] = None,
                      load: bool = True, configs=()) -> None:
    """What can be checked before a flow starts is checked here, so an expected error is one line and
    leaves nothing behind: the input's pages, the model (loaded: only loading finds missing weights or a
    damaged file; the flow reuses this process's copy), and that the store opens for writing.
    ``load=False`` (a fan-out, whose workers load the model): the reference is only resolved."""
    from pipeline.models import check_reference, load_model
    from pipeline.store import Store

    check_input_early(input)
    with user_errors():
        loaded = (load_model if load else check_reference)(model)  # a bad reference fails before any loading
        if load:
            check_kv_group_size(loaded[0], configs)
        with Store(db, wait_s=wait, data_path=data_path, on_wait=lambda waited, total: say(
                f"{db} is held by another writer; waited {waited:.0f} of {total:.0f} s", style="yellow")):
            pass


def check_kv_group_size(model, configs) -> None:
    """A quantization group that does not divide the model's head dimension: one line, before any prefill."""
    from nestedkv.cache import check_group_size

    for size in sorted({c.kv_group_size for c in configs if c.kv_bits is not None}):
        try:
            check_group_size(model, size)
        except ValueError as exc:
            fail(f"--kv-group-size: {exc}")


def run_query(store, sql: str, fmt: str, timeout: float) -> None:
    """Write the query's batches here as they come (``flows.query``); Ctrl-C or ``timeout`` stop it. A table
    shows the first rows only, and then the query is stopped as well."""
    from flows.output import TABLE_ROWS
    from flows.query import QueryStopped, background_query

    try:
        with background_query(store, sql, timeout) as (schema, batches):
            if print_result(schema, batches, fmt):
                say(f"showing the first {TABLE_ROWS} rows; --format csv or json writes every row", style="yellow")
    except KeyboardInterrupt:
        fail("query interrupted (Ctrl-C)", 130)
    except QueryStopped as exc:
        fail(str(exc), 1)
    except BrokenPipeError:  # the reader went away (| head): stop quietly
        raise typer.Exit(0)


@app.command()
def query(
    sql: str = typer.Argument(..., help="SQL to run read-only"),
    db: str = DbOpt,
    format: str = typer.Option("table", "--format", help="table, csv or json"),
    timeout: float = typer.Option(QUERY_TIMEOUT_S, "--timeout", help="seconds the query may wait on the database "
                                  "before it is stopped (0: no limit); Ctrl-C stops it at once"),
):
    """Run a read-only SQL query against the store (results are written as they are read)."""
    import math

    from pipeline.store import Store

    if format not in ("table", "csv", "json"):
        fail(f"--format must be table, csv or json, got {format!r}")
    if not (math.isfinite(timeout) and timeout >= 0):
        fail(f"--timeout must be a number of seconds >= 0 (0: no limit), got {timeout!r}")
    from pipeline import store as store_mod

    # A batch writing the store holds it only while it stores a document: wait that out.
    with user_errors(), Store(db, read_only=True, wait_s=store_mod.READER_WAIT_S) as store:
        run_query(store, sql, format, timeout)


@app.command("eval")
@press_options(press="nestedkv,keydiff,knorm,streaming_llm,random", compression_ratio="0.5,0.75,0.9")
@generation_options(max_new_tokens=24, batch_decode=True)
def eval_(
    input: str = typer.Option("data/eval_set.parquet", "--input", help="Parquet file, glob or folder (with questions)"),
    model: str = ModelOpt,
    db: str = typer.Option("eval.duckdb", "--db", help="DuckDB file"),
    metric: Optional[list[str]] = typer.Option(None, "--metric", help="extra metric, repeatable: gold_kept"),
    press: dict = None,
    generation: dict = None,
):
    """Answer quality against the uncompressed model: per document one prefill, then every configuration
    (and no_press) answers every question; metrics go to the evaluations table and quality_vs_full."""
    from pipeline.engine import EngineOptions, run as run_engine

    configs, options = build("qa", model, press, generation)
    try:
        engine_options = EngineOptions.for_batch(options, evaluate=True, metrics=tuple(metric or ()))
    except ValueError as exc:
        invalid(exc)
    check_environment(prefect=False)
    check_before_flow(input, model, db, options.wait, configs=configs)
    exit_on_sigterm()  # a terminated eval closes its runs as failed (resume picks up where it stopped)
    say(f"{len(configs)} configurations + the no_press reference, one prefill per document")
    with user_errors(), batch_progress(configs_bar=True) as hooks:
        summary = run_engine(input, configs, db, engine_options, hooks=hooks, wait_s=options.wait)
    print_summary(summary, db)
    say(f"{summary.wall_s:.0f} s; `nkv report --db {db}` for the table and plot")
    exit_unless_done(summary)


@app.command()
def report(
    db: str = typer.Option("eval.duckdb", "--db", help="DuckDB file written by `nkv eval`"),
    out: str = typer.Option("reports", "--out", help="folder for report.md and quality_vs_ratio.png"),
):
    """Quality against compression: a table per (method, head budget, ratio) and a plot."""
    from pipeline.report import write_report

    with user_errors():
        rep = write_report(db, out)
    print_table(rep.table, title="quality against the uncompressed reference")
    say(f"wrote {rep.markdown_path} and {rep.plot_path}")


@app.command()
def suite(
    size: str = typer.Option("standard", "--size", help="quick (1k, 1 per task), small (2k, 2), standard (2k/4k/8k, 2)"),
    lengths: Optional[str] = typer.Option(None, "--lengths", help="target context tokens, e.g. 2048,4096 (overrides "
                                          "the size's)"),
    per_task: Optional[int] = typer.Option(None, "--per-task", help="documents per task and length"),
    tasks: Optional[str] = typer.Option(None, "--tasks", help="comma-separated subset of the tasks (default: all)"),
    seed: int = typer.Option(0, "--seed"),
    model: str = ModelOpt,
    db: str = typer.Option("suite.duckdb", "--db", help="DuckDB file"),
    out: str = typer.Option("reports/suite", "--out", help="folder for suite.parquet, suite_report.md, frontier.png"),
    press: str = typer.Option("nestedkv,keydiff,knorm,streaming_llm,random", "--press", help="methods ('' = "
                              "calibration only)"),
    compression_ratio: str = typer.Option("0.5,0.75,0.9", "--compression-ratio"),
    head_budget: str = typer.Option("uniform,adaptive", "--head-budget"),
    prefill: str = typer.Option("whole", "--prefill", help="whole and/or streaming (streaming prefills per "
                                "configuration)"),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens"),
    threshold: float = typer.Option(0.6, "--threshold", help="least uncompressed accuracy for a task x length "
                                    "cell to enter the headline"),
    all_tasks: bool = typer.Option(False, "--all-tasks", help="run the methods on cells below the threshold too"),
    ablation: bool = typer.Option(True, "--ablation/--no-ablation", help="NestedKV's per-scale variants on the "
                                  "long documents"),
    variants: Optional[str] = typer.Option(None, "--variants", help="comma-separated subset of those variants "
                                           "(default: all, e.g. 'block only,window only post-RoPE')"),
    summaries: int = typer.Option(0, "--summaries", help="plain documents per long length whose compressed "
                                  "summaries are compared with the uncompressed one"),
    long_from: int = typer.Option(4096, "--long-from", help="documents of at least this many tokens make the "
                                  "headline, the ablation and the summaries"),
):
    """The synthetic long-context suite (RULER-style tasks on Austen's prose): generate, calibrate on the
    uncompressed model, run the methods, report per task and the quality-memory frontier."""
    from pipeline import suite as suite_mod
    from pipeline.tasks import TASKS

    try:
        opts = suite_mod.SuiteOptions(
            model=model, db=db, out=out, size=size, per_task=per_task, seed=seed,
            lengths=tuple(split_list(lengths, int, "--lengths")) or None,
            tasks=tuple(split_list(tasks, str, "--tasks")) or TASKS,
            presses=tuple(split_list(press, str, "--press")),
            ratios=tuple(split_list(compression_ratio, float, "--compression-ratio")),
            head_budgets=tuple(split_list(head_budget, str, "--head-budget")),
            prefills=tuple(split_list(prefill, str, "--prefill")), max_new_tokens=max_new_tokens,
            threshold=threshold, all_tasks=all_tasks, ablation=ablation,
            variants=tuple(split_list(variants, str, "--variants")) if variants else None, summaries=summaries,
            long_from=long_from)
        opts.configs()  # validate the press options before any work
    except ValueError as exc:
        invalid(exc)
    with user_errors(), batch_progress(configs_bar=True) as hooks:
        res = suite_mod.run_suite(opts, hooks=hooks, log=say)
    out_console.print(res.markdown_path.read_text(encoding="utf-8"), markup=False, highlight=False)
    say(f"wrote {res.markdown_path}" + (f" and {res.plot_path}" if res.plot_path else ""))


@app.command()
def models():
    """List the built-in and the converted (cached) models."""
    from pipeline.models import list_models

    rows = list_models()
    out = Table(title="models")
    keys = sorted({k for r in rows for k in r})
    for k in keys:
        out.add_column(k, overflow="fold")
    for r in rows:
        out.add_row(*(Text(plain(r.get(k, ""))) for k in keys))
    out_console.print(out)


@app.command()
def bench(
    what: str = typer.Argument("kernels", help="kernels (scoring, compression, decode, GEMM), memory (peak KV at "
                               "growing lengths), throughput (documents per hour, batched, prefill cache), rope "
                               "(how much each NestedKV scale's ranking is position, on --context tokens), or peer "
                               "(side by side with kvpress; python -m pipeline.bench_peer --help for its options)"),
    model: str = ModelOpt,
    context: int = typer.Option(4096, "--context", help="kernels and rope: context tokens"),
    new_tokens: int = typer.Option(32, "--new-tokens", help="tokens decoded per measurement"),
    lengths: str = typer.Option("1024,2048,4096,8192", "--lengths", help="memory: context lengths"),
    budget: int = typer.Option(512, "--budget", help="memory: tokens kept per head"),
    compression_ratio: float = typer.Option(0.75, "--compression-ratio", help="memory, throughput and peer"),
    input: str = typer.Option(DEFAULT_INPUT, "--input", help="throughput: the batch"),
    batch_size: int = typer.Option(5, "--batch-size", help="throughput: documents decoded together"),
    out: Optional[str] = typer.Option(None, "--out", help="also write the figures (JSON; memory: a folder with "
                                      "a table and a PNG plot)"),
):
    """Benchmarks: kernels (default), memory, throughput, rope, peer."""
    with user_errors():
        if what == "kernels":
            from nestedkv import bench as nbench
            from pipeline.models import model_dir

            args = ["--model", str(model_dir(model)), "--context", str(context), "--new-tokens", str(new_tokens)]
            nbench.main(args + (["--out", out] if out else []))
        elif what == "memory":
            from pipeline import bench_memory
            from pipeline.config import INT32_MAX

            sizes = split_list(lengths, int, "--lengths")
            if not sizes or not all(1 <= n <= INT32_MAX for n in sizes):
                fail(f"--lengths: context lengths must be whole numbers of tokens in 1..{INT32_MAX}, got {lengths!r}")
            bench_memory.main(model, sizes, budget, compression_ratio, 512, new_tokens, out or "reports/memory")
        elif what == "throughput":
            from pipeline import bench_throughput

            bench_throughput.main(["--input", input, "--model", model, "--batch-size", str(batch_size),
                                   "--compression-ratio", str(compression_ratio)] + (["--out", out] if out else []))
        elif what == "rope":
            from pathlib import Path

            from pipeline import bench_rope

            res = bench_rope.run(model, context, log=lambda m: out_console.print(m, markup=False, highlight=False))
            if out:
                Path(out).write_text(json.dumps(res, indent=1))
        elif what == "peer":
            from pipeline import bench_peer

            bench_peer.main(["--model", model, "--compression-ratio", str(compression_ratio)]
                            + (["--out", out] if out else []))
        else:
            fail(f"nkv bench: unknown benchmark {what!r}; choose kernels, memory, throughput, rope or peer")


def main() -> None:
    # No command has loaded mlx yet (this module does not import it): mlx binds its BLAS when it loads.
    nestedkv.enable_cpu_fast_path()
    app()


if __name__ == "__main__":
    main()
