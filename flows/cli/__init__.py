"""The ``nkv`` command line: one typer app, its commands in modules by group (``batch``: run, sweep, eval,
serve; ``results``: query, report, models; ``suite``: the suite, its tasks and the ablation; ``bench``: the
benchmarks)."""

from __future__ import annotations

import warnings

import nestedkv
from nestedkv._platform import MISSING_OPENBLAS
from flows.cli import batch, results, suite, bench  # noqa: F401 (each registers its commands on the app)
from flows.cli.common import app
from flows.cli.spec import press_grid

__all__ = ["app", "main", "press_grid"]


def main() -> None:
    # No command has loaded mlx yet (this package does not import it): mlx binds its BLAS when it loads.
    with warnings.catch_warnings():  # said in one line when a model loads (pipeline.models), not here
        warnings.filterwarnings("ignore", message=MISSING_OPENBLAS, category=RuntimeWarning)
        nestedkv.enable_cpu_fast_path()
    app()
