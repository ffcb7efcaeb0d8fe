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
