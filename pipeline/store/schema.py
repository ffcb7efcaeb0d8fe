"""The tables (one column list each drives the DDL and the Arrow batches), their version, and the check
that creates or migrates a store before anything is written to it."""

from __future__ import annotations

from collections import defaultdict

import duckdb
import pyarrow as pa

from pipeline.compat import COLUMN_DEFAULTS, COPIED, DERIVED
from pipeline.store.errors import StoreError
from pipeline.store.lake import is_locked
from pipeline.store.views import VIEWS

# Version 2 added runs.prefill/host/pid/pid_started_at and the peak KV columns; older stores are migrated
# in place by adding the missing columns (every change so far only adds columns and views).
SCHEMA_VERSION = 2
RUN_STATUSES = ("running", "completed", "failed", "interrupted")

# (name, DuckDB type, Arrow type): one list per table drives both the DDL and the Arrow batches.
_S = ("VARCHAR", pa.string())
_I = ("INTEGER", pa.int32())
_B = ("BIGINT", pa.int64())
_F = ("DOUBLE", pa.float64())
_T = ("TIMESTAMP", pa.timestamp("us"))
_BOOL = ("BOOLEAN", pa.bool_())

TABLES: dict[str, list[tuple[str, tuple[str, pa.DataType]]]] = {
    "runs": [
        ("run_id", _S), ("created_at", _T), ("finished_at", _T), ("task", _S), ("model", _S), ("press", _S),
        ("compression_ratio", _F), ("budget", _I), ("head_budget", _S), ("prefill_step_size", _I),
        ("max_new_tokens", _I), ("config_json", _S), ("config_hash", _S), ("reference_config_hash", _S),
        ("code_version", _S), ("input", _S), ("status", _S), ("n_documents", _I), ("n_errors", _I),
        ("prefill", _S), ("host", _S), ("pid", _I), ("pid_started_at", _F),  # pid_started_at: epoch seconds
        ("kv_bits", _I),  # NULL: the model's dtype
        ("kv_group_size", _I), ("kv_hadamard", _BOOL),  # nestedkv.quant.KVQuant's other settings
        ("saw_questions", _BOOL),  # its compression read the document's questions (a question-aware press)
    ],
    "documents": [("doc_id", _S), ("content_sha256", _S), ("n_chars", _B), ("n_tokens", _I), ("title", _S)],
    "outputs": [
        ("run_id", _S), ("doc_id", _S), ("content_sha256", _S), ("question_idx", _I), ("question", _S),
        ("output", _S), ("gold", _S), ("status", _S), ("error", _S), ("n_tokens", _I),
        ("n_question_tokens", _I), ("n_generated", _I), ("prefill_s", _F), ("compress_s", _F),
        ("decode_s", _F), ("prefill_tok_s", _F), ("decode_tok_s", _F), ("peak_prefill_bytes", _B),
        ("peak_decode_bytes", _B), ("peak_kv_prefill_bytes", _B), ("peak_kv_decode_bytes", _B),
        ("read_mode", _S),  # how a document was read: whole, stream (past the window) or truncate
        ("prefill_compute_s", _F),  # prefill_s as computed: differs when loaded from the prefill cache
        ("memory_plan", _S),  # how the memory plan read it (whole, streaming, parts of N) within --memory-limit
        ("planned_peak_bytes", _B),  # the plan's estimate of the document's peak
    ],
    "layer_memory": [
        ("run_id", _S), ("doc_id", _S), ("content_sha256", _S), ("layer", _I), ("n_kv_heads", _I),
        ("head_dim", _I), ("dtype", _S), ("tokens_seen", _I), ("kept_min", _I), ("kept_max", _I),
        ("kept_mean", _F), ("bytes_full", _B), ("bytes_kept", _B), ("bytes_resident", _B),
        ("peak_prefill_kv_bytes", _B), ("peak_decode_kv_bytes", _B),
        ("kind", _S),  # full (compressed), sliding (window) or state: the layer's cache
        ("adapted", _S),  # what the layer ran differently from the run's press, and why (NULL: as given)
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
# Tables created on first use, not by every open: the suite's questions (``pipeline.suite``).
ON_DEMAND_TABLES: dict[str, list[tuple[str, tuple[str, pa.DataType]]]] = {
    "suite_questions": [
        ("doc_id", _S), ("content_sha256", _S), ("question_idx", _I), ("task", _S), ("length", _I),
        ("n_tokens", _I), ("kind", _S), ("parts", ("VARCHAR[]", pa.list_(pa.string()))),
    ],
}


def columns(name: str) -> list[tuple[str, tuple[str, pa.DataType]]]:
    return TABLES[name] if name in TABLES else ON_DEMAND_TABLES[name]


def arrow_schema(name: str) -> pa.Schema:
    return pa.schema([(c, t[1]) for c, t in columns(name)])


def ddl(name: str, keys: bool = True) -> str:
    """CREATE TABLE for ``name``; ``keys=False`` for DuckLake, which has no primary keys."""
    cols = [f"{c} {t[0]}" for c, t in columns(name)]
    if keys and name in PRIMARY_KEYS:
        cols.append(f"PRIMARY KEY ({PRIMARY_KEYS[name]})")
    return f"CREATE TABLE IF NOT EXISTS {name} ({', '.join(cols)})"


def check(con: duckdb.DuckDBPyConnection, path) -> None:
    """Refuse a file that is not ours, or from newer code, before writing anything."""
    q = lambda sql: con.execute(sql).fetchall()  # noqa: E731
    objects = q(
        "SELECT table_name FROM duckdb_tables() WHERE database_name = current_database() "
        "UNION ALL SELECT view_name FROM duckdb_views() WHERE NOT internal "
        "AND database_name = current_database()"
    )
    names = {n for (n,) in objects}
    found = None
    if "schema_version" in names:
        try:
            found = q("SELECT max(version) FROM schema_version")[0][0]
        except duckdb.Error as e:
            if is_locked(e):  # a lake's catalog mid-commit: the caller's retry waits for it
                raise
            raise StoreError(f"{path}: not a nestedkv store (its schema_version table is not ours); "
                             "refusing to use it") from None
    if found is None and names - {"schema_version"}:
        raise StoreError(f"{path}: not a nestedkv store (it holds tables but no schema version); "
                         "refusing to use it")
    if found is not None and not 1 <= found <= SCHEMA_VERSION:
        raise StoreError(f"{path}: schema version {found}, this code reads versions 1 to {SCHEMA_VERSION}")


def create_or_migrate(con: duckdb.DuckDBPyConnection, keys: bool) -> None:
    """Tables, views and version, inside the caller's transaction; ``keys=False`` on a lake."""
    con.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER)")
    have = set(con.execute(
        "SELECT table_name, column_name FROM duckdb_columns() WHERE database_name = current_database()"
    ).fetchall())
    tables = {t for t, _ in have}
    updates = defaultdict(list)
    for name, cols in TABLES.items():
        con.execute(ddl(name, keys=keys))
        for c, t in cols:
            if name in tables and (name, c) not in have:  # a column added since the table was created
                default = COLUMN_DEFAULTS.get((name, c))
                con.execute(f"ALTER TABLE {name} ADD COLUMN {c} {t[0]}" + (f" DEFAULT {default}" if default else ""))
                if name == "runs" and c in DERIVED:
                    updates[name].append(f"{c} = {DERIVED[c].format(r='')}")
                if (name, c) in COPIED:
                    updates[name].append(f"{c} = {COPIED[(name, c)]}")
    for name, sets in updates.items():  # after every ALTER: DuckDB 1.5 fails the commit of an ALTER after an UPDATE
        con.execute(f"UPDATE {name} SET {', '.join(sets)}")
    for sql in VIEWS.values():  # replaced on every writable open, so view changes reach old stores
        con.execute(sql)
    con.execute("DELETE FROM schema_version")
    con.execute("INSERT INTO schema_version VALUES (?)", [SCHEMA_VERSION])
