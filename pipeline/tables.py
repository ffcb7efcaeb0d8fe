"""The one markdown table writer: reports, the suite, Prefect artifacts and benchmarks all print through it."""

from __future__ import annotations

from typing import Any, Optional, Sequence


def markdown(header: Sequence[str], rows: Sequence[Sequence[Any]], *, align: Optional[Sequence[str]] = None,
             missing: str = "-") -> list[str]:
    """Header, separator and one line per row. ``align``: per column ``"l"`` or ``"r"`` (default: none
    given); a None cell prints as ``missing``, and a ``|`` inside a cell is escaped so it cannot split it."""
    rule = {"l": "---", "r": "---:", None: "---"}

    def cell(v: Any) -> str:
        return missing if v is None else str(v).replace("|", "\\|")

    return (["| " + " | ".join(map(str, header)) + " |",
             "|" + "|".join(rule[a] for a in (align or [None] * len(header))) + "|"]
            + ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows])


def markdown_dicts(rows: Sequence[dict], missing: str = "-") -> list[str]:
    """``markdown`` of dicts sharing the first one's keys, which are the header."""
    cols = list(rows[0]) if rows else []
    return markdown(cols, [[r.get(c) for c in cols] for r in rows], missing=missing)
