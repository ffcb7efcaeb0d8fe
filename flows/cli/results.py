"""``nkv report`` and ``models``: what the store's evaluations say, and what the model cache holds."""

from __future__ import annotations

import typer
from rich.table import Table
from rich.text import Text

from flows.cli.app import command, group
from flows.cli.common import out_console, print_table, say, spec_option, user_errors
from flows.output import plain
from pipeline.config import EVAL_DB
from pipeline.models import list_models
from pipeline.report import write_report

cli = group()


@command(cli, "report")
def report(
    db: str = spec_option("db", EVAL_DB, "DuckDB file written by `nkv eval`"),
    out: str = typer.Option("reports", "--out", help="folder for report.md, quality_vs_ratio.png and "
                            "quality_vs_memory.png"),
):
    with user_errors():
        rep = write_report(db, out)
    print_table(rep.table, title="quality against the uncompressed reference")
    say(f"wrote {rep.markdown_path} and {rep.plot_path}" + (f" and {rep.frontier_path}" if rep.frontier_path else ""))


@command(cli, "models")
def models():
    rows = list_models()
    out = Table(title="models")
    keys = sorted({k for r in rows for k in r})
    for k in keys:
        out.add_column(k, overflow="fold")
    for r in rows:
        out.add_row(*(Text(plain(r.get(k, ""))) for k in keys))
    out_console.print(out)

