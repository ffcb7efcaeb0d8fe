"""``nkv run``, ``sweep``, ``eval`` and ``serve``: a batch spec from the options, checked before any work,
then through the flows (``eval``: the engine alone)."""

from __future__ import annotations

from typing import Optional

import typer

from flows import local_server
from flows.batch import BatchNotStored, run_spec
from flows.cli.app import command, group
from flows.cli.checks import check_before_flow, check_environment, check_input_early, exit_on_sigterm
from flows.cli.common import (DataPathOpt, DbOpt, InputOpt, ModelOpt, TaskOpt, fail, markup_safe, progress_bars, say,
                              spec_option, user_errors)
from flows.cli.spec import (batch_progress, build, compared_by_default, exit_unless_done, print_input_errors,
                            print_quality, print_savings, print_summary)
from flows.deploy import ServerUnavailable, check_server, deploy_batch, serve_batch
from flows.options import generation_options, press_options
from flows.params import SWEEP
from flows.sharded import serve_sharded
from flows.shards import ShardError, fan_out, require_lake, shard_counts
from pipeline import engine
from pipeline.config import EVAL_DB, EVAL_INPUT
from pipeline.store import Store

cli = group()


_SWEPT = {"press": ",".join(SWEEP.defaults["presses"]),  # the budget-sweep flow's defaults, as CLI lists
          "compression_ratio": ",".join(map(str, SWEEP.defaults["compression_ratios"]))}

@command(cli, "run")
@press_options()
@generation_options()
def run(input: str = InputOpt, task: str = TaskOpt, model: str = ModelOpt, db: str = DbOpt,
        data_path: Optional[str] = DataPathOpt,
        pool: Optional[str] = typer.Option(None, "--pool", help="fan out over this process work pool (needs a lake "
                                           "--db); workers: prefect worker start --pool POOL --limit 1"),
        shards: Optional[int] = typer.Option(None, "--shards", help="with --pool: this many shards"),
        shard_size: Optional[int] = typer.Option(None, "--shard-size", help="with --pool: documents per shard"),
        compare_full: bool = typer.Option(False, "--compare-full", help="also run each document uncompressed "
                                          "(no_press) and score every run against it: delta NLL and ROUGE-L of "
                                          "its summary or answers (one more prefill and answer per document)"),
        press: dict = None, generation: dict = None):
    if pool or shards is not None or shard_size is not None:
        check_fan_out(db, pool, shards, shard_size)
        return run_pool(build(press, generation, input=input, task=task, model=model, db=db), data_path, pool,
                        shards, shard_size)
    spec = build(press, generation, input=input, task=task, model=model, db=db,
                 **({"reference": True, "evaluate": True} if compare_full else {}))
    check_environment()
    spec = check_before_flow(spec, data_path)
    exit_on_sigterm()
    with user_errors(), local_server.local_api(), batch_progress(configs_bar=len(spec.configs()) > 1) as hooks:
        summary = _run_spec(spec, hooks)
    print_summary(summary, db)
    if compare_full:
        print_quality(summary, db)
    exit_unless_done(summary)


def _run_spec(spec, hooks):
    try:
        return run_spec(spec, hooks)
    except BatchNotStored as exc:  # the flow run ended Failed (documents not stored): say what it did
        return exc.summary


def check_fan_out(db: str, pool: Optional[str], shards: Optional[int], shard_size: Optional[int]) -> None:
    """The fan-out flags and store, before any model loads or server is asked."""
    if not pool:
        fail("--shards/--shard-size fan out over a work pool: give --pool NAME")
    try:
        require_lake(db)
        shard_counts(1, shards, shard_size)
    except ShardError as exc:
        fail(str(exc))


def run_pool(spec, data_path, pool, shards, shard_size) -> None:
    """``nkv run --pool``: shards of the batch as flow runs on a work pool, progress per shard, the merged
    summary from the store."""
    check_environment()
    if len(spec.configs()) != 1:
        fail("a fanned-out batch runs one press configuration: give one value per press option")
    check_before_flow(spec, data_path, load=False)  # creates the lake with its data path
    with user_errors(), progress_bars() as bars:
        bar = {}

        def on_progress(shard_list):
            for s in shard_list:
                if s.index not in bar:
                    bar[s.index] = bars.add_task("", total=len(s.docs))
                bars.update(bar[s.index], completed=s.done, description=markup_safe(f"{s.label} ({s.status()})"))

        try:
            result = fan_out(spec, pool, shards=shards, shard_size=shard_size, data_path=data_path,
                             on_progress=on_progress, log=lambda m: say(m, style="yellow"))
        except (ShardError, ServerUnavailable) as exc:
            fail(str(exc))
    print_input_errors(result.input_errors)
    say(f"{result.summary()} -> {spec.db}")
    print_savings(result.savings)
    if result.n_documents == 0 or result.n_ok < result.n_documents:  # as exit_unless_done: none done is no success
        raise typer.Exit(1)


@command(cli, "sweep")
@press_options(**_SWEPT)
@generation_options()
def sweep(input: str = InputOpt, task: str = TaskOpt, model: str = ModelOpt, db: str = DbOpt,
          evaluate: bool = typer.Option(SWEEP.defaults["evaluate"], "--evaluate/--no-evaluate",
                                        help="score each configuration against no_press"),
          press: dict = None, generation: dict = None):
    spec = build(press, generation, input=input, task=task, model=model, db=db, reference=True, evaluate=evaluate)
    check_environment()
    spec = check_before_flow(spec, defaulted=press["press"] == _SWEPT["press"])
    exit_on_sigterm()
    say(f"{len(spec.configs())} configurations + the no_press reference, one prefill per document")
    with user_errors(), local_server.local_api(), batch_progress(configs_bar=True) as hooks:
        summary = _run_spec(spec, hooks)
    print_summary(summary, db)
    exit_unless_done(summary)


@command(cli, "serve")
@press_options()
@generation_options(exclude=("batch_decode",))
def serve(
    cron: str = typer.Option("0 2 * * *", "--cron", help="when to run, as a cron expression"),
    name: str = typer.Option("nightly", "--name", help="deployment name: <flow>/<name>"),
    input: str = InputOpt,
    task: str = spec_option("task", help="summarize (flow summarize-batch) or qa (qa-batch)"),
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
    spec = build(press, generation, input=input, task=task, model=model, db=db)
    if len(spec.configs()) != 1:
        fail("a deployment runs one press configuration: give one value per press option")
    if not pool:  # the runs start here and inherit the environment: a fault is said now, not in tomorrow's run
        check_environment(prefect=False)
    sharded = shards is not None or shard_size is not None
    if sharded:
        check_fan_out(db, pool, shards, shard_size)
    task = spec.task
    try:
        check_server()  # first: without a server nothing else matters
        if pool and data_path:  # create the lake with its data path
            with user_errors(), Store(db, data_path=data_path):
                pass
        if sharded:  # the fan-out reads the input here; the shards go beside the lake's data
            check_input_early(input)
            say(f"serving sharded-batch/{name} ({cron}): each run fans out over work pool {pool!r}; start one "
                f"worker per machine: prefect worker start --pool {pool} --limit 1")
            serve_sharded(spec, pool=pool, shards=shards, shard_size=shard_size, data_path=data_path, name=name,
                          cron=cron)
        elif pool:  # the input lives where the workers run
            deployment_id = deploy_batch(spec, pool=pool, name=name, cron=cron)
            say(f"deployment {task}-batch/{name} ({deployment_id}) is in work pool {pool!r}; start one "
                f"worker per machine: prefect worker start --pool {pool} --limit 1")
        else:
            check_input_early(input)  # runs start here, so the input must be here
            serve_batch(spec, name=name, cron=cron)
    except ServerUnavailable as exc:
        fail(str(exc))


@command(cli, "eval")
@press_options(press=None, compression_ratio=_SWEPT["compression_ratio"])  # no --press: every compared press of the registry
@generation_options(max_new_tokens=24, batch_decode=True)
def eval_(
    input: str = spec_option("input", EVAL_INPUT, "Parquet file, glob or folder (with questions for qa)"),
    task: str = spec_option("task", "qa", "qa (answers, scored against gold and no_press) or summarize "
                            "(summaries, scored against the no_press summary)"),
    model: str = ModelOpt,
    db: str = spec_option("db", EVAL_DB),
    metric: Optional[list[str]] = typer.Option(None, "--metric", help="extra metric, repeatable: gold_kept"),
    press: dict = None,
    generation: dict = None,
):
    spec = build(compared_by_default(press), generation, input=input, task=task, model=model, db=db, evaluate=True,
                 metrics=tuple(metric or ()))
    check_environment(prefect=False)
    spec = check_before_flow(spec, defaulted=press["press"] is None)
    exit_on_sigterm()  # a terminated eval closes its runs as failed (resume picks up where it stopped)
    say(f"{len(spec.configs())} configurations + the no_press reference, one prefill per document")
    with user_errors(), batch_progress(configs_bar=True) as hooks:
        summary = engine.run_spec(spec, hooks=hooks)
    print_summary(summary, db)
    say(f"{summary.wall_s:.0f} s; `nkv report --db {db}` for the table and plot")
    exit_unless_done(summary)

