"""``nkv suite``, ``nkv tasks`` and ``nkv ablation``: the synthetic long-context suite, its documents alone,
and NestedKV's per-scale ablation."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from bench import ablation as ablation_mod
from bench.ablation import ABLATION_NEW_TOKENS
from flows.cli.app import command, group
from flows.cli.checks import check_kv_group_size
from flows.cli.common import ModelOpt, fail, invalid, out_console, say, spec_option, split_list, user_errors
from flows.cli.spec import batch_progress, compared_by_default, press_grid
from flows.options import generation_options, press_options
from pipeline import models
from pipeline import suite as suite_mod
from pipeline import tasks as tasks_mod
from pipeline.config import EVAL_INPUT, BatchOptions
from pipeline.spec import PressGrid
from pipeline.suite.options import HEADLINE_RATIOS, SUITE_RATIOS, default_options
from pipeline.tasks import TASKS

cli = group()


# The suite's own defaults for the generated options; every other default is the settings'.
_GRID = {"press": None, "compression_ratio": ",".join(map(str, SUITE_RATIOS)), "head_budget": "uniform,adaptive"}
_OPTIONS = default_options().model_dump(include={"max_new_tokens", "batch_decode"})
_FLOW_ONLY = ("retries", "retry_delay_s")  # the suite runs the engine, not the flows: no task retries


@command(cli, "suite")
@press_options(**_GRID)
@generation_options(exclude=_FLOW_ONLY, **_OPTIONS)
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
    threshold: float = typer.Option(0.6, "--threshold", help="least uncompressed accuracy for a task x length "
                                    "cell to enter the headline"),
    all_tasks: bool = typer.Option(False, "--all-tasks", help="run the methods on cells below the threshold too"),
    ablation: bool = typer.Option(True, "--ablation/--no-ablation", help="NestedKV's per-scale variants on the "
                                  "long documents"),
    variants: Optional[str] = typer.Option(None, "--variants", help="comma-separated subset of those variants "
                                           "(default: all, e.g. 'block only,window only post-RoPE')"),
    summaries: int = typer.Option(0, "--summaries", help="plain documents per long length whose compressed "
                                  "summaries are compared with the uncompressed one"),
    summaries_only: bool = typer.Option(False, "--summaries-only", help="only the summaries: no task documents, "
                                        "calibration or methods"),
    austen: Optional[str] = typer.Option(None, "--austen", help="folder with the Austen .txt files"),
    long_from: int = typer.Option(4096, "--long-from", help="documents of at least this many tokens make the "
                                  "headline, the ablation and the summaries"),
    press: dict = None,
    generation: dict = None,
):
    press = compared_by_default(press)
    try:
        opts = suite_mod.SuiteOptions(
            model=model, db=db, out=out, size=size, per_task=per_task, seed=seed,
            lengths=tuple(split_list(lengths, int, "--lengths")) or None,
            tasks=tuple(split_list(tasks, str, "--tasks")) or TASKS,
            grid=PressGrid(**press_grid(press)), options=BatchOptions(**generation), threshold=threshold,
            all_tasks=all_tasks, ablation=ablation, summaries=summaries, long_from=long_from, austen=austen,
            summaries_only=summaries_only,
            variants=tuple(split_list(variants, str, "--variants")) if variants else None)
        configs = opts.configs()  # validate the press options before any work
    except ValueError as exc:
        invalid(exc)
    with user_errors():
        check_kv_group_size(models.load_model(model)[0], configs)
    with user_errors(), batch_progress(configs_bar=True) as hooks:
        res = suite_mod.run_suite(opts, hooks=hooks, log=say)
    out_console.print(res.markdown_path.read_text(encoding="utf-8"), markup=False, highlight=False)
    say(f"wrote {res.markdown_path}" + (f" and {res.plot_path}" if res.plot_path else ""))


@command(cli, "tasks")
def tasks(
    out: Path = typer.Option(..., "--out", help="Parquet file to write"),
    size: str = typer.Option("standard", "--size", help="quick, small or standard (lengths and documents per "
                             "task)"),
    lengths: Optional[str] = typer.Option(None, "--lengths", help="target tokens, e.g. 2048,4096 (overrides the "
                                          "size's)"),
    per_task: Optional[int] = typer.Option(None, "--per-task", help="documents per task and length (overrides "
                                           "the size's)"),
    tasks: Optional[str] = typer.Option(None, "--tasks", help="comma-separated subset of the tasks (default: all)"),
    seed: int = typer.Option(0, "--seed"),
    model: str = spec_option("model", help="whose tokenizer counts the tokens"),
    austen: Optional[Path] = typer.Option(None, "--austen", help="folder with the Austen .txt files"),
):
    if size not in tasks_mod.SIZES:
        fail(f"--size: choose {', '.join(sorted(tasks_mod.SIZES))}, got {size!r}")
    sizes = tasks_mod.SIZES[size]
    with user_errors():
        count = tasks_mod.token_counter(models.load_model(model)[1])
    try:  # generate's ValueErrors are all about its arguments (unknown tasks, lengths, a short haystack)
        rows = tasks_mod.generate(count, split_list(lengths, int, "--lengths") or sizes.lengths,
                                  per_task or sizes.per_task, seed, split_list(tasks, str, "--tasks") or tasks_mod.TASKS,
                                  austen)
    except (ValueError, FileNotFoundError) as exc:
        fail(str(exc))
    tasks_mod.write(rows, out)
    typer.echo(f"{out}: {len(rows)} documents, {sum(len(r['questions']) for r in rows)} questions")


@command(cli, "ablation")
def ablation(
    input: str = spec_option("input", EVAL_INPUT, "Parquet file, glob or folder (with questions)"),
    compression_ratio: str = typer.Option(",".join(f"{r:g}" for r in HEADLINE_RATIOS), "--compression-ratio"),
    variants: Optional[str] = typer.Option(None, "--variants", help="comma-separated variants (default: all)"),
    model: str = ModelOpt,
    max_new_tokens: int = typer.Option(ABLATION_NEW_TOKENS, "--max-new-tokens"),
    limit: Optional[int] = typer.Option(None, "--limit", help="only the first N documents"),
    out: Optional[str] = typer.Option(None, "--out", help="also write the table as markdown here"),
):
    ratios = split_list(compression_ratio, float, "--compression-ratio")
    names = split_list(variants, str, "--variants") or None
    try:
        ablation_mod.check_variants(names or [])
    except ValueError as exc:
        fail(f"--variants: {exc}")
    with user_errors():
        rows, per_q = ablation_mod.ablate(input, ratios, names, model, max_new_tokens, limit=limit)
    text = ablation_mod.summary_text(rows, per_q, ratios)
    typer.echo(text)
    if out:
        Path(out).write_text(text)
