"""Rows for the tables: runs, results, evaluations and bad input rows as Arrow tables of the tables' own
column types, so a value a column cannot hold fails here, in one line naming the column, before any write."""

from __future__ import annotations

import os
import secrets
import socket
from datetime import datetime, timezone
from typing import Any, Iterable, Mapping, Union

import pyarrow as pa

import nestedkv
from nestedkv.quant import KVQuant
from pipeline.config import RunConfig, code_version
from pipeline.results import OK, DocumentResult
from pipeline.store.errors import StoreError, one_line
from pipeline.store.processes import process_started_at
from pipeline.store.schema import arrow_schema, columns


def arrow(name: str, rows: list[dict]) -> pa.Table:
    try:
        return pa.Table.from_pylist(rows, schema=arrow_schema(name))
    except (pa.ArrowException, OverflowError, TypeError, ValueError) as e:
        # Name the column (e.g. an INTEGER column given a value past 2**31 - 1) instead of Arrow's traceback.
        for c, t in columns(name):
            try:
                pa.array([r.get(c) for r in rows], type=t[1])
            except (pa.ArrowException, OverflowError, TypeError, ValueError) as col_e:
                raise StoreError(f"cannot store {name}.{c} ({t[0]}): {one_line(col_e)}") from None
        raise StoreError(f"cannot store {name} rows: {one_line(e)}") from None


def new_run_id() -> str:
    # Time first so run ids sort by start; random suffix so two runs in one second differ.
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S") + "-" + secrets.token_hex(3)


def utcnow() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


def runs_table(run_id: str, config: RunConfig, input: str) -> pa.Table:
    """The row of a run starting now in this process (its host and pid tell later whether it still runs).
    A column named as a setting takes the setting's value; the others are derived here."""
    pid = os.getpid()
    settings = {c: getattr(config, c) for c, _ in columns("runs") if c in type(config).model_fields}
    return arrow("runs", [{
        **settings, "run_id": run_id, "created_at": utcnow(), "config_json": config.canonical_json(),
        "config_hash": config.config_hash(), "reference_config_hash": config.reference().config_hash(),
        "code_version": code_version(), "input": str(input), "status": "running",
        **KVQuant.from_fields(config).as_fields(), "saw_questions": nestedkv.PRESSES[config.press].needs_questions,
        "host": socket.gethostname(), "pid": pid, "pid_started_at": process_started_at(pid),
    }])


def outputs_table(run_id: str, r: DocumentResult) -> pa.Table:
    """One row per question; a document without questions (failed early) still gets one row for its status.
    Every column is the question's attribute of its name, else the document's: a new column is its schema
    entry and the result field that fills it."""
    cols = [c for c, _ in columns("outputs") if c not in ("run_id", "status", "error")]
    doc = {"run_id": run_id, **{c: getattr(r, c) for c in cols if hasattr(r, c)}}
    if not r.questions:
        return arrow("outputs", [{**doc, "status": r.status, "error": r.error}])
    bad_doc = r.status != OK  # a failed document taints every question answered from it
    return arrow("outputs", [
        {**doc, **{c: getattr(q, c) for c in cols if hasattr(q, c)},
         "status": r.status if bad_doc else q.status, "error": q.error or r.error}
        for q in r.questions])


def layer_memory_table(run_id: str, r: DocumentResult) -> pa.Table:
    ids = {"run_id": run_id, "doc_id": r.doc_id, "content_sha256": r.content_sha256}
    return arrow("layer_memory", [{**ids, **lm.as_dict()} for lm in r.layers])


def evaluations_table(rows: Union[pa.Table, Iterable[Mapping[str, Any]]]) -> pa.Table:
    """Dicts or an Arrow table with (at least) the ``evaluations`` columns."""
    cols = [c for c, _ in columns("evaluations")]
    data = rows.select(cols) if isinstance(rows, pa.Table) else arrow("evaluations", [
        {c: r.get(c) for c in cols} for r in rows
    ])
    return data.cast(arrow_schema("evaluations"))


def input_errors_table(run_id: str, errors: Iterable[Any]) -> pa.Table:
    """``RowError``s of one run."""
    return arrow("input_errors", [
        {"run_id": run_id, "source": e.source, "row_number": e.row, "doc_id": e.doc_id, "field": e.field,
         "message": e.message}
        for e in errors
    ])
