"""The ``nkv`` app: its global option and the table of its commands, each with its group's module and its help.

Listing the commands (``nkv``, ``nkv --help``) loads none of those modules, and a command loads its own group's
module only: the modules import what their commands run at their top (mlx-lm with transformers, Prefect's
server API, matplotlib), about 5 s for all of them. This is the CLI's one deferred import.
"""

from __future__ import annotations

import importlib
from typing import Callable, NamedTuple

import typer
from typer.core import TyperCommand, TyperGroup


class Entry(NamedTuple):
    module: str  # defines the command on its ``cli`` (a typer.Typer)
    help: str


_SUITE = "RULER-style tasks on Austen's prose"
COMMANDS = {
    "run": Entry("flows.cli.batch", "Run a batch through the Prefect flow and store outputs and per-layer KV memory "
                 "(several press values: every combination, one run each)."),
    "sweep": Entry("flows.cli.batch", "Compare presses and budgets: one prefill per document, one stored run per "
                   "configuration plus no_press."),
    "serve": Entry("flows.cli.batch", "Serve the batch flow as a scheduled deployment (needs a Prefect server: "
                   "`prefect server start`)."),
    "eval": Entry("flows.cli.batch", "Answer quality against the uncompressed model: per document one prefill, then "
                  "every configuration (and no_press) answers every question; metrics go to the evaluations table "
                  "and quality_vs_full."),
    "query": Entry("flows.cli.query", "Run a read-only SQL query against the store (results are written as they "
                   "are read)."),
    "report": Entry("flows.cli.results", "Quality against compression: a table per (method, head budget, ratio, KV "
                    "width), the configurations on the quality-memory frontier, and two plots (against the ratio, "
                    "against resident KV MiB)."),
    "models": Entry("flows.cli.results", "List the built-in and the converted (cached) models."),
    "suite": Entry("flows.cli.suite", f"The synthetic long-context suite ({_SUITE}): generate, calibrate on the "
                   "uncompressed model, run the methods, report per task and the quality-memory frontier. The press "
                   "options are a grid as in ``nkv sweep`` (--press '' : calibration only; default: every compared "
                   "press)."),
    "tasks": Entry("flows.cli.suite", f"Only generate the suite's documents ({_SUITE}) as Parquet."),
    "ablation": Entry("flows.cli.suite", "Per-scale ablation of NestedKV: which part of the score helps or hurts, on "
                      "the same documents."),
    "bench": Entry("flows.cli.bench", "Benchmarks, one command each; every figure in docs/ names the command it came "
                   "from."),
}


def command(cli: typer.Typer, name: str) -> Callable:
    """``@command(cli, "run")``: registers the function as ``nkv run`` with its help from ``COMMANDS``."""
    entry = COMMANDS[name]

    def register(fn: Callable) -> Callable:
        if fn.__module__ != entry.module:  # the lazy lookup would load the other module and not find it
            raise RuntimeError(f"nkv {name} is defined in {fn.__module__}; COMMANDS says {entry.module}")
        return cli.command(name, help=entry.help)(fn)
    return register


class _LazyCommands(TyperGroup):
    _listing = False  # set while --help lists the commands: their table entries stand in for them

    def list_commands(self, ctx: typer.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: typer.Context, name: str) -> TyperCommand | TyperGroup | None:
        entry = COMMANDS.get(name)
        if entry is None:
            return None
        if self._listing:
            return TyperCommand(name, help=entry.help)
        commands = typer.main.get_command(importlib.import_module(entry.module).cli)
        return commands.get_command(ctx, name) if isinstance(commands, TyperGroup) else commands

    def format_help(self, ctx: typer.Context, formatter) -> None:
        self._listing = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self._listing = False


app = typer.Typer(cls=_LazyCommands, add_completion=False, no_args_is_help=True,
                  help="NestedKV batch pipeline for long documents.")
verbose = {"on": False}  # the global --verbose option


@app.callback()
def _global_options(on: bool = typer.Option(False, "--verbose", help="show the traceback of an error before its "
                                            "one-line message")):
    verbose["on"] = on


def group() -> typer.Typer:
    """A module's own ``cli``, on which its commands register."""
    return typer.Typer(add_completion=False)
