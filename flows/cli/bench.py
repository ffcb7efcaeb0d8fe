"""``nkv bench``: a sub-app, one command per benchmark (``bench/``). Each command's options are generated from
its benchmark function's signature (``flows.options.signature_fields``): the defaults and help live there once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional

import typer

from bench import (kernels, long, memory, memory_plan, overhead, peer, press_cost, quant, rope, scoring_memory,
                   throughput)
from bench.peer import PeerOptions
from flows import bench_overhead
from flows.cli.app import COMMANDS, group
from flows.cli.common import ModelOpt, fail, out_console, say, user_errors
from flows.options import field_options, model_fields, signature_fields
from pipeline import models

bench_app = typer.Typer(add_completion=False, no_args_is_help=True, help=COMMANDS["bench"].help)
cli = group()
cli.add_typer(bench_app, name="bench")

_NOT_OPTIONS = ("model", "model_ref", "log")  # --model is the batch spec's option; log is ours


def options_of(fn: Callable, *, prefix: str = "", into: str = "options", **kw) -> Callable:
    """The benchmark function ``fn``'s parameters as options, into ``into``."""
    return field_options(signature_fields(fn, exclude=_NOT_OPTIONS + kw.pop("exclude", ())), into, prefix=prefix,
                         **kw)


def _log(message: str) -> None:
    out_console.print(message, markup=False, highlight=False)


def _checked(fn: Callable, *args, **kwargs):
    """``fn``, its ValueErrors (bad arguments, checked before any work) said as one line."""
    with user_errors():
        try:
            return fn(*args, **kwargs)
        except ValueError as exc:
            fail(str(exc))


@bench_app.command("kernels")
@options_of(kernels.run)
def bench_kernels(model: str = ModelOpt, options: dict = None):
    """Scoring, compression and decode time, GEMM speed and bytes per layer."""
    _checked(lambda: kernels.run(models.model_dir(model), **options))


@bench_app.command("memory-plan")
@options_of(memory_plan.run_benchmark)
def bench_memory_plan(model: str = ModelOpt, options: dict = None):
    """A document whose whole prefill does not fit the memory limit, read within it."""
    _checked(memory_plan.run_benchmark, model, **options)


@bench_app.command("scoring-memory")
@options_of(scoring_memory.run_benchmark)
def bench_scoring_memory(model: str = ModelOpt, options: dict = None):
    """Peak memory of each press's scoring at long contexts, against the KV it scores."""
    _checked(scoring_memory.run_benchmark, model, **options)


@bench_app.command("memory")
@options_of(memory.main)
def bench_memory(model: str = ModelOpt, options: dict = None):
    """Peak KV memory at growing context lengths."""
    _checked(memory.main, model, **options)


@bench_app.command("throughput")
@options_of(throughput.run_benchmark)
def bench_throughput(model: str = ModelOpt, options: dict = None):
    """Documents per hour: one at a time, batched, and a re-run through the prefill cache."""
    _checked(throughput.run_benchmark, model=model, **options)


@bench_app.command("rope")
@options_of(rope.run)
def bench_rope(model: str = ModelOpt, options: dict = None):
    """How much of each NestedKV scale's ranking is position."""
    _checked(rope.run, model, **options, log=_log)


@bench_app.command("peer")
@field_options(model_fields(PeerOptions, exclude=("model",)), "options")
def bench_peer(model: str = ModelOpt, options: dict = None):
    """Side by side with kvpress on the same documents and weights."""
    with user_errors():
        try:
            opts = PeerOptions(model=model, **options)
        except ValueError as exc:
            fail(f"invalid options: {exc}")
        try:
            peer.run(opts)
        except peer.Refusal as exc:
            say(f"bench_peer: {exc}")
            raise typer.Exit(3)


@bench_app.command("quant")
@options_of(quant.run)
def bench_quant(model: str = ModelOpt, options: dict = None):
    """Quantized KV against mlx-lm's, and decode speed."""
    _checked(quant.run, model=model, **options)


@bench_app.command("overhead")
@options_of(overhead.run_overhead)
def bench_overhead_cmd(model: str = ModelOpt, options: dict = None):
    """Share of a batch's wall time outside model compute."""
    _checked(overhead.run_overhead, model=model, **options)


@bench_app.command("press-cost")
@options_of(press_cost.run_press_cost)
def bench_press_cost(model: str = ModelOpt, options: dict = None):
    """Each press's compression seconds against the prefill it compresses."""
    _checked(press_cost.run_press_cost, model=model, **options)


@bench_app.command("long")
@options_of(long.rates, prefix="rate_", into="rates", exclude=("austen",))
@options_of(long.run)
def bench_long(model: str = ModelOpt,
               out: Optional[str] = typer.Option(None, "--out", help="also write both tables here (JSON)"),
               options: dict = None, rates: dict = None):
    """Documents past the window, read each way --long-docs offers; --rate-lengths: streaming prefill rates."""
    res = {}
    if options["per_length"]:
        res["table"] = _checked(long.run, model, **options, log=_log)
    if rates.get("lengths"):
        res["rates"] = _checked(long.rates, model, **rates, austen=options.get("austen"), log=_log)
    if out:
        Path(out).write_text(json.dumps(res, indent=1))


@bench_app.command("prefect")
@options_of(bench_overhead.run)
def bench_prefect(model: str = ModelOpt, options: dict = None):
    """Prefect's overhead per document."""
    _checked(bench_overhead.run, model=model, **options)
