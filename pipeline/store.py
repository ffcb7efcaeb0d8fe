"""The DuckDB store: runs, outputs and per-layer KV memory, written one document per transaction.

One writer per file (DuckDB's own rule); readers open the file read-only. Every write of a document
first deletes that (run, document)'s rows, so a retried task replaces instead of duplicating.
"""

from __future__ import annotations

import secrets
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Union

import duckdb
import pyarrow as pa

from pipeline.config import RunConfig, code_version
from pipeline.results import OK, DocumentResult

SCHEMA_VERSION = 1
RUN_STATUSES = ("running", "completed", "failed")

# (name, DuckDB type, Arrow type): one list per table drives both the DDL and the Arrow batches.
_S = ("VARCHAR", pa.string())
_I = ("INTEGER", pa.int32())
_B = ("BIGINT", pa.int64())
_F = ("DOUBLE", pa.float64())
_T = ("TIMESTAMP", pa.timestamp("us"))

TABLES: dict[str, list[tuple[str, tuple[str, pa.DataType]]]] = {
    "runs": [
        ("run_id", _S), ("created_at", _T), ("finished_at", _T), ("task", _S), ("model", _S), ("press", _S),
        ("compression_ratio", _F), ("budget", _I), ("head_budget", _S), ("prefill_step_size", _I),
        ("max_new_tokens", _I), ("config_json", _S), ("config_hash", _S), ("reference_config_hash", _S),
        ("code_version", _S), ("input", _S), ("status", _S), ("n_documents", _I), ("n_errors", _I),
    ],
    "documents": [("doc_id", _S), ("content_sha256", _S), ("n_chars", _B), ("n_tokens", _I), ("title", _S)],
    "outputs": [
        ("run_id", _S), ("doc_id", _S), ("content_sha256", _S), ("question_idx", _I), ("question", _S),
        ("output", _S), ("gold", _S), ("status", _S), ("error", _S), ("n_tokens", _I),
        ("n_question_tokens", _I), ("n_generated", _I), ("prefill_s", _F), ("compress_s", _F),
        ("decode_s", _F), ("prefill_tok_s", _F), ("decode_tok_s", _F), ("peak_prefill_bytes", _B),
        ("peak_decode_bytes", _B),
    ],
    "layer_memory": [
        ("run_id", _S), ("doc_id", _S), ("content_sha256", _S), ("layer", _I), ("n_kv_heads", _I),
        ("head_dim", _I), ("dtype", _S), ("tokens_seen", _I), ("kept_min", _I), ("kept_max", _I),
        ("kept_mean", _F), ("bytes_full", _B), ("bytes_kept", _B), ("bytes_resident", _B),
    ],
    "evaluations": [
        ("run_id", _S), ("doc_id", _S), ("question_idx", _I), ("metric", _S), ("value", _F),
        ("reference_run_id", _S),
    ],
    "input_errors": [
        ("run_id", _S), ("source", _S), ("row_number", _I), ("doc_id", _S), ("field", _S), ("message", _S),
    ],
}
PRIMARY_KEYS = {"runs": "run_id", "documents": "content_sha256, doc_id"}

MEMORY_SAVINGS_SQL = """
CREATE OR REPLACE VIEW memory_savings AS
SELECT r.run_id, r.press, r.compression_ratio, r.head_budget, r.budget,
       count(DISTINCT (m.content_sha256, m.doc_id)) AS n_documents,
       sum(m.bytes_full)::BIGINT AS bytes_full,
       sum(m.bytes_kept)::BIGINT AS bytes_kept,
       sum(m.bytes_resident)::BIGINT AS bytes_resident,
       sum(m.bytes_kept) / nullif(sum(m.bytes_full), 0) AS kept_share,
       1 - sum(m.bytes_kept) / nullif(sum(m.bytes_full), 0) AS saved_share,
       sum(m.bytes_resident) / nullif(sum(m.bytes_full), 0) AS resident_share,
       (sum(m.bytes_full) - sum(m.bytes_kept)) / 1048576.0 AS saved_mib
FROM runs r JOIN layer_memory m ON m.run_id = r.run_id
GROUP BY r.run_id, r.press, r.compression_ratio, r.head_budget, r.budget
"""

LAYER_SAVINGS_SQL = """
CREATE OR REPLACE VIEW layer_savings AS
SELECT r.run_id, r.press, r.compression_ratio, r.head_budget, r.budget, m.layer,
       count(*) AS n_documents,
       avg(m.tokens_seen) AS tokens_seen,
       avg(m.kept_min) AS kept_min,
       avg(m.kept_max) AS kept_max,
       avg(m.kept_mean) AS kept_mean,
       sum(m.bytes_full)::BIGINT AS bytes_full,
       sum(m.bytes_kept)::BIGINT AS bytes_kept,
       sum(m.bytes_resident)::BIGINT AS bytes_resident,
       sum(m.bytes_kept) / nullif(sum(m.bytes_full), 0) AS kept_share,
       1 - sum(m.bytes_kept) / nullif(sum(m.bytes_full), 0) AS saved_share,
       sum(m.bytes_resident) / nullif(sum(m.bytes_full), 0) AS resident_share,
       (sum(m.bytes_full) - sum(m.bytes_kept)) / 1048576.0 AS saved_mib
FROM runs r JOIN layer_memory m ON m.run_id = r.run_id
GROUP BY r.run_id, r.press, r.compression_ratio, r.head_budget, r.budget, m.layer
"""

# Two kinds of evaluation rows: agreement with a twin's output (reference_run_id names the twin; the
# twin's own value would be trivially perfect) and scores against gold (reference_run_id NULL; then the
# twin's score on the same document and question is put beside it as full_value).
QUALITY_VS_FULL_SQL = """
CREATE OR REPLACE VIEW quality_vs_full AS
WITH twins AS (
    SELECT r.run_id, f.run_id AS twin_id
    FROM runs r JOIN runs f ON f.config_hash = r.reference_config_hash AND f.press = 'no_press'
    WHERE r.press <> 'no_press'
),
pairs AS (
    SELECT t.run_id, t.twin_id AS reference_run_id, e.metric, e.value, CAST(NULL AS DOUBLE) AS full_value
    FROM twins t JOIN evaluations e ON e.run_id = t.run_id AND e.reference_run_id = t.twin_id
    UNION ALL
    SELECT t.run_id, t.twin_id, e.metric, e.value, fe.value
    FROM twins t
    JOIN evaluations e ON e.run_id = t.run_id AND e.reference_run_id IS NULL
    JOIN evaluations fe ON fe.run_id = t.twin_id AND fe.reference_run_id IS NULL AND fe.metric = e.metric
        AND fe.doc_id = e.doc_id AND fe.question_idx IS NOT DISTINCT FROM e.question_idx
)
SELECT r.run_id, p.reference_run_id, r.press, r.compression_ratio, r.head_budget, r.budget, p.metric,
       avg(p.value) AS mean_value,
       avg(p.full_value) AS full_value,
       avg(p.value - p.full_value) AS delta,
       count(*) AS n,
       ms.kept_share
FROM pairs p
JOIN runs r ON r.run_id = p.run_id
LEFT JOIN memory_savings ms ON ms.run_id = p.run_id
GROUP BY r.run_id, p.reference_run_id, r.press, r.compression_ratio, r.head_budget, r.budget, p.metric,
         ms.kept_share
"""

VIEWS = {"memory_savings": MEMORY_SAVINGS_SQL, "layer_savings": LAYER_SAVINGS_SQL,
         "quality_vs_full": QUALITY_VS_FULL_SQL}


class StoreError(RuntimeError):
    """A store problem a user can act on; the message is one line naming the file."""


def _one_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _ddl(name: str) -> str:
    cols = [f"{c} {t[0]}" for c, t in TABLES[name]]
    if name in PRIMARY_KEYS:
        cols.append(f"PRIMARY KEY ({PRIMARY_KEYS[name]})")
    return f"CREATE TABLE IF NOT EXISTS {name} ({', '.join(cols)})"


def _arrow(name: str, rows: list[dict]) -> pa.Table:
    schema = pa.schema([(c, t[1]) for c, t in TABLES[name]])
    return pa.Table.from_pylist(rows, schema=schema)


def new_run_id() -> str:
    # Time first so run ids sort by start; random suffix so two runs in one second differ.
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S") + "-" + secrets.token_hex(3)


def _utcnow() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


def outputs_table(run_id: str, r: DocumentResult) -> pa.Table:
    """One row per question; a document without questions (failed early) still gets one row for its status."""
    doc = {
        "run_id": run_id, "doc_id": r.doc_id, "content_sha256": r.content_sha256, "n_tokens": r.n_tokens,
        "prefill_s": r.prefill_s, "compress_s": r.compress_s, "prefill_tok_s": r.prefill_tok_s,
        "peak_prefill_bytes": r.peak_prefill_bytes, "peak_decode_bytes": r.peak_decode_bytes,
    }
    if not r.questions:
        return _arrow("outputs", [{**doc, "status": r.status, "error": r.error}])
    rows = []
    for q in r.questions:
        bad_doc = r.status != OK  # a failed document taints every question answered from it
        rows.append({
            **doc, "question_idx": q.question_idx, "question": q.question, "output": q.output, "gold": q.gold,
            "status": r.status if bad_doc else q.status, "error": q.error or r.error,
            "n_question_tokens": q.n_question_tokens, "n_generated": q.n_generated, "decode_s": q.decode_s,
            "decode_tok_s": q.decode_tok_s,
        })
    return _arrow("outputs", rows)


def layer_memory_table(run_id: str, r: DocumentResult) -> pa.Table:
    ids = {"run_id": run_id, "doc_id": r.doc_id, "content_sha256": r.content_sha256}
    return _arrow("layer_memory", [{**ids, **lm.as_dict()} for lm in r.layers])


class Store:
    """``with Store("runs.duckdb") as db: ...``; ``Store(path, read_only=True)`` for queries only."""

    def __init__(self, path: Union[str, Path], read_only: bool = False):
        self.path = Path(path)
        self.read_only = read_only
        self._lock = threading.RLock()  # one DuckDB connection is not safe to share across threads
        if read_only and not self.path.exists():
            raise StoreError(f"{self.path}: no such database file")
        if not read_only:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.con = duckdb.connect(str(self.path), read_only=read_only)
        except duckdb.IOException as e:
            if "lock" in str(e).lower():
                raise StoreError(
                    f"{self.path}: another process holds this database (DuckDB allows one writer); "
                    "wait for it to finish or stop it"
                ) from None
            raise StoreError(f"{self.path}: cannot open database ({_one_line(e)})") from None
        except duckdb.Error as e:
            raise StoreError(f"{self.path}: cannot open database ({_one_line(e)})") from None
        try:
            self._check_schema()
        except BaseException:
            self.con.close()
            raise

    def _check_schema(self) -> None:
        if not self.read_only:
            self.con.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER)")
            if self.con.execute("SELECT count(*) FROM schema_version").fetchall()[0][0] == 0:
                self.con.execute("INSERT INTO schema_version VALUES (?)", [SCHEMA_VERSION])
        has = self.con.execute(
            "SELECT count(*) FROM duckdb_tables() WHERE table_name = 'schema_version' "
            "AND database_name = current_database()"
        ).fetchall()[0][0]
        found = self.con.execute("SELECT max(version) FROM schema_version").fetchall()[0][0] if has else None
        if found is not None and found != SCHEMA_VERSION:
            raise StoreError(f"{self.path}: schema version {found}, this code reads version {SCHEMA_VERSION}")
        if not self.read_only:
            for name in TABLES:
                self.con.execute(_ddl(name))
            for sql in VIEWS.values():
                self.con.execute(sql)

    # -- lifecycle --------------------------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            self.con.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _writable(self) -> None:
        if self.read_only:
            raise StoreError(f"{self.path}: store is open read-only; writes are refused")

    # -- runs -------------------------------------------------------------------------------------
    def start_run(self, config: RunConfig, input: str) -> str:
        self._writable()
        run_id = new_run_id()
        row = {
            "run_id": run_id, "created_at": _utcnow(), "task": config.task, "model": config.model,
            "press": config.press, "compression_ratio": config.compression_ratio, "budget": config.budget,
            "head_budget": config.head_budget, "prefill_step_size": config.prefill_step_size,
            "max_new_tokens": config.max_new_tokens, "config_json": config.canonical_json(),
            "config_hash": config.config_hash(), "reference_config_hash": config.reference().config_hash(),
            "code_version": code_version(), "input": str(input), "status": "running",
        }
        with self._lock:
            self._insert("runs", _arrow("runs", [row]))
        return run_id

    def finish_run(self, run_id: str, status: str) -> None:
        """Close a run; n_errors counts skipped input rows plus documents that did not end ok."""
        self._writable()
        if status not in RUN_STATUSES:
            raise ValueError(f"status must be one of {RUN_STATUSES}, not {status!r}")
        with self._lock:
            self.con.execute(
                """
                UPDATE runs SET status = $status, finished_at = $now,
                  n_documents = (SELECT count(DISTINCT (content_sha256, doc_id)) FROM outputs WHERE run_id = $id),
                  n_errors = (SELECT count(*) FROM input_errors WHERE run_id = $id)
                           + (SELECT count(DISTINCT (content_sha256, doc_id)) FROM outputs
                              WHERE run_id = $id AND status <> $ok)
                WHERE run_id = $id
                """,
                {"status": status, "now": _utcnow(), "id": run_id, "ok": OK},
            )

    def done_content_hashes(self, config: RunConfig) -> set[str]:
        """Documents already answered ok (every question) under this exact configuration, in any run."""
        with self._lock:
            rows = self.con.execute(
                """
                SELECT DISTINCT o.content_sha256 FROM outputs o JOIN runs r ON r.run_id = o.run_id
                WHERE r.config_hash = ?
                GROUP BY o.run_id, o.content_sha256, o.doc_id HAVING bool_and(o.status = ?)
                """,
                [config.config_hash(), OK],
            ).fetchall()
        return {h for (h,) in rows}

    # -- writes -----------------------------------------------------------------------------------
    def _insert(self, table: str, data: pa.Table) -> None:
        if data.num_rows == 0:
            return
        name = f"_arrow_{table}"
        self.con.register(name, data)
        try:
            self.con.execute(f"INSERT INTO {table} BY NAME SELECT * FROM {name}")
        finally:
            self.con.unregister(name)

    def _transaction(self, work) -> None:
        with self._lock:
            self.con.execute("BEGIN TRANSACTION")
            try:
                work()
            except BaseException:
                self.con.execute("ROLLBACK")
                raise
            self.con.execute("COMMIT")

    def write_document(self, run_id: str, result: DocumentResult) -> None:
        """All rows of one document in one transaction, replacing any earlier write of the same (run, doc)."""
        self._writable()
        key = [run_id, result.doc_id, result.content_sha256]

        def work() -> None:
            for table in ("outputs", "layer_memory"):
                self.con.execute(
                    f"DELETE FROM {table} WHERE run_id = ? AND doc_id = ? AND content_sha256 = ?", key
                )
            self._insert("outputs", outputs_table(run_id, result))
            self._insert("layer_memory", layer_memory_table(run_id, result))
            # n_tokens 0 means the document failed before tokenizing: keep a count we already have.
            self.con.execute(
                """
                INSERT INTO documents VALUES (?, ?, ?, ?, ?)
                ON CONFLICT (content_sha256, doc_id) DO UPDATE SET
                  n_chars = excluded.n_chars,
                  n_tokens = CASE WHEN excluded.n_tokens > 0 THEN excluded.n_tokens ELSE n_tokens END,
                  title = coalesce(excluded.title, title)
                """,
                [result.doc_id, result.content_sha256, result.n_chars, result.n_tokens, result.title],
            )

        self._transaction(work)

    def write_input_errors(self, run_id: str, errors: Iterable[Any]) -> None:
        """``RowError``s of one run; writing the same (source, row) again replaces it."""
        self._writable()
        data = _arrow("input_errors", [
            {"run_id": run_id, "source": e.source, "row_number": e.row, "doc_id": e.doc_id, "field": e.field,
             "message": e.message}
            for e in errors
        ])

        self._replace("input_errors", data, "e.run_id = n.run_id AND e.source = n.source AND e.row_number = n.row_number")

    def write_evaluations(self, rows: Union[pa.Table, Iterable[Mapping[str, Any]]]) -> None:
        """Evaluation rows (dicts or an Arrow table with the ``evaluations`` columns); re-writing replaces."""
        self._writable()
        cols = [c for c, _ in TABLES["evaluations"]]
        data = rows.select(cols) if isinstance(rows, pa.Table) else _arrow("evaluations", [
            {c: r.get(c) for c in cols} for r in rows
        ])
        data = data.cast(pa.schema([(c, t[1]) for c, t in TABLES["evaluations"]]))

        self._replace(
            "evaluations", data,
            "e.run_id = n.run_id AND e.doc_id = n.doc_id AND e.metric = n.metric "
            "AND e.question_idx IS NOT DISTINCT FROM n.question_idx "
            "AND e.reference_run_id IS NOT DISTINCT FROM n.reference_run_id",
        )

    def _replace(self, table: str, data: pa.Table, match: str) -> None:
        """In one transaction, delete the rows ``data`` replaces (``match`` relates old ``e`` to new ``n``)
        and insert ``data``: re-writing the same rows never duplicates them."""

        def work() -> None:
            self.con.register("_new_rows", data)
            try:
                self.con.execute(f"DELETE FROM {table} e USING _new_rows n WHERE {match}")
            finally:
                self.con.unregister("_new_rows")
            self._insert(table, data)

        self._transaction(work)

    # -- reads ------------------------------------------------------------------------------------
    def query(self, sql: str, params: Optional[Union[list, dict]] = None) -> pa.Table:
        """Run SQL and return the result as Arrow; on a read-only store any write is a ``StoreError``."""
        try:
            with self._lock:
                rel = self.con.sql(sql, params=params)
                if rel is None:  # statements without a result on older DuckDB
                    return pa.table({})
                return rel.to_arrow_table() if hasattr(rel, "to_arrow_table") else rel.arrow()
        except duckdb.Error as e:
            msg = _one_line(e)
            if self.read_only and "read-only" in msg:
                raise StoreError(f"{self.path}: store is open read-only; this statement writes ({msg})") from None
            raise StoreError(f"{self.path}: query failed: {msg}") from None
