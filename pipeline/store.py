"""The DuckDB store: runs, outputs and per-layer KV memory, written one document per transaction.

One writer per file (DuckDB's own rule); readers open the file read-only, inside DuckDB's sandbox (no files
but the store, no extensions, locked settings) and with one SELECT per query. Every write of a document
first deletes that (run, document)'s rows, so a retried task replaces instead of duplicating. A run records
its host and pid; a writer that opens the store marks this host's ``running`` runs whose process is gone
``interrupted``.

``ducklake:...`` stores (``pipeline.lake``) take several writers, on several machines: the same tables and
views without primary keys, the one upsert as DELETE + INSERT inside the document's transaction, and a
transaction that loses a commit race to another writer re-run whole.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Union

import duckdb
import pyarrow as pa

from pipeline import lake
from pipeline.config import RunConfig, code_version
from pipeline.results import OK, DocumentResult

log = logging.getLogger(__name__)

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

TABLES: dict[str, list[tuple[str, tuple[str, pa.DataType]]]] = {
    "runs": [
        ("run_id", _S), ("created_at", _T), ("finished_at", _T), ("task", _S), ("model", _S), ("press", _S),
        ("compression_ratio", _F), ("budget", _I), ("head_budget", _S), ("prefill_step_size", _I),
        ("max_new_tokens", _I), ("config_json", _S), ("config_hash", _S), ("reference_config_hash", _S),
        ("code_version", _S), ("input", _S), ("status", _S), ("n_documents", _I), ("n_errors", _I),
        ("prefill", _S), ("host", _S), ("pid", _I), ("pid_started_at", _F),  # pid_started_at: epoch seconds
        ("kv_bits", _I),  # NULL: the model's dtype
    ],
    "documents": [("doc_id", _S), ("content_sha256", _S), ("n_chars", _B), ("n_tokens", _I), ("title", _S)],
    "outputs": [
        ("run_id", _S), ("doc_id", _S), ("content_sha256", _S), ("question_idx", _I), ("question", _S),
        ("output", _S), ("gold", _S), ("status", _S), ("error", _S), ("n_tokens", _I),
        ("n_question_tokens", _I), ("n_generated", _I), ("prefill_s", _F), ("compress_s", _F),
        ("decode_s", _F), ("prefill_tok_s", _F), ("decode_tok_s", _F), ("peak_prefill_bytes", _B),
        ("peak_decode_bytes", _B), ("peak_kv_prefill_bytes", _B), ("peak_kv_decode_bytes", _B),
    ],
    "layer_memory": [
        ("run_id", _S), ("doc_id", _S), ("content_sha256", _S), ("layer", _I), ("n_kv_heads", _I),
        ("head_dim", _I), ("dtype", _S), ("tokens_seen", _I), ("kept_min", _I), ("kept_max", _I),
        ("kept_mean", _F), ("bytes_full", _B), ("bytes_kept", _B), ("bytes_resident", _B),
        ("peak_prefill_kv_bytes", _B), ("peak_decode_kv_bytes", _B),
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

# The byte sums both savings views report, per run or per run and layer.
_RUN_KEY = "r.run_id, r.press, r.prefill, r.compression_ratio, r.head_budget, r.budget, r.kv_bits"
_SAVED_BYTES = """
       sum(m.bytes_full)::BIGINT AS bytes_full,
       sum(m.bytes_kept)::BIGINT AS bytes_kept,
       sum(m.bytes_resident)::BIGINT AS bytes_resident,
       sum(m.bytes_kept) / nullif(sum(m.bytes_full), 0) AS kept_share,
       1 - sum(m.bytes_kept) / nullif(sum(m.bytes_full), 0) AS saved_share,
       sum(m.bytes_resident) / nullif(sum(m.bytes_full), 0) AS resident_share,
       (sum(m.bytes_full) - sum(m.bytes_kept)) / 1048576.0 AS saved_mib
FROM runs r JOIN layer_memory m ON m.run_id = r.run_id"""

MEMORY_SAVINGS_SQL = f"""
CREATE OR REPLACE VIEW memory_savings AS
SELECT {_RUN_KEY},
       count(DISTINCT (m.content_sha256, m.doc_id)) AS n_documents,{_SAVED_BYTES}
GROUP BY {_RUN_KEY}
"""

LAYER_SAVINGS_SQL = f"""
CREATE OR REPLACE VIEW layer_savings AS
SELECT {_RUN_KEY}, m.layer,
       count(*) AS n_documents,
       avg(m.tokens_seen) AS tokens_seen,
       avg(m.kept_min) AS kept_min,
       avg(m.kept_max) AS kept_max,
       avg(m.kept_mean) AS kept_mean,{_SAVED_BYTES}
GROUP BY {_RUN_KEY}, m.layer
"""

# Two kinds of evaluation rows: agreement with a twin's output (reference_run_id names the twin; the
# twin's own value would be trivially perfect) and scores against gold (reference_run_id NULL; then the
# twin's score on the same document and question is put beside it as full_value).
QUALITY_VS_FULL_SQL = """
CREATE OR REPLACE VIEW quality_vs_full AS
WITH twins AS (
    SELECT r.run_id, f.run_id AS twin_id
    FROM runs r JOIN runs f ON f.config_hash = r.reference_config_hash AND f.press = 'no_press'
    WHERE r.config_hash <> r.reference_config_hash
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
SELECT r.run_id, p.reference_run_id, r.press, r.compression_ratio, r.head_budget, r.budget, r.kv_bits, p.metric,
       avg(p.value) AS mean_value,
       avg(p.full_value) AS full_value,
       avg(p.value - p.full_value) AS delta,
       count(*) AS n,
       ms.kept_share,
       ms.resident_share
FROM pairs p
JOIN runs r ON r.run_id = p.run_id
LEFT JOIN memory_savings ms ON ms.run_id = p.run_id
GROUP BY r.run_id, p.reference_run_id, r.press, r.compression_ratio, r.head_budget, r.budget, r.kv_bits, p.metric,
         ms.kept_share, ms.resident_share
"""

# Peak KV bytes per document come from outputs (one value per document, repeated on its question rows) or,
# where those are not filled, from the sum of its layer_memory peaks; documents without either are left out.
# 0 means not measured (the results' default): a document that held tokens never peaks at 0 bytes.
PEAK_SAVINGS_SQL = """
CREATE OR REPLACE VIEW peak_savings AS
WITH docs AS (
    SELECT run_id, doc_id, content_sha256,
           max(peak_kv_prefill_bytes) AS prefill_peak, max(peak_kv_decode_bytes) AS decode_peak
    FROM outputs GROUP BY run_id, doc_id, content_sha256
),
layers AS (
    SELECT run_id, doc_id, content_sha256, sum(bytes_full) AS bytes_full,
           sum(peak_prefill_kv_bytes) AS prefill_peak, sum(peak_decode_kv_bytes) AS decode_peak
    FROM layer_memory GROUP BY run_id, doc_id, content_sha256
),
per_doc AS (
    SELECT l.run_id, l.bytes_full,
           coalesce(nullif(d.prefill_peak, 0), nullif(l.prefill_peak, 0)) AS prefill_peak,
           coalesce(nullif(d.decode_peak, 0), nullif(l.decode_peak, 0)) AS decode_peak
    FROM layers l LEFT JOIN docs d USING (run_id, doc_id, content_sha256)
)
SELECT r.run_id, r.press, r.prefill, r.compression_ratio, r.head_budget, r.budget, r.kv_bits,
       count(*) AS n_documents,
       sum(p.bytes_full)::BIGINT AS bytes_full,
       sum(p.prefill_peak)::BIGINT AS peak_prefill_kv_bytes,
       sum(p.decode_peak)::BIGINT AS peak_decode_kv_bytes,
       sum(p.prefill_peak) / nullif(sum(p.bytes_full) FILTER (WHERE p.prefill_peak IS NOT NULL), 0)
           AS prefill_peak_share,
       sum(p.decode_peak) / nullif(sum(p.bytes_full) FILTER (WHERE p.decode_peak IS NOT NULL), 0)
           AS decode_peak_share,
       (sum(p.bytes_full) FILTER (WHERE p.prefill_peak IS NOT NULL) - sum(p.prefill_peak)) / 1048576.0
           AS prefill_saved_mib,
       (sum(p.bytes_full) FILTER (WHERE p.decode_peak IS NOT NULL) - sum(p.decode_peak)) / 1048576.0
           AS decode_saved_mib
FROM runs r JOIN per_doc p ON p.run_id = r.run_id
WHERE p.prefill_peak IS NOT NULL OR p.decode_peak IS NOT NULL
GROUP BY r.run_id, r.press, r.prefill, r.compression_ratio, r.head_budget, r.budget, r.kv_bits
"""

VIEWS = {"memory_savings": MEMORY_SAVINGS_SQL, "layer_savings": LAYER_SAVINGS_SQL,
         "quality_vs_full": QUALITY_VS_FULL_SQL, "peak_savings": PEAK_SAVINGS_SQL}

# Read-only connections: DuckDB's own sandbox. No file but the store itself (COPY TO, EXPORT, ATTACH,
# read_text, INSTALL all fail), no extension loading, and no SET that could undo it.
SANDBOX = {
    "enable_external_access": False,
    "autoinstall_known_extensions": False,
    "autoload_known_extensions": False,
    "allow_community_extensions": False,
    "lock_configuration": True,
}
# What a read-only query may be, by DuckDB's parser. SELECT includes WITH, VALUES, FROM-first queries,
# DESCRIBE, SHOW and SUMMARIZE (and table functions such as pragma_table_info('runs')).
READ_ONLY_STATEMENTS = frozenset({duckdb.StatementType.SELECT})

_LOCK_BACKOFF_S = (0.1, 5.0)  # first pause, longest pause between tries of a held lock
# A batch writing a DuckDB file opens it only for each transaction, so readers get in between documents.
# Between them, readers may hold the file: the writer waits for them (a query stops at its --timeout).
REOPEN_WAIT_S = 600.0
REOPEN_BACKOFF_S = (0.02, 0.5)
READER_WAIT_S = 10.0  # how long ``nkv query`` waits for a batch's transaction to end (milliseconds, usually)
# A lake transaction that lost a commit race to another writer is re-run: first pause, longest pause, tries.
_COMMIT_RETRY = (0.05, 2.0, 30)


EVALUATION_MATCH = ("e.run_id = n.run_id AND e.doc_id = n.doc_id AND e.metric = n.metric "
                    "AND e.question_idx IS NOT DISTINCT FROM n.question_idx "
                    "AND e.reference_run_id IS NOT DISTINCT FROM n.reference_run_id")


class StoreError(RuntimeError):
    """A store problem a user can act on; the message is one line naming the file."""


class StoreWriteError(StoreError):
    """A write failed (disk full, a table that no longer takes our rows): a batch stops at once, since the
    next document's write would fail the same way; what was committed before stays."""


class StoreLockedError(StoreError):
    """Another process holds the store (still, after ``wait_s``)."""


def _one_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _ddl(name: str, keys: bool = True) -> str:
    """CREATE TABLE for ``name``; ``keys=False`` for DuckLake, which has no primary keys."""
    cols = [f"{c} {t[0]}" for c, t in TABLES[name]]
    if keys and name in PRIMARY_KEYS:
        cols.append(f"PRIMARY KEY ({PRIMARY_KEYS[name]})")
    return f"CREATE TABLE IF NOT EXISTS {name} ({', '.join(cols)})"


def _arrow(name: str, rows: list[dict]) -> pa.Table:
    schema = pa.schema([(c, t[1]) for c, t in TABLES[name]])
    try:
        return pa.Table.from_pylist(rows, schema=schema)
    except (pa.ArrowException, OverflowError, TypeError, ValueError) as e:
        # Name the column (e.g. an INTEGER column given a value past 2**31 - 1) instead of Arrow's traceback.
        for c, t in TABLES[name]:
            try:
                pa.array([r.get(c) for r in rows], type=t[1])
            except (pa.ArrowException, OverflowError, TypeError, ValueError) as col_e:
                raise StoreError(f"cannot store {name}.{c} ({t[0]}): {_one_line(col_e)}") from None
        raise StoreError(f"cannot store {name} rows: {_one_line(e)}") from None


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
        # getattr: filled once DocumentResult carries peak KV bytes; NULL before.
        "peak_kv_prefill_bytes": getattr(r, "peak_kv_prefill_bytes", None),
        "peak_kv_decode_bytes": getattr(r, "peak_kv_decode_bytes", None),
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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    except OSError:
        return False
    return True


def process_started_at(pid: int) -> Optional[float]:
    """When process ``pid`` started (epoch seconds), or None when it does not exist or cannot be told.

    Tells a reused pid from the process that recorded it: psutil where installed, else Linux's /proc.
    """
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        try:
            return psutil.Process(pid).create_time()
        except Exception:  # NoSuchProcess, AccessDenied, ...
            return None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime; the name may hold spaces
        btime = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                     if line.startswith("btime "))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def process_is_the_run(pid: Optional[int], started_at: Optional[float]) -> bool:
    """Whether the process that started a run may still be running it."""
    if pid is None or not _pid_alive(pid):
        return False
    now = process_started_at(pid)
    # Start times are read at clock-tick and boot-time (whole second) resolution.
    return started_at is None or now is None or abs(now - started_at) < 2.0


def _is_lock_error(e: BaseException) -> bool:
    return isinstance(e, duckdb.IOException) and "lock" in str(e).lower()


class Store:
    """``with Store("runs.duckdb") as db: ...``; ``Store(path, read_only=True)`` for queries only.

    ``wait_s``: when another process holds the file, retry with backoff for up to that many seconds,
    calling ``on_wait(waited_s, wait_s)`` (and logging) before each pause, then fail as without it.
    After a writable open, ``interrupted_runs`` lists the run ids just marked ``interrupted``.

    ``path`` may name a lake, ``ducklake:sqlite:meta.db`` or ``ducklake:postgres:CONNINFO``; ``data_path``
    (a folder or URL for its Parquet files) is needed when the lake is created and ignored after.
    ``commit_retries`` counts the lake transactions this store re-ran after losing a commit race.
    """

    def __init__(self, path: Union[str, Path], read_only: bool = False, wait_s: float = 0.0,
                 on_wait: Optional[Callable[[float, float], None]] = None, data_path: Optional[str] = None):
        self.read_only = read_only
        self.interrupted_runs: list[str] = []
        self.commit_retries = 0
        self._lock = threading.RLock()  # one DuckDB connection is not safe to share across threads
        self._con = None
        self._depth = 0  # nested uses of the connection (``_session``)
        self._between = False  # close the connection between uses (a writer on a DuckDB file)
        self._writer_fd: Optional[int] = None  # holds the batch's writer lock (``_take_writer_lock``)
        self._lock_created = False
        try:
            self.lake = lake.LakeSpec.parse(str(path)) if lake.is_lake(path) else None
        except lake.LakeSetupError as e:
            raise StoreError(str(e)) from None
        if self.lake is not None:
            self.path = str(self.lake)
            self._con = self._connect_lake(data_path)
            self._set_up(created=False)
            return
        if str(path).strip().startswith(":memory:"):
            raise StoreError(f"{path}: an in-memory database would lose every result when the command ends; "
                             "give a file (--db runs.duckdb)")
        self.path = Path(path).expanduser()
        if read_only and not self.path.exists():
            raise StoreError(f"{self.path}: no such database file")
        self._made_dirs: list[Path] = []
        if not read_only:
            self._made_dirs = [p for p in [self.path.parent, *self.path.parent.parents] if not p.exists()]
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise StoreError(
                    f"{self.path}: cannot create the folder {self.path.parent} ({e.strerror or _one_line(e)})"
                ) from None
        created = not self.path.exists()
        try:
            self._con = self._connect(wait_s, on_wait, writer_lock=not read_only)
        except StoreLockedError:
            raise  # the file is someone else's now
        except StoreError:
            self._remove_if(created)
            raise
        self._set_up(created)
        if not read_only:  # from now on the file is opened for each transaction only
            self._between = True
            self._release()

    @property
    def con(self):
        """The DuckDB connection, opened again when a writer released it between transactions."""
        if self._con is None:
            self._con = self._connect(REOPEN_WAIT_S, None, backoff=REOPEN_BACKOFF_S)
        return self._con

    @contextmanager
    def _session(self):
        """One use of the connection (a transaction, a query); a writer on a DuckDB file closes it after
        the outermost use, so readers can open the file between documents."""
        with self._lock:
            self._depth += 1
            try:
                yield self.con
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self._release()

    def _release(self) -> None:
        if self._between and self._con is not None:
            con, self._con = self._con, None
            con.close()

    def _set_up(self, created: bool) -> None:
        try:
            self._read(self._check_schema)
            if not self.read_only:
                self._read(self._mark_interrupted_runs)
        except BaseException as e:
            self._con.close()
            self._drop_writer_lock(remove=self._lock_created)  # a refused file gets nothing beside it
            self._remove_if(created)
            if isinstance(e, duckdb.Error):
                raise StoreError(f"{self.path}: cannot set up the store ({_one_line(e)})") from None
            raise

    def _remove_if(self, created: bool) -> None:
        """A store this open created but could not set up (disk full, ...) leaves no file behind."""
        if created:
            for f in (self.path, Path(f"{self.path}.wal")):
                f.unlink(missing_ok=True)
            for d in self._made_dirs:  # innermost first: the folders made for it go too
                try:
                    d.rmdir()
                except OSError:
                    break

    def _read(self, fn):
        """``fn()``; on a lake, tried again while another process's commit holds its catalog."""
        return fn() if self.lake is None else lake.retry_locked(fn)

    def _connect_lake(self, data_path: Optional[str]):
        if self.read_only and not self.lake.exists():
            raise StoreError(f"{self.path}: no such catalog file")
        try:
            return lake.connect(self.lake, self.read_only, data_path, sandbox=SANDBOX)
        except lake.LakeSetupError as e:
            raise StoreError(str(e)) from None
        except duckdb.Error as e:
            raise StoreError(f"{self.path}: cannot open the lake ({_one_line(e)})") from None

    def _connect(self, wait_s: float, on_wait: Optional[Callable[[float, float], None]],
                 backoff: tuple[float, float] = _LOCK_BACKOFF_S, writer_lock: bool = False):
        """Open the file, retrying while another process holds it; ``writer_lock``: also take the batch's
        writer lock (``_take_writer_lock``), so that a second batch is refused even between transactions."""
        start = time.monotonic()
        pause = backoff[0]
        while True:
            try:
                con = duckdb.connect(str(self.path), read_only=self.read_only,
                                     config=SANDBOX if self.read_only else {})
                try:
                    locked = not writer_lock or self._take_writer_lock()
                except BaseException:
                    con.close()
                    raise
                if locked:
                    return con
                con.close()  # another batch writes it: let it have the file while we wait
                held_by = "another process holds this database (an nkv batch is writing it)"
            except duckdb.Error as e:
                if not _is_lock_error(e):
                    raise StoreError(f"{self.path}: cannot open database ({_one_line(e)})") from None
                held_by = "another process holds this database (DuckDB allows one writer)"
            waited = time.monotonic() - start
            if waited >= wait_s:
                after = f" after waiting {waited:.0f}s" if wait_s > 0 else ""
                raise StoreLockedError(f"{self.path}: {held_by}{after}; wait for it to finish or stop it")
            log.info("%s: held by another process; waited %.1fs of %.0fs", self.path, waited, wait_s)
            if on_wait is not None:
                on_wait(waited, wait_s)
            time.sleep(min(pause, max(wait_s - waited, 0.0)))
            pause = min(pause * 2, backoff[1])

    def _lock_path(self) -> Path:
        return Path(f"{self.path}.lock")

    def _take_writer_lock(self) -> bool:
        """An exclusive lock on ``<store>.lock`` for as long as this store is open for writing (False when
        another batch holds it). DuckDB's own lock lasts one transaction only, once the store is open."""
        try:
            import fcntl
        except ImportError:  # no flock (Windows): DuckDB's per-transaction lock is all there is
            return True
        self._lock_created = not self._lock_path().exists()
        try:
            fd = os.open(self._lock_path(), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise StoreError(f"{self.path}: cannot open database (its lock file: {e.strerror or e})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False  # (the file is the other batch's: never removed here)
        self._writer_fd = fd
        return True

    def _drop_writer_lock(self, remove: bool = False) -> None:
        if self._writer_fd is not None:
            if remove:  # a store this open created and could not set up leaves nothing behind
                self._lock_path().unlink(missing_ok=True)
            os.close(self._writer_fd)  # closing releases the flock
            self._writer_fd = None

    def _check_schema(self) -> None:
        """Refuse a file that is not ours before writing anything; create or migrate ours."""
        q = lambda sql: self.con.execute(sql).fetchall()  # noqa: E731
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
            except duckdb.Error:
                raise StoreError(f"{self.path}: not a nestedkv store (its schema_version table is not ours); "
                                 "refusing to use it") from None
        if found is None and names - {"schema_version"}:
            raise StoreError(f"{self.path}: not a nestedkv store (it holds tables but no schema version); "
                             "refusing to use it")
        if found is not None and not 1 <= found <= SCHEMA_VERSION:
            raise StoreError(f"{self.path}: schema version {found}, this code reads versions 1 to {SCHEMA_VERSION}")
        if not self.read_only:  # an older store opened read-only is read as it is
            self._transaction(self._create_or_migrate)

    def _create_or_migrate(self) -> None:
        self.con.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER)")
        have = set(self.con.execute(
            "SELECT table_name, column_name FROM duckdb_columns() WHERE database_name = current_database()"
        ).fetchall())
        tables = {t for t, _ in have}
        for name, cols in TABLES.items():
            self.con.execute(_ddl(name, keys=self.lake is None))
            for c, t in cols:
                if name in tables and (name, c) not in have:  # a column added since the table was created
                    self.con.execute(f"ALTER TABLE {name} ADD COLUMN {c} {t[0]}")
        for sql in VIEWS.values():  # replaced on every writable open, so view changes reach old stores
            self.con.execute(sql)
        self.con.execute("DELETE FROM schema_version")
        self.con.execute("INSERT INTO schema_version VALUES (?)", [SCHEMA_VERSION])

    def _mark_interrupted_runs(self) -> None:
        rows = self.con.execute(
            "SELECT run_id, pid, pid_started_at FROM runs WHERE status = 'running' AND host = ?",
            [socket.gethostname()],
        ).fetchall()
        for run_id, pid, started_at in rows:
            if not process_is_the_run(pid, started_at):
                self.finish_run(run_id, "interrupted")
                self.interrupted_runs.append(run_id)
                log.info("%s: run %s was left running by pid %s, which is gone: marked interrupted",
                         self.path, run_id, pid)

    # -- lifecycle --------------------------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            if self._con is not None:
                self._con.close()
                self._con = None
            self._drop_writer_lock()
        if self.commit_retries:  # routine one by one (logged at info), worth one line when the store closes
            log.warning("%s: %d commits lost a race with another writer and were retried (nothing lost)",
                        self.path, self.commit_retries)

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _writable(self) -> None:
        if self.read_only:
            raise StoreError(f"{self.path}: store is open read-only; writes are refused")

    def _store_error(self, e: BaseException) -> StoreWriteError:
        """One line naming the file for a failed write (disk full, a value its column cannot hold, ...)."""
        msg = _one_line(e)
        return StoreWriteError(msg if msg.startswith(f"{self.path}:") else f"{self.path}: write failed: {msg}")

    # -- runs -------------------------------------------------------------------------------------
    def start_run(self, config: RunConfig, input: str) -> str:
        self._writable()
        run_id = new_run_id()
        pid = os.getpid()
        row = {
            "run_id": run_id, "created_at": _utcnow(), "task": config.task, "model": config.model,
            "press": config.press, "compression_ratio": config.compression_ratio, "budget": config.budget,
            "head_budget": config.head_budget, "prefill_step_size": config.prefill_step_size,
            "max_new_tokens": config.max_new_tokens, "config_json": config.canonical_json(),
            "config_hash": config.config_hash(), "reference_config_hash": config.reference().config_hash(),
            "code_version": code_version(), "input": str(input), "status": "running",
            "prefill": getattr(config, "prefill", None), "kv_bits": getattr(config, "kv_bits", None),
            "host": socket.gethostname(), "pid": pid, "pid_started_at": process_started_at(pid),
        }
        try:
            data = _arrow("runs", [row])
        except StoreError as e:
            raise self._store_error(e) from None
        self._transaction(lambda: self._insert("runs", data))
        return run_id

    def finish_run(self, run_id: str, status: str) -> None:
        """Close a run; n_errors counts skipped input rows plus documents that did not end ok."""
        self._writable()
        if status not in RUN_STATUSES:
            raise ValueError(f"status must be one of {RUN_STATUSES}, not {status!r}")
        self._transaction(lambda: self.con.execute(
            """
            UPDATE runs SET status = $status, finished_at = $now,
              n_documents = (SELECT count(DISTINCT (content_sha256, doc_id)) FROM outputs
                             WHERE run_id = $id),
              n_errors = (SELECT count(*) FROM input_errors WHERE run_id = $id)
                       + (SELECT count(DISTINCT (content_sha256, doc_id)) FROM outputs
                          WHERE run_id = $id AND status <> $ok)
            WHERE run_id = $id
            """,
            {"status": status, "now": _utcnow(), "id": run_id, "ok": OK},
        ))

    def done_documents(self, config: RunConfig) -> set[tuple[str, str]]:
        """(doc_id, content_sha256) of documents answered ok (every question) under this exact configuration,
        in any run. Resume skips by this pair: the same text under a new doc_id still gets its own rows."""
        with self._session():
            rows = self._read(lambda: self.con.execute(
                """
                SELECT DISTINCT o.doc_id, o.content_sha256 FROM outputs o JOIN runs r ON r.run_id = o.run_id
                WHERE r.config_hash = ?
                GROUP BY o.run_id, o.content_sha256, o.doc_id HAVING bool_and(o.status = ?)
                """,
                [config.config_hash(), OK],
            ).fetchall())
        return {(d, h) for d, h in rows}

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
        """``work()`` in one transaction; a DuckDB or value error becomes a one-line ``StoreError``.

        On a lake, a transaction that lost a commit race to another writer (a conflict DuckLake could not
        rebase, a locked catalog) is rolled back and ``work()`` re-run from the start, with backoff.
        """
        first, longest, tries = _COMMIT_RETRY
        with self._lock:
            for attempt in range(tries):
                try:
                    with self._session():
                        self._one_transaction(work)
                    return
                except (StoreError, duckdb.Error) as e:
                    if self.lake is None or attempt == tries - 1 or not lake.is_retryable(e):
                        raise self._store_error(e) from None
                    self.commit_retries += 1
                    pause = min(first * 2 ** attempt, longest) * (0.5 + secrets.randbelow(1000) / 1000)
                    log.info("%s: commit lost to another writer (%s); retry %d in %.2fs", self.path,
                             _one_line(e), attempt + 1, pause)
                    time.sleep(pause)

    def _one_transaction(self, work) -> None:
        self.con.execute("BEGIN TRANSACTION")
        try:
            work()
        except BaseException:
            try:
                self.con.execute("ROLLBACK")
            except duckdb.Error:  # the error may already have aborted the transaction
                pass
            raise
        try:
            self.con.execute("COMMIT")
        except duckdb.Error:
            try:
                self.con.execute("ROLLBACK")
            except duckdb.Error:
                pass
            raise

    def write_document(self, run_id: str, result: DocumentResult) -> None:
        """All rows of one document in one transaction, replacing any earlier write of the same (run, doc)."""
        self.write_results([(run_id, result, [])])

    def write_results(self, items: Iterable[tuple[str, DocumentResult, Any]]) -> None:
        """One document's results under several runs, each ``(run_id, result, evaluation rows)``, in ONE
        transaction: a crash never leaves part of a document. Each replaces any earlier write of the same
        (run, document), so a retry never duplicates.

        ``documents.n_tokens`` is the document's own length: ``result.n_tokens_full`` where the result has
        it (a truncated run feeds fewer tokens; ``outputs.n_tokens`` has what was fed), else ``n_tokens``.
        """
        self._writable()
        items = list(items)
        try:
            evaluations = [self._evaluations_table(rows) for _, _, rows in items]
        except (StoreError, pa.ArrowException) as e:
            raise self._store_error(e) from None

        def work() -> None:
            for (run_id, result, _), data in zip(items, evaluations):
                self._document_rows(run_id, result)
                if data.num_rows:
                    self._replace_rows("evaluations", data, EVALUATION_MATCH)

        self._transaction(work)

    def _document_rows(self, run_id: str, result: DocumentResult) -> None:
        key = [run_id, result.doc_id, result.content_sha256]
        full = getattr(result, "n_tokens_full", None)
        n_tokens = full if full is not None else result.n_tokens
        for table in ("outputs", "layer_memory"):
            self.con.execute(f"DELETE FROM {table} WHERE run_id = ? AND doc_id = ? AND content_sha256 = ?", key)
        self._insert("outputs", outputs_table(run_id, result))
        self._insert("layer_memory", layer_memory_table(run_id, result))
        # n_tokens 0 means the document failed before tokenizing: keep a count we already have.
        if self.lake is not None:
            self._upsert_document_lake(result, n_tokens)
            return
        self.con.execute(
            """
            INSERT INTO documents (doc_id, content_sha256, n_chars, n_tokens, title) VALUES (?, ?, ?, ?, ?)
            ON CONFLICT (content_sha256, doc_id) DO UPDATE SET
              n_chars = excluded.n_chars,
              n_tokens = CASE WHEN excluded.n_tokens > 0 THEN excluded.n_tokens ELSE n_tokens END,
              title = coalesce(excluded.title, title)
            """,
            [result.doc_id, result.content_sha256, result.n_chars, n_tokens, result.title],
        )

    def _upsert_document_lake(self, result: DocumentResult, n_tokens: int) -> None:
        """The ON CONFLICT update above as DELETE + INSERT (DuckLake has no keys), in the same transaction."""
        key = [result.content_sha256, result.doc_id]
        old = self.con.execute("SELECT max(n_tokens), max(title) FROM documents WHERE content_sha256 = ? "
                               "AND doc_id = ?", key).fetchone()
        self.con.execute("DELETE FROM documents WHERE content_sha256 = ? AND doc_id = ?", key)
        self.con.execute(
            "INSERT INTO documents (doc_id, content_sha256, n_chars, n_tokens, title) VALUES (?, ?, ?, ?, ?)",
            [result.doc_id, result.content_sha256, result.n_chars,
             old[0] if (n_tokens or 0) <= 0 and old[0] is not None else n_tokens,
             result.title if result.title is not None else old[1]])

    def write_input_errors(self, run_id: str, errors: Iterable[Any]) -> None:
        """``RowError``s of one run; writing the same (source, row) again replaces it."""
        self._writable()
        try:
            data = _arrow("input_errors", [
                {"run_id": run_id, "source": e.source, "row_number": e.row, "doc_id": e.doc_id, "field": e.field,
                 "message": e.message}
                for e in errors
            ])
        except StoreError as e:
            raise self._store_error(e) from None

        self._replace("input_errors", data, "e.run_id = n.run_id AND e.source = n.source AND e.row_number = n.row_number")

    @staticmethod
    def _evaluations_table(rows: Union[pa.Table, Iterable[Mapping[str, Any]]]) -> pa.Table:
        cols = [c for c, _ in TABLES["evaluations"]]
        data = rows.select(cols) if isinstance(rows, pa.Table) else _arrow("evaluations", [
            {c: r.get(c) for c in cols} for r in rows
        ])
        return data.cast(pa.schema([(c, t[1]) for c, t in TABLES["evaluations"]]))

    def write_evaluations(self, rows: Union[pa.Table, Iterable[Mapping[str, Any]]]) -> None:
        """Evaluation rows (dicts or an Arrow table with the ``evaluations`` columns); re-writing replaces."""
        self._writable()
        try:
            data = self._evaluations_table(rows)
        except (StoreError, pa.ArrowException) as e:
            raise self._store_error(e) from None
        self._replace("evaluations", data, EVALUATION_MATCH)

    def _replace(self, table: str, data: pa.Table, match: str) -> None:
        """In one transaction, delete the rows ``data`` replaces (``match`` relates old ``e`` to new ``n``)
        and insert ``data``: re-writing the same rows never duplicates them."""
        self._transaction(lambda: self._replace_rows(table, data, match))

    def _replace_rows(self, table: str, data: pa.Table, match: str) -> None:
        self.con.register("_new_rows", data)
        try:
            self.con.execute(f"DELETE FROM {table} e USING _new_rows n WHERE {match}")
        finally:
            self.con.unregister("_new_rows")
        self._insert(table, data)

    # -- reads ------------------------------------------------------------------------------------
    def _check_read_only_sql(self, sql: str) -> None:
        """Refuse, before running anything, all but exactly one statement of a ``READ_ONLY_STATEMENTS`` kind."""
        try:
            statements = self.con.extract_statements(sql)
        except duckdb.Error as e:
            raise StoreError(f"{self.path}: query failed: {_one_line(e)}") from None
        if len(statements) != 1:
            raise StoreError(f"{self.path}: store is open read-only; a query must be exactly one SELECT "
                             f"statement, found {len(statements)}")
        kind = statements[0].type
        if kind not in READ_ONLY_STATEMENTS:
            raise StoreError(f"{self.path}: store is open read-only; {kind.name} statements are refused "
                             "(SELECT, WITH, VALUES, DESCRIBE, SHOW and SUMMARIZE are allowed)")
        if self.lake is not None:
            try:
                refused = lake.refused_functions(self.con, sql)
            except duckdb.Error as e:
                raise StoreError(f"{self.path}: query failed: {_one_line(e)}") from None
            if refused:
                raise StoreError(f"{self.path}: store is open read-only; {', '.join(refused)} reach other "
                                 "databases and are refused")

    def query(self, sql: str, params: Optional[Union[list, dict]] = None) -> pa.Table:
        """Run SQL and return the result as Arrow.

        On a read-only store (what ``nkv query`` opens) the SQL must be exactly one SELECT statement (which
        includes WITH, VALUES, FROM-first queries, DESCRIBE, SHOW, SUMMARIZE and table functions such as
        ``pragma_table_info('runs')``); anything else, or a second statement, is a ``StoreError`` before any
        of it runs. The connection is sandboxed as well (``SANDBOX``): such a SELECT can read the store and
        nothing else (no other files, no extensions, no settings changes).
        """
        def run() -> pa.Table:
            rel = self.con.sql(sql, params=params)
            if rel is None:  # statements without a result on older DuckDB
                return pa.table({})
            return rel.to_arrow_table() if hasattr(rel, "to_arrow_table") else rel.arrow()

        with self._session():
            if self.read_only:
                self._check_read_only_sql(sql)
            try:
                return self._read(run)
            except duckdb.Error as e:
                raise self._query_error(e) from None

    def stream(self, sql: str, rows_per_batch: int = 2048) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
        """``query`` as record batches, fetched as they are read, so a large result is never held whole.
        ``interrupt`` (from another thread) stops it; errors while reading are ``StoreError`` too."""
        def start():
            res = self.con.execute(sql)
            return res.to_arrow_reader(rows_per_batch) if hasattr(res, "to_arrow_reader") \
                else res.fetch_record_batch(rows_per_batch)

        session = self._session()  # held until the last batch is read (the caller's thread throughout)
        session.__enter__()
        try:
            if self.read_only:
                self._check_read_only_sql(sql)
            reader = self._read(start)
        except BaseException as e:
            session.__exit__(None, None, None)
            if isinstance(e, duckdb.Error):
                raise self._query_error(e) from None
            raise

        def batches() -> Iterator[pa.RecordBatch]:
            try:
                yield from reader
            except (duckdb.Error, pa.ArrowException) as e:
                raise self._query_error(e) from None
            finally:
                session.__exit__(None, None, None)

        return reader.schema, batches()

    def interrupt(self) -> None:
        """Stop the statement running on this store's connection (safe from any thread)."""
        con = self._con
        if con is not None:
            con.interrupt()

    def _query_error(self, e: BaseException) -> StoreError:
        msg = _one_line(e)
        if self.read_only and "read-only" in msg:
            return StoreError(f"{self.path}: store is open read-only; this statement writes ({msg})")
        return StoreError(f"{self.path}: query failed: {msg}")
