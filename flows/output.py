"""Query results to the terminal: a table, CSV or JSON, written batch by batch (a result is never held whole).

Every DuckDB type prints in every format: values Arrow cannot turn into Python (dates past year 9999,
``infinity``) are shown as Arrow's text for them. Duplicate column names are kept (JSON, whose objects
cannot hold two equal keys, names the later ones ``name_2``, ``name_3``...). Control characters are shown
escaped in every format, so no output can drive a terminal; CSV and JSON stay valid for their parsers.
"""

from __future__ import annotations

import base64
import datetime
import decimal
import json
import math
import uuid
from typing import IO, Iterable, Iterator, Optional

import pyarrow as pa

CONTROL_ESCAPES = {c: f"\\x{c:02x}" for c in [*range(0x20), *range(0x7F, 0xA0)]}
TABLE_ROWS = 10_000  # a terminal table beyond this is unreadable; csv and json write every row


def plain(text) -> str:
    """User text made safe for a terminal: control characters (escape sequences, newlines) shown escaped."""
    return str(text).translate(CONTROL_ESCAPES)


def column_values(arr: pa.Array) -> list:
    """The column as Python values; a column Arrow cannot convert comes back as Arrow's text for each value."""
    try:
        return arr.to_pylist()
    except (ValueError, OverflowError, pa.ArrowException):  # e.g. DATE 'infinity', year 294247
        try:
            return arr.cast(pa.string()).to_pylist()
        except pa.ArrowException:
            return [str(v) for v in arr]


def _bytes_text(b: bytes) -> str:
    return "".join(chr(c) if 0x20 <= c < 0x7F and c != 0x5C else f"\\x{c:02X}" for c in b)


def json_value(v):
    """A value JSON can hold exactly: strings for what JSON has no type for (NaN, times, decimals, bytes)."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else ("NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity"))
    if isinstance(v, (datetime.date, datetime.time)):
        return v.isoformat()
    if isinstance(v, (bytes, bytearray)):
        return base64.b64encode(bytes(v)).decode("ascii")
    if isinstance(v, dict):
        return {str(k): json_value(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_value(x) for x in v]
    return str(v)  # Decimal, UUID, timedelta, intervals


def cell_text(v) -> str:
    """One value as terminal-safe text (tables and CSV)."""
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (bytes, bytearray)):
        return _bytes_text(bytes(v))
    if isinstance(v, (datetime.date, datetime.time)):
        return v.isoformat()
    if isinstance(v, (dict, list, tuple)):
        return plain(json.dumps(json_value(v), ensure_ascii=False))
    return plain(v)


def _csv_cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, (bool, int, float, decimal.Decimal)):
        return cell_text(v)
    return '"' + cell_text(v).replace('"', '""') + '"'


def unique_names(names: list[str]) -> list[str]:
    """JSON keys: the names, later duplicates suffixed _2, _3... (never another column's name)."""
    given, used, out = set(names), set(), []
    for n in names:
        key, i = n, 1
        while key in used or (key != n and key in given):
            i += 1
            key = f"{n}_{i}"
        used.add(key)
        out.append(key)
    return out


def rows_of(batch: pa.RecordBatch) -> Iterator[list]:
    """The rows of a batch as lists, column by column (dicts would drop a duplicate column)."""
    cols = [column_values(c) for c in batch.columns]
    return (list(r) for r in zip(*cols)) if cols else iter([[]] * batch.num_rows)


class CsvWriter:
    def __init__(self, out: IO[str], names: list[str]):
        self.out = out
        out.write(",".join(_csv_cell(n) for n in names) + "\n")

    def write(self, batch: pa.RecordBatch) -> None:
        self.out.write("".join(",".join(_csv_cell(v) for v in row) + "\n" for row in rows_of(batch)))

    def close(self) -> None:
        self.out.flush()


class JsonWriter:
    """A JSON array of one object per row, written as the rows come."""

    def __init__(self, out: IO[str], names: list[str]):
        self.out, self.keys, self.first = out, unique_names(names), True

    def write(self, batch: pa.RecordBatch) -> None:
        parts = []
        for row in rows_of(batch):
            text = json.dumps(dict(zip(self.keys, map(json_value, row))), indent=2, allow_nan=False,
                              ensure_ascii=True)  # ensure_ascii: no raw control character reaches a terminal
            parts.append(("[\n" if self.first else ",\n") + "  " + text.replace("\n", "\n  "))
            self.first = False
        self.out.write("".join(parts))

    def close(self) -> None:
        self.out.write("[]\n" if self.first else "\n]\n")
        self.out.flush()


def write_result(fmt: str, schema: pa.Schema, batches: Iterable[pa.RecordBatch], out: IO[str]) -> None:
    """CSV or JSON of every batch to ``out``."""
    writer = (CsvWriter if fmt == "csv" else JsonWriter)(out, list(schema.names))
    for batch in batches:
        writer.write(batch)
    writer.close()


def table_rows(batches: Iterable[pa.RecordBatch], limit: Optional[int] = None) -> tuple[list[list[str]], bool]:
    """The cells of up to ``limit`` (default ``TABLE_ROWS``) rows, as text, and whether rows were left out."""
    limit = TABLE_ROWS if limit is None else limit
    cells: list[list[str]] = []
    for batch in batches:
        for row in rows_of(batch):
            if len(cells) >= limit:
                return cells, True
            cells.append(["" if v is None else f"{v:.4g}" if isinstance(v, float) else cell_text(v) for v in row])
    return cells, False
