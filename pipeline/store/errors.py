"""The store's errors: one line each, naming the file, for a user to act on."""

from __future__ import annotations


class StoreError(RuntimeError):
    """A store problem a user can act on; the message is one line naming the file."""


class StoreWriteError(StoreError):
    """A write failed (disk full, a table that no longer takes our rows): a batch stops at once, since the
    next document's write would fail the same way; what was committed before stays."""


class StoreLockedError(StoreError):
    """Another process holds the store (still, after ``wait_s``)."""


def one_line(e) -> str:
    """The first line of an error or a message (an exception without text: its type's name)."""
    return (str(e).strip().splitlines() or [type(e).__name__ if isinstance(e, BaseException) else ""])[0]


def is_interrupt(e: BaseException) -> bool:
    """Ctrl-C, as it may reach us through DuckDB: its Python client takes a pending SIGINT itself (inside a
    call on the main thread) and raises "Query interrupted" in its place; a stopped stream is an OSError."""
    if isinstance(e, KeyboardInterrupt):
        return True
    return isinstance(e, (RuntimeError, OSError)) and "interrupt" in one_line(e).lower()
