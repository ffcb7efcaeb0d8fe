"""The ``nkv`` command line."""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import pipeline  # noqa: F401  (loads OpenBLAS before mlx)
from pipeline.config import DEFAULT_MODEL, QA_INSTRUCTION, SUMMARY_INSTRUCTION, RunConfig

app = typer.Typer(add_completion=False, no_args_is_help=True, help="NestedKV batch pipeline for long documents.")
console = Console(stderr=True)
# Tables go to stdout; piped output gets a wide console instead of rich's 80-column default.
out_console = Console(width=None if sys.stdout.isatty() else 160)
SAVINGS_COLUMNS = "run_id, press, compression_ratio, head_budget, budget, n_documents, kept_share, saved_share, saved_mib"
DEFAULT_DB = "runs.duckdb"

# kvpress users' spellings work beside ours.
PressOpt = typer.Option("nestedkv", "--press", "--press-name", help="nestedkv, keydiff, knorm, streaming_llm, random, no_press")
RatioOpt = typer.Option(0.75, "--compression-ratio", "--compression_ratio", help="fraction of context KV entries removed, in [0, 1)")
BudgetOpt = typer.Option(None, "--budget", help="absolute tokens kept per KV head (wins over the ratio)")
HeadBudgetOpt = typer.Option("uniform", "--head-budget", "--head_budget", help="uniform or adaptive")
ModelOpt = typer.Option(DEFAULT_MODEL, "--model", help="smollm2-135m, an mlx-lm directory, a .gguf file or a HF repo id")
DbOpt = typer.Option(DEFAULT_DB, "--db", help="DuckDB file")


def fail(message: str, code: int = 2) -> None:
    # soft_wrap: one line even when stderr is not a terminal (rich would wrap at 80 columns).
    console.print(f"[red]error:[/red] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


@contextmanager
def user_errors():
    """Bad input, a held database or an unloadable model end the command with one line, exit 2."""
    from pipeline.documents import InputError
    from pipeline.models import ModelLoadError
    from pipeline.store import StoreError

    try:
        yield
    except (InputError, StoreError, ModelLoadError) as exc:
        fail(str(exc))


def make_config(**kw) -> RunConfig:
    from pydantic import ValidationError

    try:
        return RunConfig(**kw)
    except ValidationError as exc:
        msgs = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}" for e in exc.errors())
        fail(f"invalid options: {msgs}")


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
    rows = table.to_pylist()
    if fmt == "json":
        sys.stdout.write(json.dumps(rows, default=str, indent=2) + "\n")
        return
    if fmt == "csv":
        import pyarrow.csv as pacsv

        pacsv.write_csv(table, sys.stdout.buffer)
        return
    out = Table(title=title, show_lines=False)
    cells = [["" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v) for v in r.values()] for r in rows]
    for i, name in enumerate(table.column_names):
        # Short columns (ids, numbers) never wrap; long text folds.
        widest = max([len(name)] + [len(c[i]) for c in cells])
        out.add_column(name, overflow="fold", min_width=min(widest, 28))
    for c in cells:
        out.add_row(*c)
    out_console.print(out)


@app.command()
def run(
    input: str = typer.Option("data/sample_batch.parquet", "--input", help="Parquet file, glob or folder"),
    task: str = typer.Option("summarize", "--task", help="summarize or qa"),
    press: str = PressOpt,
    compression_ratio: float = RatioOpt,
    budget: Optional[int] = BudgetOpt,
    head_budget: str = HeadBudgetOpt,
    model: str = ModelOpt,
    db: str = DbOpt,
    max_new_tokens: int = typer.Option(128, "--max-new-tokens"),
    prefill_step_size: int = typer.Option(512, "--prefill-step-size"),
    truncate: bool = typer.Option(False, "--truncate", help="cut the middle of documents longer than the model window"),
    summary_instruction: str = typer.Option(SUMMARY_INSTRUCTION, "--summary-instruction"),
    qa_instruction: str = typer.Option(QA_INSTRUCTION, "--qa-instruction", help="must contain {question}"),
    repetition_penalty: Optional[float] = typer.Option(
        None, "--repetition-penalty", help="default 1.1 for summaries, none for qa; 1.0 disables"),
    retries: int = typer.Option(2, "--retries", help="task retries for transient errors"),
):
    """Run a batch of documents through the Prefect flow and store outputs and per-layer KV memory."""
    from flows.batch import FLOWS, BatchOptions, reporting

    generation = dict(max_new_tokens=max_new_tokens, prefill_step_size=prefill_step_size, truncate=truncate,
                      summary_instruction=summary_instruction, qa_instruction=qa_instruction,
                      repetition_penalty=repetition_penalty)
    config = make_config(task=task, model=model, press=press, compression_ratio=compression_ratio, budget=budget,
                         head_budget=head_budget, **generation)
    check_input_early(input)
    exit_on_sigterm()
    options = BatchOptions(**generation, retries=retries)
    with user_errors(), progress_bars() as bars:
        docs_bar = bars.add_task("documents", total=None)
        chunk_bar = bars.add_task("prefill", total=None)

        def on_prefill(done, total):
            bars.update(chunk_bar, completed=done, total=total)

        def on_document(i, n, res):
            bars.update(docs_bar, completed=i, total=n, description=f"documents ({res.doc_id}: {res.status})")

        with reporting(on_start=lambda n: bars.update(docs_bar, total=n), on_document=on_document,
                       on_prefill=on_prefill):
            summary = FLOWS[config.task](
                input=input, press=config.press, compression_ratio=config.compression_ratio, budget=config.budget,
                head_budget=config.head_budget, model=config.model, db=db, options=options,
            )
    for err in summary.input_errors:
        console.print(f"[yellow]skipped row {err.row} ({err.doc_id or 'no doc_id'}) in {err.source}: {err.field}: {err.message}")
    console.print(
        f"run {summary.run_id}: {summary.n_done} done, {summary.n_failed} failed, {summary.n_skipped} already done, "
        f"{len(summary.input_errors)} bad rows -> {db}"
    )
    with user_errors():
        from pipeline.store import Store

        with Store(db, read_only=True) as store:
            print_table(store.query(f"SELECT {SAVINGS_COLUMNS} FROM memory_savings WHERE run_id = ?", [summary.run_id]),
                        title="memory savings")


def exit_on_sigterm() -> None:
    """A terminated flow run still stops Prefect's temporary server (its atexit hook), instead of orphaning it."""
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def check_input_early(input: str) -> None:
    """Fail on a missing or unreadable input before a flow (and Prefect's temporary server) starts."""
    from pipeline.documents import check_input

    with user_errors():
        check_input(input)


def split_list(value: str, cast, flag: str) -> list:
    try:
        return [cast(v.strip()) for v in value.split(",") if v.strip()]
    except ValueError:
        fail(f"{flag}: expected a comma-separated list, got {value!r}")


@app.command()
def sweep(
    input: str = typer.Option("data/sample_batch.parquet", "--input", help="Parquet file, glob or folder"),
    task: str = typer.Option("summarize", "--task", help="summarize or qa"),
    press: str = typer.Option("nestedkv,keydiff", "--press", "--press-name", help="comma-separated presses"),
    compression_ratio: str = typer.Option("0.5,0.75,0.9", "--compression-ratio", "--compression_ratio",
                                          help="comma-separated fractions removed"),
    budget: Optional[str] = typer.Option(None, "--budget", help="comma-separated tokens per head (replaces ratios)"),
    head_budget: str = typer.Option("uniform", "--head-budget", "--head_budget", help="uniform,adaptive"),
    model: str = ModelOpt,
    db: str = DbOpt,
    max_new_tokens: int = typer.Option(128, "--max-new-tokens"),
    prefill_step_size: int = typer.Option(512, "--prefill-step-size"),
    truncate: bool = typer.Option(False, "--truncate", help="cut the middle of documents longer than the model window"),
    summary_instruction: str = typer.Option(SUMMARY_INSTRUCTION, "--summary-instruction"),
    qa_instruction: str = typer.Option(QA_INSTRUCTION, "--qa-instruction", help="must contain {question}"),
    repetition_penalty: Optional[float] = typer.Option(
        None, "--repetition-penalty", help="default 1.1 for summaries, none for qa; 1.0 disables"),
    retries: int = typer.Option(2, "--retries", help="task retries for transient errors"),
    evaluate: bool = typer.Option(True, "--evaluate/--no-evaluate", help="score each configuration against no_press"),
):
    """Compare presses and budgets: one prefill per document, one stored run per configuration plus no_press."""
    from pydantic import ValidationError

    from flows.batch import BatchOptions, reporting
    from flows.sweep import budget_sweep, configs_for, summary_run_ids

    presses = split_list(press, str, "--press")
    ratios = split_list(compression_ratio, float, "--compression-ratio")
    budgets = split_list(budget, int, "--budget") if budget else None
    modes = split_list(head_budget, str, "--head-budget")
    generation = dict(max_new_tokens=max_new_tokens, prefill_step_size=prefill_step_size, truncate=truncate,
                      summary_instruction=summary_instruction, qa_instruction=qa_instruction,
                      repetition_penalty=repetition_penalty)
    make_config(task=task, model=model, **generation)
    options = BatchOptions(**generation, retries=retries)
    try:
        configs = configs_for(task, model, presses, ratios, modes, budgets, options)
    except ValidationError as exc:
        fail("invalid options: " + "; ".join(f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}"
                                             for e in exc.errors()))
    except ValueError as exc:
        fail(str(exc))
    check_input_early(input)
    exit_on_sigterm()
    console.print(f"{len(configs) - 1} configurations + the no_press reference, one prefill per document")
    with user_errors(), progress_bars() as bars:
        docs_bar = bars.add_task("documents", total=None)
        chunk_bar = bars.add_task("prefill", total=None)
        with reporting(on_start=lambda n: bars.update(docs_bar, total=n),
                       on_document=lambda i, n, doc, stored: bars.update(docs_bar, completed=i, total=n,
                                                                         description=f"documents ({doc.doc_id})"),
                       on_prefill=lambda done, total: bars.update(chunk_bar, completed=done, total=total)):
            summary = budget_sweep(input=input, presses=presses, compression_ratios=ratios, head_budgets=modes,
                                   budgets=budgets, task=task, model=model, db=db, evaluate=evaluate,
                                   options=options)
    console.print(
        f"{len(summary.runs)} runs, {summary.n_swept} documents prefilled once, {summary.n_results} results "
        f"({summary.n_failed} failed), {summary.n_documents - summary.n_swept} already done -> {db}"
    )
    run_ids = summary_run_ids(summary)
    if run_ids:
        with user_errors():
            from pipeline.store import Store

            with Store(db, read_only=True) as store:
                print_table(store.query(
                    f"SELECT {SAVINGS_COLUMNS} FROM memory_savings WHERE run_id IN (SELECT unnest(?)) "
                    "ORDER BY press, compression_ratio, head_budget", [run_ids]), title="memory savings")


@app.command()
def serve(
    cron: str = typer.Option("0 2 * * *", "--cron", help="when to run, as a cron expression"),
    name: str = typer.Option("nightly", "--name", help="deployment name: <flow>/<name>"),
    input: str = typer.Option("data/sample_batch.parquet", "--input", help="Parquet file, glob or folder"),
    task: str = typer.Option("summarize", "--task", help="summarize (flow summarize-batch) or qa (qa-batch)"),
    press: str = PressOpt,
    compression_ratio: float = RatioOpt,
    budget: Optional[int] = BudgetOpt,
    head_budget: str = HeadBudgetOpt,
    model: str = ModelOpt,
    db: str = DbOpt,
    max_new_tokens: int = typer.Option(128, "--max-new-tokens"),
    prefill_step_size: int = typer.Option(512, "--prefill-step-size"),
    truncate: bool = typer.Option(False, "--truncate"),
    retries: int = typer.Option(2, "--retries", help="task retries for transient errors"),
    pool: Optional[str] = typer.Option(None, "--pool", help="register in this process work pool instead of "
                                       "serving here; run it with `prefect worker start --pool POOL --limit 1`"),
):
    """Serve the batch flow as a scheduled deployment (needs a Prefect server: `prefect server start`)."""
    from flows.batch import BatchOptions
    from flows.deploy import ServerUnavailable, check_server, deploy_batch, serve_batch

    config = make_config(task=task, model=model, press=press, compression_ratio=compression_ratio, budget=budget,
                         head_budget=head_budget, max_new_tokens=max_new_tokens, prefill_step_size=prefill_step_size,
                         truncate=truncate)
    options = BatchOptions(max_new_tokens=max_new_tokens, prefill_step_size=prefill_step_size, truncate=truncate,
                           retries=retries)
    params = dict(name=name, cron=cron, input=input, press=config.press, compression_ratio=config.compression_ratio,
                  budget=config.budget, head_budget=config.head_budget, model=config.model, db=db, options=options)
    try:
        check_server()  # first: without a server nothing else matters
        if pool:
            deployment_id = deploy_batch(config.task, pool=pool, **params)
            flow_name = f"{config.task}-batch"
            console.print(f"deployment {flow_name}/{name} ({deployment_id}) is in work pool {pool!r}; start one "
                          f"worker per machine: prefect worker start --pool {pool} --limit 1", soft_wrap=True)
        else:
            check_input_early(input)  # runs start here, so the input must be here
            serve_batch(config.task, **params)
    except ServerUnavailable as exc:
        fail(str(exc))


@app.command()
def query(
    sql: str = typer.Argument(..., help="SQL to run read-only"),
    db: str = DbOpt,
    format: str = typer.Option("table", "--format", help="table, csv or json"),
):
    """Run a read-only SQL query against the store."""
    from pipeline.store import Store

    if format not in ("table", "csv", "json"):
        fail(f"--format must be table, csv or json, got {format!r}")
    with user_errors(), Store(db, read_only=True) as store:
        print_table(store.query(sql), format)


@app.command("eval")
def eval_(
    input: str = typer.Option("data/eval_set.parquet", "--input", help="Parquet file, glob or folder (with questions)"),
    press: str = typer.Option("nestedkv,keydiff,knorm,streaming_llm,random", "--press", "--press-name",
                              help="comma-separated presses"),
    compression_ratio: str = typer.Option("0.5,0.75,0.9", "--compression-ratio", "--compression_ratio",
                                          help="comma-separated fractions removed"),
    head_budget: str = typer.Option("uniform", "--head-budget", "--head_budget",
                                    help="uniform,adaptive: multiplies the nestedkv configurations only"),
    model: str = ModelOpt,
    db: str = typer.Option("eval.duckdb", "--db", help="DuckDB file"),
    max_new_tokens: int = typer.Option(24, "--max-new-tokens"),
    prefill_step_size: int = typer.Option(512, "--prefill-step-size"),
    batch_decode: bool = typer.Option(True, "--batch-decode/--no-batch-decode",
                                      help="decode all configurations of a question as one batch (faster on CPU)"),
):
    """Answer quality against the uncompressed model: per document one prefill, then every configuration
    (and no_press) answers every question; metrics go to the evaluations table and quality_vs_full."""
    from pipeline.sweep import run_sweep, sweep_configs

    presses = split_list(press, str, "--press")
    ratios = split_list(compression_ratio, float, "--compression-ratio")
    modes = split_list(head_budget, str, "--head-budget")
    base = make_config(task="qa", model=model, press="no_press", compression_ratio=0.0,
                       max_new_tokens=max_new_tokens, prefill_step_size=prefill_step_size)
    try:
        configs = sweep_configs(base, presses, ratios, modes)
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        fail(f"invalid options: {exc}")
    check_input_early(input)
    exit_on_sigterm()  # a terminated eval closes its runs as failed (resume picks up where it stopped)
    console.print(f"{len(configs) - 1} configurations + the no_press reference, one prefill per document")
    with user_errors(), progress_bars() as bars:
        docs_bar = bars.add_task("documents", total=None)
        cfg_bar = bars.add_task("configurations", total=None)
        chunk_bar = bars.add_task("prefill", total=None)

        def on_start(plan):
            bars.update(docs_bar, total=len(plan.todo_docs))

        def on_config(i, n, cfg, res):
            label = cfg.press if cfg.press == "no_press" else f"{cfg.press} r={cfg.compression_ratio:g} {cfg.head_budget}"
            bars.update(cfg_bar, completed=i, total=n, description=f"configurations ({label}: {res.status})")

        def on_document(i, n, doc, items):
            bars.update(docs_bar, completed=i, total=n, description=f"documents ({doc.doc_id})")

        summary = run_sweep(input, configs, db, evaluate=True, batch_decode=batch_decode, on_start=on_start,
                            on_document=on_document, on_config=on_config,
                            on_prefill=lambda d, t: bars.update(chunk_bar, completed=d, total=t))
    for err in summary.input_errors:
        console.print(f"[yellow]skipped row {err.row} ({err.doc_id or 'no doc_id'}) in {err.source}: {err.field}: {err.message}")
    console.print(
        f"{len(summary.runs)} runs started, {summary.n_swept} documents prefilled once each, {summary.n_results} "
        f"results ({summary.n_failed} failed), {summary.n_documents - summary.n_swept} already done, "
        f"{summary.wall_s:.0f} s -> {db}; `nkv report --db {db}` for the table and plot"
    )


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
    console.print(f"wrote {rep.markdown_path} and {rep.plot_path}")


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
        out.add_row(*(str(r.get(k, "")) for k in keys))
    out_console.print(out)


@app.command()
def bench(
    model: str = ModelOpt,
    context: int = typer.Option(4096, "--context"),
    new_tokens: int = typer.Option(32, "--new-tokens"),
    out: Optional[str] = typer.Option(None, "--out", help="also write the figures as JSON"),
):
    """Benchmark scoring, compression and decode speed, and memory kept per layer."""
    from nestedkv import bench as nbench
    from pipeline.models import model_dir

    with user_errors():
        path = model_dir(model)
    args = ["--model", str(path), "--context", str(context), "--new-tokens", str(new_tokens)]
    nbench.main(args + (["--out", out] if out else []))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
