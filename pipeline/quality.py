"""A batch's quality against its uncompressed twin, as ``nkv run --compare-full`` prints it and the flow's report
artifact shows it: the store's evaluation means of the batch's configurations, in report order."""

from __future__ import annotations

from pipeline.config import REFERENCE_PRESS
from pipeline.labels import config_order

COLUMNS = ("press", "compression_ratio", "head_budget", "budget", "n_docs", "delta_nll", "rouge_l", "top1_agreement",
           "accuracy", "source_coverage", "source_middle", "source_ends")


def batch_quality(store, hashes: set[str]) -> list[dict]:
    """The evaluation means of the configurations ``hashes`` (a batch's), the uncompressed reference first, with
    the ``COLUMNS`` some row has."""
    rows = sorted((r for r in store.quality_by_config() if r["config_hash"] in hashes), key=config_order)
    keys = [k for k in COLUMNS if any(r.get(k) is not None for r in rows)]
    return [{k: r.get(k) for k in keys} for r in rows]


def compared(rows: list[dict]) -> bool:
    """Whether the rows hold a compressed configuration to show against its twin."""
    return any(r["press"] != REFERENCE_PRESS for r in rows)
