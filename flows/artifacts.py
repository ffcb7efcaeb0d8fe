"""Prefect artifacts of a flow run: progress per document, memory-savings tables, a markdown report.

Reporting never fails a batch: an artifact the API refuses is logged and skipped.
"""

from __future__ import annotations

import datetime as dt
import decimal
import math
import re
from typing import Any, Optional
from uuid import UUID

from prefect import get_run_logger
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from pipeline import tables
from pipeline.quality import batch_quality
from pipeline.store import Store

LAYER_COLUMNS = ("layer", "tokens_seen", "kept_min", "kept_max", "kept_mean", "kept_share", "saved_share",
                 "resident_share", "saved_mib")


def artifact_key(*parts: str) -> str:
    """Prefect keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9]", "-", "-".join(parts).lower())).strip("-")


def _safe(what: str, fn, *args, **kw):
    try:
        return fn(*args, **kw)
    except Exception as exc:  # an artifact is a report, not part of the work
        get_run_logger().warning("could not write the %s artifact: %s: %s", what, type(exc).__name__, exc)
        return None


def _plain(v: Any) -> Any:
    # DuckDB sums of BIGINT arrive as Decimal; artifacts are JSON.
    if isinstance(v, decimal.Decimal):
        return int(v) if v == v.to_integral_value() else float(v)
    if isinstance(v, float):
        return None if math.isnan(v) else round(v, 4)
    if isinstance(v, (dt.datetime, dt.date)):
        return v.isoformat()
    return v


class ProgressReport:
    """One progress artifact per flow run, updated after every document."""

    def __init__(self, key: str, total: int, description: str):
        self.total, self.description = total, description
        self.id: Optional[UUID] = _safe(
            "progress", create_progress_artifact, progress=100.0 if total == 0 else 0.0, key=key,
            description=f"{description}: 0/{total}",
        )

    def update(self, done: int, note: str = "") -> None:
        if self.id is None or self.total == 0:
            return
        text = f"{self.description}: {done}/{self.total}" + (f" (last: {note})" if note else "")
        _safe("progress", update_progress_artifact, self.id, progress=100.0 * done / self.total, description=text)


def layer_rows(store: Store, run_id: str) -> list[dict]:
    return [{k: _plain(v) for k, v in r.items()} for r in store.layer_savings(run_id, LAYER_COLUMNS)]


def quality_rows(store: Store, summary) -> list[dict]:
    """The batch's evaluation means (``pipeline.quality.batch_quality``), as artifacts hold numbers."""
    hashes = {c.config_hash() for c, _ in summary.runs}
    return [{k: _plain(v) for k, v in r.items()} for r in batch_quality(store, hashes)]


def markdown_table(rows: list[dict]) -> str:
    return "\n".join(tables.markdown_dicts(rows, missing="")) + "\n" if rows else "_no rows_\n"


def publish_tables(flow_name: str, savings: list[dict], layers: list[dict], run_ids: list[str]) -> None:
    """Table artifacts: memory savings per run, and per layer for the last run."""
    savings = [{k: _plain(v) for k, v in r.items()} for r in savings]
    if savings:
        _safe("savings table", create_table_artifact, table=savings, key=artifact_key(flow_name, "memory-savings"),
              description="KV memory saved per run (bytes_kept / bytes_full over all layers and documents)")
    if layers:
        _safe("layer table", create_table_artifact, table=layers, key=artifact_key(flow_name, "layer-savings"),
              description=f"KV memory saved per layer, run {run_ids[-1]}")


def publish_report(flow_name: str, title: str, sections: list[tuple[str, str]]) -> None:
    body = f"# {title}\n\n" + "\n".join(f"## {head}\n\n{text}\n" for head, text in sections)
    _safe("report", create_markdown_artifact, markdown=body, key=artifact_key(flow_name, "report"),
          description=title)
