"""``nkv suite``, ``nkv tasks`` and ``nkv ablation``: the synthetic long-context suite, its documents alone,
and NestedKV's per-scale ablation."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from bench import ablation as ablation_mod
from flows.cli.app import command, group
from flows.cli.checks import check_kv_group_size
from flows.cli.common import ModelOpt, fail, invalid, out_console, say, spec_option, user_errors
from flows.cli.spec import batch_progress, compared_by_default, press_grid
from flows.options import field_options, generation_options, model_fields, press_options, signature_fields
from pipeline import models
from pipeline import suite as suite_mod
from pipeline import tasks as tasks_mod
from pipeline.config import EVAL_INPUT, BatchOptions
from pipeline.spec import PressGrid
from pipeline.suite.options import SUITE_RATIOS, SuiteOptions, default_options

cli = group()


# The suite's own defaults for the generated options; every other default is the settings'.
_GRID = {"press": None, "compression_ratio": ",".join(map(str, SUITE_RATIOS)), "head_budget": "uniform,adaptive"}
_OPTIONS = default_options().model_dump(include={"max_new_tokens", "batch_decode"})
_FLOW_ONLY = ("retries", "retry_delay_s")  # the suite runs the engine, not the flows: no task retries


@command(cli, "suite")
@press_options(**_GRID)
@generation_options(exclude=_FLOW_ONLY, **_OPTIONS)
@field_options(model_fields(SuiteOptions, exclude=("model", "grid", "options")), "settings")
def suite(model: str = ModelOpt, settings: dict = None, press: dict = None, generation: dict = None):
    press = compared_by_default(press)
    try:
        opts = SuiteOptions(model=model, **settings, grid=PressGrid(**press_grid(press)),
                            options=BatchOptions(**generation))
        configs = opts.configs()  # validate the press options before any work
    except ValueError as exc:
        invalid(exc)
    with user_errors():
        check_kv_group_size(models.load_model(model)[0], configs)
    with user_errors(), batch_progress(configs_bar=True) as hooks:
        res = suite_mod.run_suite(opts, hooks=hooks, log=say)
    out_console.print(res.markdown_path.read_text(encoding="utf-8"), markup=False, highlight=False)
    say(f"wrote {res.markdown_path}" + (f" and {res.plot_path}" if res.plot_path else ""))


# What ``nkv tasks`` shares with the suite: the documents' settings.
_DOCUMENTS = ("size", "lengths", "per_task", "tasks", "seed", "austen")


@command(cli, "tasks")
@field_options(model_fields(SuiteOptions, include=_DOCUMENTS), "documents")
def tasks(
    out: Path = typer.Option(..., "--out", help="Parquet file to write"),
    model: str = spec_option("model", help="whose tokenizer counts the tokens"),
    documents: dict = None,
):
    try:
        opts = SuiteOptions(model=model, **documents)
    except ValueError as exc:
        invalid(exc)
    sizes = tasks_mod.SIZES[opts.size]
    with user_errors():
        count = tasks_mod.token_counter(models.load_model(model)[1])
    try:  # generate's ValueErrors are all about its arguments (unknown tasks, lengths, a short haystack)
        rows = tasks_mod.generate(count, opts.lengths or sizes.lengths, opts.per_task or sizes.per_task, opts.seed,
                                  opts.tasks, Path(opts.austen) if opts.austen else None)
    except (ValueError, FileNotFoundError) as exc:
        fail(str(exc))
    tasks_mod.write(rows, out)
    typer.echo(f"{out}: {len(rows)} documents, {sum(len(r['questions']) for r in rows)} questions")


@command(cli, "ablation")
@field_options(signature_fields(ablation_mod.ablate, exclude=("input", "model", "log")), "settings")
def ablation(
    input: str = spec_option("input", EVAL_INPUT, "Parquet file, glob or folder (with questions)"),
    model: str = ModelOpt,
    out: Optional[str] = typer.Option(None, "--out", help="also write the table as markdown here"),
    settings: dict = None,
):
    try:
        ablation_mod.check_variants(settings.get("variants") or [])
    except ValueError as exc:
        fail(f"--variants: {exc}")
    with user_errors():
        rows, per_q = ablation_mod.ablate(input, model=model, **settings)
    text = ablation_mod.summary_text(rows, per_q, settings["compression_ratio"])
    typer.echo(text)
    if out:
        Path(out).write_text(text)
