"""SQL in, Arrow out: ``query`` (whole) and ``stream`` (batch by batch), for the project's own queries and
``nkv query``'s; on a read-only store each is first checked by ``sandbox.check_read_only``."""

from __future__ import annotations

from typing import Iterator, Optional, Union

import duckdb
import pyarrow as pa

from pipeline.store.connection import Connection
from pipeline.store.errors import StoreError, one_line
from pipeline.store.sandbox import check_read_only

OLD_DUCKDB = int(duckdb.__version__.split(".")[0]) < 2


class Reads(Connection):
    """Reads through the store's connection: one thread at a time, retried while a lake's catalog is locked,
    errors as one-line ``StoreError``s."""

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
                check_read_only(self.con, sql, self.path, on_lake=self.lake is not None)
            try:
                return self._read(run)
            except duckdb.Error as e:
                raise self._query_error(e) from None

    def stream(self, sql: str, rows_per_batch: int = 2048) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
        """``query`` as record batches, fetched as they are read, so a large result is never held whole.
        ``interrupt`` (from another thread) stops it; errors while reading are ``StoreError`` too."""
        def start():
            if OLD_DUCKDB:  # its relation reader can miss every interrupt (a hang seen under load in CI)
                return self.con.execute(sql).to_arrow_reader(rows_per_batch)
            # A relation's reader streams; DuckDB 2 warns that a DB-API result's reader copies the rows first.
            rel = self.con.sql(sql)
            if rel is None:  # a statement without a result (older DuckDB)
                return pa.RecordBatchReader.from_batches(pa.schema([]), [])
            return rel.to_arrow_reader(rows_per_batch)

        session = self._session()  # held until the last batch is read (the caller's thread throughout)
        session.__enter__()
        try:
            if self.read_only:
                check_read_only(self.con, sql, self.path, on_lake=self.lake is not None)
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

    def _query_error(self, e: BaseException) -> StoreError:
        msg = one_line(e)
        if self.read_only and "read-only" in msg:
            return StoreError(f"{self.path}: store is open read-only; this statement writes ({msg})")
        return StoreError(f"{self.path}: query failed: {msg}")
