"""The ``nkv`` command line: one typer app (``flows.cli.app``, which lists the commands), their code in modules by
group (``batch``: run, sweep, eval, serve; ``query``; ``results``: report, models; ``suite``: the suite, its tasks
and the ablation; ``bench``: the benchmarks), with ``common`` (output, errors, options) and ``checks`` (before a
flow or a model) beside them."""

from __future__ import annotations

from flows.cli.app import app

__all__ = ["app", "main"]


def main() -> None:
    app()  # the CPU fast path is on already: importing flows opted in
