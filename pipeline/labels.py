"""How a configuration is named, and where its row stands, in every report, table and plot: one function each,
so the suite, ``nkv report`` and the artifacts name and order configurations the same way."""

from __future__ import annotations

import nestedkv
from nestedkv.press import PRESSES, NoPress
from nestedkv.quant import KVQuant
from pipeline.config import REFERENCE_PRESS


def press_order() -> tuple[str, ...]:
    """Report rows: the reference, then the registered methods in their rank order."""
    return (NoPress.name, *(n for n, cls in PRESSES.items() if cls is not NoPress))


def config_order(row: dict) -> tuple:
    """A stored configuration's place among report rows: model, press (``press_order``), uniform before
    adaptive, KV width, budget, ratio."""
    press = row["press"]
    order = press_order()
    rank = order.index(press) if press in order else len(order)
    return (row["model"], rank, press, row["head_budget"] != "uniform", row["head_budget"],
            KVQuant.from_fields(row).sort_key(), row["budget"] or 0, row["compression_ratio"])


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
