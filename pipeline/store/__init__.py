"""The DuckDB store: runs, outputs and per-layer KV memory, written one document per transaction.

One writer per file (DuckDB's own rule); readers open the file read-only, inside DuckDB's sandbox (no files
but the store, no extensions, locked settings) and with one SELECT per query. Every write of a document
first deletes that (run, document)'s rows, so a retried task replaces instead of duplicating. A run records
its host and pid; a writer that opens the store marks this host's ``running`` runs whose process is gone
``interrupted``.

``ducklake:...`` stores (``pipeline.store.lake``) take several writers, on several machines: the same tables
and views without primary keys, the one upsert as DELETE + INSERT inside the document's transaction, and a
transaction that loses a commit race to another writer re-run whole.

The package owns all of the project's SQL, one job per module: ``schema`` (tables, version, migration),
``views``, ``rows`` (Arrow rows of the tables' types), ``connection`` (opening, locks, transactions),
``sandbox`` (what a read-only query may do), ``reads`` (``query``, ``stream``), ``queries`` (the project's
named reads), ``processes`` (whether a run's process lives), ``lake`` (DuckLake); here, ``Store`` and its
writes.
"""

from __future__ import annotations

import logging
import socket
from typing import Any, Iterable, Mapping, Union

import pyarrow as pa

from pipeline.config import RunConfig
from pipeline.results import OK, DocumentResult
from pipeline.store import schema
from pipeline.store.connection import READER_WAIT_S, REOPEN_BACKOFF_S, REOPEN_WAIT_S
from pipeline.store.errors import StoreError, StoreLockedError, StoreWriteError
from pipeline.store.processes import process_is_the_run, process_started_at
from pipeline.store.queries import Queries
from pipeline.store.rows import (arrow, evaluations_table, input_errors_table, layer_memory_table, new_run_id,
                                 outputs_table, runs_table, utcnow)
from pipeline.store.sandbox import READ_ONLY_STATEMENTS, SANDBOX
from pipeline.store.schema import PRIMARY_KEYS, RUN_STATUSES, SCHEMA_VERSION, TABLES
from pipeline.store.views import LAYER_SAVINGS_SQL, MEMORY_SAVINGS_SQL, PEAK_SAVINGS_SQL, QUALITY_VS_FULL_SQL, VIEWS

__all__ = [
    "EVALUATION_MATCH", "LAYER_SAVINGS_SQL", "MEMORY_SAVINGS_SQL", "PEAK_SAVINGS_SQL", "PRIMARY_KEYS",
    "QUALITY_VS_FULL_SQL", "READER_WAIT_S", "READ_ONLY_STATEMENTS", "REOPEN_BACKOFF_S", "REOPEN_WAIT_S",
    "RUN_STATUSES", "SANDBOX", "SCHEMA_VERSION", "TABLES", "VIEWS", "Store", "StoreError", "StoreLockedError",
    "StoreWriteError", "layer_memory_table", "new_run_id", "outputs_table", "process_is_the_run",
    "process_started_at",
]

log = logging.getLogger(__name__)

EVALUATION_MATCH = ("e.run_id = n.run_id AND e.doc_id = n.doc_id AND e.metric = n.metric "
                    "AND e.question_idx IS NOT DISTINCT FROM n.question_idx "
                    "AND e.reference_run_id IS NOT DISTINCT FROM n.reference_run_id")


class Store(Queries):
    """``with Store("runs.duckdb") as db: ...``; ``Store(path, read_only=True)`` for queries only.

    ``wait_s``: when another process holds the file, retry with backoff for up to that many seconds,
    calling ``on_wait(waited_s, wait_s)`` (and logging) before each pause, then fail as without it.
    After a writable open, ``interrupted_runs`` lists the run ids just marked ``interrupted``.

    ``path`` may name a lake, ``ducklake:sqlite:meta.db`` or ``ducklake:postgres:CONNINFO``; ``data_path``
    (a folder or URL for its Parquet files) is needed when the lake is created and ignored after.
    ``commit_retries`` counts the lake transactions this store re-ran after losing a commit race.
    """

    def _prepare(self) -> None:
        """Refuse a file that is not ours before writing anything; create or migrate ours."""
        self.interrupted_runs: list[str] = []
        self._read(lambda: schema.check(self.con, self.path))
        if not self.read_only:  # an older store opened read-only is read as it is
            self._transaction(lambda: schema.create_or_migrate(self.con, keys=self.lake is None))
            self._read(self._mark_interrupted_runs)

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

    # -- runs -------------------------------------------------------------------------------------
    def start_run(self, config: RunConfig, input: str) -> str:
        self._writable()
        run_id = new_run_id()
        try:
            data = runs_table(run_id, config, input)
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
            {"status": status, "now": utcnow(), "id": run_id, "ok": OK},
        ))

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
            evaluations = [evaluations_table(rows) for _, _, rows in items]
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
            data = input_errors_table(run_id, errors)
        except StoreError as e:
            raise self._store_error(e) from None

        self._replace("input_errors", data, "e.run_id = n.run_id AND e.source = n.source AND e.row_number = n.row_number")

    def write_evaluations(self, rows: Union[pa.Table, Iterable[Mapping[str, Any]]]) -> None:
        """Evaluation rows (dicts or an Arrow table with the ``evaluations`` columns); re-writing replaces."""
        self._writable()
        try:
            data = evaluations_table(rows)
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

    def write_suite_questions(self, rows: Iterable[Mapping[str, Any]]) -> None:
        """The suite's questions (``suite_questions``, made by the first suite), replacing the rows of the
        same documents, in one transaction."""
        self._writable()
        try:
            data = arrow("suite_questions", list(rows))
        except StoreError as e:
            raise self._store_error(e) from None

        def work() -> None:
            self.con.execute(schema.ddl("suite_questions"))
            self._replace_rows("suite_questions", data, "e.content_sha256 = n.content_sha256")

        self._transaction(work)
