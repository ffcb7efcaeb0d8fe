"""``nkv query``: read-only SQL against the store, its rows written as they are read."""

from __future__ import annotations

import math

import typer

from flows import output
from flows.cli.app import command, group
from flows.cli.common import DbOpt, fail, interrupted_exits, print_result, say, user_errors
from flows.query import QUERY_TIMEOUT_S, QueryStopped, background_query
from pipeline import store as store_mod
from pipeline.store import Store

cli = group()


def run_query(store, sql: str, fmt: str, timeout: float) -> None:
    """Write the query's batches here as they come (``flows.query``); ``timeout`` stops it. A table shows
    the first rows only, and then the query is stopped as well."""
    try:
        with background_query(store, sql, timeout) as (schema, batches):
            if print_result(schema, batches, fmt):
                say(f"showing the first {output.TABLE_ROWS} rows; --format csv or json writes every row",
                    style="yellow")
    except QueryStopped as exc:
        fail(str(exc), 1)
    except BrokenPipeError:  # the reader went away (| head): stop quietly
        raise typer.Exit(0)


@command(cli, "query")
def query(
    sql: str = typer.Argument(..., help="SQL to run read-only"),
    db: str = DbOpt,
    format: str = typer.Option("table", "--format", help="table, csv or json"),
    timeout: float = typer.Option(QUERY_TIMEOUT_S, "--timeout", help="seconds the query may wait on the database "
                                  "before it is stopped (0: no limit); Ctrl-C stops it at once"),
):
    if format not in ("table", "csv", "json"):
        fail(f"--format must be table, csv or json, got {format!r}")
    if not (math.isfinite(timeout) and timeout >= 0):
        fail(f"--timeout must be a number of seconds >= 0 (0: no limit), got {timeout!r}")
    # A batch writing the store holds it only while it stores a document: wait that out.
    with interrupted_exits("query"), user_errors():
        with Store(db, read_only=True, wait_s=store_mod.READER_WAIT_S) as store:
            run_query(store, sql, format, timeout)
