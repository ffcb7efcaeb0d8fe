"""Parquet inputs -> validated ``Document`` models, with bad rows reported instead of aborting the batch.

Two layouts are accepted: one row per document (``doc_id``, ``text``, optional ``title``, ``questions``,
``answers``), and kvpress-style rows (``context``, ``question``, ``answer``, optional ``doc_id``/``id``)
where rows sharing a context become one document with several questions.
"""

from __future__ import annotations

import glob
import hashlib
import unicodedata
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Iterator, Optional, Union

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, computed_field, field_validator

PathLike = Union[str, Path]

# Small batches: documents are long, so a default 64k-row batch could hold gigabytes of text.
BATCH_ROWS = 256

NATIVE_COLUMNS = ("doc_id", "text", "title", "questions", "answers")
KVPRESS_COLUMNS = ("context", "question", "answer", "doc_id", "id", "title")
COLUMNS = {"native": NATIVE_COLUMNS, "kvpress": KVPRESS_COLUMNS}


class InputError(ValueError):
    """A problem with an input file as a whole (missing, unreadable, wrong columns)."""


@dataclass(frozen=True)
class RowError:
    source: str
    row: int
    doc_id: Optional[str]
    field: str
    message: str

    def __str__(self) -> str:
        who = f" (doc_id {self.doc_id!r})" if self.doc_id else ""
        return f"{self.source} row {self.row}{who}: {self.field}: {self.message}"


_INVISIBLE = {"Cc", "Cf", "Zs", "Zl", "Zp", "Cs", "Co", "Cn"}  # controls, zero-width/BOM, spaces, unassigned


def visible(ch: str) -> bool:
    """A character that shows: not whitespace, a control, a format character (zero-width, BOM) or unassigned."""
    return unicodedata.category(ch) not in _INVISIBLE


def sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class Document(BaseModel):
    # strict: a number in the text column is an input error, not a silently stringified document.
    # extra="ignore": model_dump() carries the computed fields and must validate back.
    model_config = ConfigDict(strict=True, frozen=True, extra="ignore")

    doc_id: str
    text: str
    title: Optional[str] = None
    questions: Optional[list[str]] = None
    answers: Optional[list[str]] = None

    @field_validator("doc_id", "text")
    @classmethod
    def _not_blank(cls, v: str) -> str:
        if not any(visible(c) for c in v):
            raise ValueError("must not be empty" if not v.strip() else
                             "must not be empty (it holds only invisible or control characters)")
        return v

    @field_validator("answers")
    @classmethod
    def _aligned(cls, v: Optional[list[str]], info: ValidationInfo) -> Optional[list[str]]:
        qs = info.data.get("questions")
        if v is not None and qs is not None and len(v) != len(qs):
            raise ValueError(f"{len(v)} answers for {len(qs)} questions (must be aligned)")
        return v

    @computed_field
    @cached_property
    def content_sha256(self) -> str:
        return sha256_hex(self.text)

    @computed_field
    @cached_property
    def n_chars(self) -> int:
        return len(self.text)


def _files(path: PathLike) -> list[Path]:
    p = Path(path).expanduser()
    text = str(p) if str(path).startswith("~") else str(path)
    if any(ch in text for ch in "*?["):
        files = sorted(Path(f) for f in glob.glob(text, recursive=True) if Path(f).is_file())
        if not files:
            raise InputError(f"{text}: no file matches this pattern")
        return files
    if p.is_dir():
        files = sorted(f for f in p.rglob("*.parquet") if f.is_file())
        if not files:
            raise InputError(f"{p}: folder holds no .parquet files")
        return files
    if not p.exists():
        raise InputError(f"{p}: no such file")
    if not p.is_file():  # a FIFO or a device would block the read, or never end
        raise InputError(f"{p}: not a regular file")
    return [p]


def _layout(path: Path, schema: pa.Schema) -> str:
    names = set(schema.names)
    if "text" in names:
        if "doc_id" not in names:
            raise InputError(f"{path}: has a 'text' column but no 'doc_id' column")
        return "native"
    if "context" in names:
        return "kvpress"
    raise InputError(f"{path}: no 'text' (or kvpress 'context') column; found: {', '.join(schema.names) or 'none'}")


def _open(path: Path) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as e:
        raise InputError(f"{path}: not a readable Parquet file ({_one_line(e)})") from None


def _one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def check_input(path: PathLike, pages: bool = False) -> list[Path]:
    """Raise ``InputError`` for file-level problems and return the files.

    Reads the Parquet footers; with ``pages=True`` also every data page of the columns a load reads (one
    more pass over the data, values not decoded: a value that is not UTF-8 stays a bad row, not a file
    error), so damaged pages are found before any work starts.
    """
    files = _files(path)
    opened = [(f, _open(f)) for f in files]
    layouts = [_layout(f, pf.schema_arrow) for f, pf in opened]
    if pages:
        for (f, pf), layout in zip(opened, layouts):
            for _ in _batches(f, pf, COLUMNS[layout]):
                pass
    return files


NOT_UTF8 = "not valid UTF-8"


def _binary_type(t: pa.DataType) -> Optional[pa.DataType]:
    """The same type with every string as bytes (dictionaries unpacked), or None when ``t`` holds no strings."""
    if pa.types.is_string(t) or pa.types.is_string_view(t):
        return pa.binary()
    if pa.types.is_large_string(t):
        return pa.large_binary()
    if pa.types.is_dictionary(t):
        return _binary_type(t.value_type)
    # (list views cannot be cast: their values go through ``_values``, value by value)
    lists = {pa.types.is_list: pa.list_, pa.types.is_large_list: pa.large_list,
             pa.types.is_fixed_size_list: lambda inner: pa.list_(inner, t.list_size)}
    for is_kind, make in lists.items():
        if is_kind(t):
            inner = _binary_type(t.value_type)
            return None if inner is None else make(inner)
    return None


def _as_bytes(arr: pa.Array, binary: pa.DataType) -> pa.Array:
    """``arr`` with its strings as bytes: no value is decoded, so none can fail here."""
    if isinstance(arr, pa.ChunkedArray):
        return pa.chunked_array([_as_bytes(c, binary) for c in arr.chunks], binary)
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    return arr.cast(binary)


def _decode(value, field: str):
    """(value with bytes decoded, None) or (None, the field path of the first value that is not UTF-8)."""
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8"), None  # strict: rejects CESU-8 surrogates too
        except UnicodeDecodeError:
            return None, field
    if isinstance(value, list):
        out = []
        for i, v in enumerate(value):
            d, bad = _decode(v, f"{field}.{i}")
            if bad:
                return None, bad
            out.append(d)
        return out, None
    return value, None


class _Unreadable:
    """A value Arrow could not turn into Python (its reason kept for the bad row)."""

    def __init__(self, exc: BaseException) -> None:
        self.reason = f"cannot be read ({type(exc).__name__}: {_one_line(exc)})"


def _values(arr) -> list:
    """The column's Python values; one that cannot be converted becomes an ``_Unreadable``, not an error."""
    try:
        return arr.to_pylist()
    except Exception:  # noqa: BLE001  (input data: any conversion failure is a bad row)
        out = []
        for i in range(len(arr)):
            try:
                out.append(arr[i].as_py())
            except Exception as exc:  # noqa: BLE001
                out.append(_Unreadable(exc))
        return out


def _batch_records(batch: pa.RecordBatch) -> Iterator[tuple[dict, Optional[tuple[str, str]]]]:
    """(record, (field, reason) for the first value that cannot be decoded, or None) per row. Parquet does
    not guarantee valid UTF-8 in string columns, whatever their layout (plain, large, view, dictionary),
    and Arrow decodes a whole column at once: so strings are read as bytes and decoded value by value,
    and one bad value loses its row only."""
    columns, decoded = {}, set()
    for i, name in enumerate(batch.schema.names):
        col = batch.column(i)
        binary = _binary_type(col.type)
        if binary is not None:
            col = _as_bytes(col, binary)
            decoded.add(name)
        columns[name] = _values(col)
    for r in range(batch.num_rows):
        record, bad = {}, None
        for name, values in columns.items():
            value = values[r]
            if isinstance(value, _Unreadable):
                bad = bad or (name, value.reason)
                value = None
            elif name in decoded:
                value, field = _decode(value, name)
                bad = bad or (field and (field, NOT_UTF8))
            record[name] = value
        yield record, bad


def _batches(path: Path, pf: pq.ParquetFile, wanted: tuple[str, ...]) -> Iterator[tuple[int, pa.RecordBatch]]:
    """(number of its first row, batch) over the ``wanted`` columns of one file; damaged data is an InputError."""
    cols = [c for c in wanted if c in pf.schema_arrow.names]
    row = 0
    try:
        for batch in pf.iter_batches(batch_size=BATCH_ROWS, columns=cols):
            yield row, batch
            row += batch.num_rows
    except (OSError, pa.ArrowException) as e:
        raise InputError(f"{path}: corrupt Parquet data near row {row} ({_one_line(e)})") from None


def _rows(path: Path, pf: pq.ParquetFile,
          wanted: tuple[str, ...]) -> Iterator[tuple[int, dict, Optional[tuple[str, str]]]]:
    """(row number, record, (field, reason) when a value cannot be decoded, or None) for every row of one file."""
    for first, batch in _batches(path, pf, wanted):
        for i, (record, bad) in enumerate(_batch_records(batch)):
            yield first + i, record, bad



def _describe(err: dict) -> tuple[str, str]:
    field = ".".join(str(part) for part in err["loc"]) or "row"
    if err.get("input", ...) is None:
        return field, "missing (null)"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"].endswith("_type"):
        msg += f" (got {type(err['input']).__name__})"
    return field, msg


def _validate(
    source: str, row: int, data: dict, rename: Optional[dict] = None
) -> tuple[Optional[Document], Optional[RowError]]:
    try:
        return Document(**data), None
    except ValidationError as e:
        errs = e.errors()
        field, msg = _describe(errs[0])
        if len(errs) > 1:
            msg += "; also " + "; ".join("{}: {}".format(*_describe(x)) for x in errs[1:])
        field = (rename or {}).get(field, field)
        doc_id = data.get("doc_id") if isinstance(data.get("doc_id"), str) else None
        return None, RowError(source, row, doc_id, field, msg)


class _Loader:
    """Keeps doc_id uniqueness across every file of one input."""

    def __init__(self) -> None:
        self.docs: list[Document] = []
        self.errors: list[RowError] = []
        self.first_seen: dict[str, tuple[str, int]] = {}

    def add(self, source: str, row: int, doc: Document) -> None:
        if doc.doc_id in self.first_seen:
            src, first = self.first_seen[doc.doc_id]
            where = f"row {first}" if src == source else f"{src} row {first}"
            self.errors.append(RowError(source, row, doc.doc_id, "doc_id", f"duplicate doc_id; first seen in {where}"))
            return
        self.first_seen[doc.doc_id] = (source, row)
        self.docs.append(doc)

    def native(self, path: Path, pf: pq.ParquetFile) -> None:
        source = str(path)
        for row, rec, undecodable in _rows(path, pf, COLUMNS["native"]):
            if undecodable:
                doc_id = rec.get("doc_id") if isinstance(rec.get("doc_id"), str) else None
                self.errors.append(RowError(source, row, doc_id, *undecodable))
                continue
            doc, err = _validate(source, row, rec)
            if err:
                self.errors.append(err)
            else:
                self.add(source, row, doc)

    def kvpress(self, path: Path, pf: pq.ParquetFile) -> None:
        source = str(path)
        has_answer = "answer" in pf.schema_arrow.names
        groups: dict[str, dict] = {}  # context sha256 -> accumulated document fields, in first-seen order
        for row, rec, undecodable in _rows(path, pf, COLUMNS["kvpress"]):
            ctx, q, a = rec.get("context"), rec.get("question"), rec.get("answer")
            doc_id = rec.get("doc_id", rec.get("id"))
            if isinstance(doc_id, int) and not isinstance(doc_id, bool):
                doc_id = str(doc_id)  # kvpress datasets often number their rows
            doc_id = doc_id if isinstance(doc_id, str) and doc_id.strip() else None
            bad = None
            if undecodable:
                bad = undecodable
            elif ctx is None or (isinstance(ctx, str) and not ctx.strip()):
                bad = ("context", "missing (null)" if ctx is None else "must not be empty")
            elif not isinstance(ctx, str):
                bad = ("context", f"Input should be a valid string (got {type(ctx).__name__})")
            elif q is not None and not isinstance(q, str):
                bad = ("question", f"Input should be a valid string (got {type(q).__name__})")
            elif a is not None and not isinstance(a, str):
                bad = ("answer", f"Input should be a valid string (got {type(a).__name__})")
            if bad:
                self.errors.append(RowError(source, row, doc_id, *bad))
                continue
            key = sha256_hex(ctx)
            g = groups.setdefault(
                key,
                {"row": row, "doc_id": doc_id or f"ctx-{key[:12]}", "text": ctx, "title": rec.get("title"),
                 "questions": [], "answers": []},
            )
            if q is not None:
                g["questions"].append(q)
                g["answers"].append(a)
        for g in groups.values():
            row = g.pop("row")
            # Gold answers are kept only when every question has one, so indices stay aligned.
            answers = g.pop("answers")
            g["answers"] = answers if has_answer and g["questions"] and None not in answers else None
            g["questions"] = g["questions"] or None
            doc, err = _validate(source, row, g, rename={"text": "context"})
            if err:
                self.errors.append(err)
            else:
                self.add(source, row, doc)


def load_documents(path: PathLike) -> tuple[list[Document], list[RowError]]:
    """All valid documents of a Parquet file, glob or folder, and one ``RowError`` per skipped row."""
    # Every footer is checked before any row is read, so a bad third file fails fast.
    opened = [(f, _open(f)) for f in _files(path)]
    layouts = [_layout(f, pf.schema_arrow) for f, pf in opened]
    loader = _Loader()
    for (f, pf), layout in zip(opened, layouts):
        getattr(loader, layout)(f, pf)
    return loader.docs, loader.errors
