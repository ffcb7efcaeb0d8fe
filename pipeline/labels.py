"""How a configuration is named in every report, table and plot: one function, so the suite, ``nkv report``
and the artifacts name a configuration the same way."""

from __future__ import annotations

import nestedkv
from nestedkv.quant import KVQuant
from pipeline.config import REFERENCE_PRESS


def press_label(press: str) -> str:
    """A press's name, marked when its compression read the questions: its rows stay apart from the
    query-agnostic presses', which guess what any later question needs."""
    cls = nestedkv.PRESSES.get(press)
    return f"{press} (saw the questions)" if cls is not None and cls.needs_questions else press


def bits_label(row: dict) -> str:
    """The label suffix of a quantized configuration (" 4-bit", " 4-bit plain"); none for the model's dtype."""
    return KVQuant.from_fields(row).label()


def config_label(row: dict) -> str:
    """``press head_budget[ streaming][ 4-bit]`` for a stored configuration's row; ``no_press[ 4-bit]`` for the
    reference (one per KV width)."""
    if row["press"] == REFERENCE_PRESS:
        return REFERENCE_PRESS + bits_label(row)
    mode = " streaming" if row.get("prefill") == "streaming" else ""
    return f"{press_label(row['press'])} {row['head_budget']}{mode}{bits_label(row)}"
