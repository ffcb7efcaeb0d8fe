"""A read-only query run on a worker thread, its Arrow batches handed over as they come, so that the
calling thread stays free for Ctrl-C and a timeout; stopping interrupts the query (``con.interrupt``)."""

from __future__ import annotations

import queue
import signal
import threading
import time
from contextlib import contextmanager
from typing import Iterator

QUERY_TIMEOUT_S = 60.0  # interactive: a query that runs longer is most likely a mistake (--timeout 0: none)
# After a stop, how long the worker may take to notice. DuckDB drops an interrupt that lands before its
# statement starts, so the stop is repeated every STOP_POLL_S until the worker is gone.
STOP_WAIT_S = 5.0
STOP_POLL_S = 0.02


class QueryStopped(Exception):
    """The query was stopped (timeout); the message says why."""


@contextmanager
def interrupt_latch() -> Iterator[threading.Event]:
    """While the block runs, a Ctrl-C (SIGINT) only sets the returned event; the query loop raises
    KeyboardInterrupt at its next step, outside any lock. Raised anywhere, as Python's handler does, it was
    lost inside a finalizer (a GC pass in the writer) or left the queue's lock held, and the worker thread
    with it. A second Ctrl-C before that goes to the previous handler at once."""
    seen = threading.Event()
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(previous):
        yield seen
        return

    def latch(signum, frame):
        if seen.is_set():
            previous(signum, frame)
        seen.set()

    signal.signal(signal.SIGINT, latch)
    try:
        yield seen
    except BaseException:
        signal.signal(signal.SIGINT, previous)
        raise
    signal.signal(signal.SIGINT, previous)
    if seen.is_set():  # latched as the block ended, before the loop raised it
        raise KeyboardInterrupt


@contextmanager
def background_query(store, sql: str, timeout: float) -> Iterator[tuple]:
    """``(schema, batches)`` of ``sql`` on ``store``; ``timeout``: seconds spent waiting on the database
    (0: no limit) before ``QueryStopped``. Leaving the block stops the query if it still runs."""
    q: "queue.Queue" = queue.Queue(maxsize=4)  # bounded: the query never runs far ahead of the writer
    stop = threading.Event()

    def put(item) -> None:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def produce() -> None:
        if stop.is_set():
            return
        try:
            schema, batches = store.stream(sql)
        except BaseException as exc:  # handed to the main thread, which reports it
            put(("error", exc))
            return
        try:
            put(("schema", schema))
            for batch in batches:
                if stop.is_set():
                    return
                put(("batch", batch))
            put(("end", None))
        except BaseException as exc:
            put(("error", exc))
        finally:
            batches.close()  # here: the store's session belongs to this thread

    waited = [0.0]

    def take():
        while True:
            if interrupted.is_set():
                raise KeyboardInterrupt
            t0 = time.monotonic()
            try:
                kind, value = q.get(timeout=0.1)
            except queue.Empty:
                kind = None
            waited[0] += time.monotonic() - t0
            if kind == "error":
                raise value
            if kind is not None:
                return kind, value
            if timeout and waited[0] > timeout:
                raise QueryStopped(f"query stopped after {timeout:g} s (--timeout SECONDS, 0 for no limit)")

    def batches():
        while True:
            kind, value = take()
            if kind == "end":
                return
            yield value

    worker = threading.Thread(target=produce, name="nkv-query", daemon=True)
    with interrupt_latch() as interrupted:
        try:  # started inside: a Ctrl-C right after the start still stops it
            worker.start()
            _, schema = take()
            yield schema, batches()
        finally:
            stop.set()
            stop_worker(worker, store.interrupt)


def stop_worker(worker: threading.Thread, interrupt) -> bool:
    """Interrupt until ``worker`` ends (at most ``STOP_WAIT_S``): one interrupt can land before the
    statement starts, where DuckDB forgets it. False when the worker still runs."""
    deadline = time.monotonic() + STOP_WAIT_S
    while worker.is_alive() and time.monotonic() < deadline:
        interrupt()
        worker.join(STOP_POLL_S)
    return not worker.is_alive()
