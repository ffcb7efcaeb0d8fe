"""The ``nkv`` command line: one typer app, its commands in modules by group (``batch``: run, sweep, eval,
serve; ``results``: query, report, models; ``bench``: the suite and the benchmarks)."""

from __future__ import annotations

import nestedkv
from flows.cli import batch, results, bench  # noqa: F401 (each registers its commands on the app)
from flows.cli.common import app
from flows.cli.spec import press_grid

__all__ = ["app", "main", "press_grid"]


def main() -> None:
    # No command has loaded mlx yet (this package does not import it): mlx binds its BLAS when it loads.
    nestedkv.enable_cpu_fast_path()
    app()
