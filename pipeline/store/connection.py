"""The store's one DuckDB connection: opening a file or a lake, the locks that keep one writer per file,
and transactions.

One writer per file (DuckDB's own rule), held for the whole batch by a lock file beside it; the writer
opens the file only for each transaction, so readers get in between documents. A lake takes several
writers: a transaction that loses a commit race to another writer is re-run whole.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional, TypeVar, Union

import duckdb

try:
    import fcntl
except ImportError:  # POSIX only: _take_writer_lock goes without it
    fcntl = None

from pipeline.store import lake
from pipeline.store.errors import StoreError, StoreLockedError, StoreWriteError, one_line
from pipeline.store.sandbox import SANDBOX

log = logging.getLogger(__name__)

_LOCK_BACKOFF_S = (0.1, 5.0)  # first pause, longest pause between tries of a held lock
# A batch writing a DuckDB file opens it only for each transaction, so readers get in between documents.
# Between them, readers may hold the file: the writer waits for them (a query stops at its --timeout).
REOPEN_WAIT_S = 600.0
REOPEN_BACKOFF_S = (0.02, 0.5)
CLOSE_WAIT_S = 10.0  # how long closing waits for a statement on another thread
READER_WAIT_S = 10.0  # how long ``nkv query`` waits for a batch's transaction to end (milliseconds, usually)
# A lake transaction that lost a commit race to another writer is re-run: first pause, longest pause, tries.
_COMMIT_RETRY = (0.05, 2.0, 30)

C = TypeVar("C", bound="Connection")


def _is_lock_error(e: BaseException) -> bool:
    return isinstance(e, duckdb.IOException) and "lock" in str(e).lower()


class Connection:
    """Opens ``path`` (a DuckDB file or ``ducklake:...``) and hands out its connection, one thread at a
    time; ``_prepare`` (the store's schema check) runs once connected, and an open it fails leaves
    nothing behind. The parameters are ``Store``'s."""

    def __init__(self, path: Union[str, Path], read_only: bool = False, wait_s: float = 0.0,
                 on_wait: Optional[Callable[[float, float], None]] = None, data_path: Optional[str] = None):
        self.read_only = read_only
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
                    f"{self.path}: cannot create the folder {self.path.parent} ({e.strerror or one_line(e)})"
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

    def _prepare(self) -> None:
        """What a new connection checks before the open returns (``Store``: the schema)."""

    def _set_up(self, created: bool) -> None:
        try:
            self._prepare()
        except BaseException as e:
            self._con.close()
            self._drop_writer_lock(remove=self._lock_created)  # a refused file gets nothing beside it
            self._remove_if(created)
            if isinstance(e, duckdb.Error):
                raise StoreError(f"{self.path}: cannot set up the store ({one_line(e)})") from None
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
            raise StoreError(f"{self.path}: cannot open the lake ({one_line(e)})") from None

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
                    raise StoreError(f"{self.path}: cannot open database ({one_line(e)})") from None
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
        if fcntl is None:  # no flock (Windows): DuckDB's per-transaction lock is all there is
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

    # -- lifecycle --------------------------------------------------------------------------------
    def close(self) -> None:
        # A reader's statement that ignored every interrupt still holds the connection: the process may
        # exit without waiting on it. A writer waits for its transaction.
        if not self._lock.acquire(timeout=CLOSE_WAIT_S if self.read_only else -1):
            log.warning("%s: a statement still holds the connection; not waiting to close it", self.path)
            return
        try:
            if self._con is not None:
                self._con.close()
                self._con = None
            self._drop_writer_lock()
        finally:
            self._lock.release()
        if self.commit_retries:  # routine one by one (logged at info), worth one line when the store closes
            log.warning("%s: %d commits lost a race with another writer and were retried (nothing lost)",
                        self.path, self.commit_retries)

    def __enter__(self: C) -> C:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def interrupt(self) -> None:
        """Stop the statement running on this store's connection (safe from any thread)."""
        con = self._con
        if con is not None:
            con.interrupt()

    # -- transactions -----------------------------------------------------------------------------
    def _writable(self) -> None:
        if self.read_only:
            raise StoreError(f"{self.path}: store is open read-only; writes are refused")

    def _store_error(self, e: BaseException) -> StoreWriteError:
        """One line naming the file for a failed write (disk full, a value its column cannot hold, ...)."""
        msg = one_line(e)
        return StoreWriteError(msg if msg.startswith(f"{self.path}:") else f"{self.path}: write failed: {msg}")

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
                             one_line(e), attempt + 1, pause)
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
