"""Ctrl-C at any moment of ``nkv query`` (reliability matrix rows): opening the store, before DuckDB starts
the statement, while it computes, while rows stream out, while the store closes. Each offset must end the
command with one line and exit 130, and leave no query thread behind, while other processes load the cores
(the lost interrupt was a race that showed only on a busy machine). One exception: a thread stuck inside
DuckDB's own reader call, which can miss every interrupt (see the test's end)."""

import _thread
import contextlib
import os
import subprocess
import sys
import threading
import time
import traceback

import pytest

from test_reliability import invoke, one_error_line

import flows.cli.query as query_cli
from pipeline.store import Store

# 25 offsets in the first 25 ms (the store opens, the statement is prepared), 25 spread over half a second.
OFFSETS = [i * 0.001 for i in range(25)] + [0.025 + 0.5 * ((i * 0.618034) % 1) for i in range(25)]
QUERIES = {
    "computing": ("SELECT count(*) FROM range(10000000000000)", "table"),  # hours of work, one row
    "streaming": ("SELECT range AS i FROM range(10000000000000)", "csv"),  # rows written as they come
}


@contextlib.contextmanager
def loaded_cores():
    """One busy process per core for the duration."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def in_duckdb_reader(thread: threading.Thread) -> bool:
    """Whether ``thread`` waits inside the store's call that opens DuckDB's Arrow reader, now and a moment
    later (not a thread about to leave it)."""
    def at_reader() -> bool:
        f = sys._current_frames().get(thread.ident)
        return f is not None and f.f_code.co_name == "start" and \
            f.f_code.co_filename.endswith(os.path.join("store", "reads.py"))

    if not at_reader():
        return False
    time.sleep(0.5)
    return thread.is_alive() and at_reader()


def where(thread: threading.Thread) -> str:
    """The innermost frames of ``thread``, for a failure's message."""
    f = sys._current_frames().get(thread.ident)
    return "" if f is None else " < ".join(f"{fr.f_code.co_name} ({os.path.basename(fr.f_code.co_filename)}:{line})"
                                          for fr, line in list(traceback.walk_stack(f))[:6])


def ctrl_c_after(delay: float, fired: list) -> None:
    time.sleep(delay)
    fired.append(time.monotonic())
    _thread.interrupt_main()  # what SIGINT's handler does to the main thread


@pytest.mark.slow  # 100 interrupted queries under load
def test_ctrl_c_at_any_offset_stops_the_query(tmp_path, monkeypatch):
    db = tmp_path / "runs.duckdb"
    Store(db).close()
    real = query_cli.interrupted_exits
    plan: dict = {}

    @contextlib.contextmanager
    def timed(what):  # the clock starts as the command's body does
        with real(what):
            threading.Thread(target=ctrl_c_after, args=(plan["offset"], plan["fired"]), daemon=True).start()
            yield

    monkeypatch.setattr(query_cli, "interrupted_exits", timed)
    failures, stuck = [], set()
    with loaded_cores():
        for name, (sql, fmt) in QUERIES.items():
            for offset in OFFSETS:
                plan.update(offset=offset, fired=[])
                res = invoke(["query", sql, "--db", str(db), "--format", fmt, "--timeout", "0"])
                ended = time.monotonic()
                left = [t for t in threading.enumerate()
                        if t.name == "nkv-query" and t.is_alive() and t not in stuck]
                inside_duckdb = [t for t in left if in_duckdb_reader(t)]
                stuck.update(inside_duckdb)
                left = [t for t in left if t not in stuck]
                if res.exit_code != 130 or left or not plan["fired"]:
                    failures.append((name, offset, res.exit_code, res.stderr[-300:], repr(res.exception),
                                     [where(t) for t in left]))
                    continue
                if inside_duckdb:  # the store says so as it closes without waiting on the statement
                    assert "error: query interrupted" in res.stderr.lower(), res.stderr
                else:
                    one_error_line(res, ["query interrupted"])
                # not the hours the statement would take (a lost interrupt); about a second is the aim
                assert ended - plan["fired"][0] < 10, (name, offset)
    assert not failures, "\n".join(map(str, failures))
    # DuckDB's reader call itself can miss every interrupt and never return (seen about once in 300
    # interrupted streaming queries under load, DuckDB 1.5 and 2.0); the command still ends with exit 130
    # and its error line, and the thread is a daemon. Anything more than that one rare case is ours to fix.
    assert len(stuck) <= 1, f"{len(stuck)} query threads stuck inside DuckDB's reader"


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the swallowed interrupt
def test_ctrl_c_swallowed_inside_a_finalizer_still_stops_the_query(tmp_path, monkeypatch):
    """A Ctrl-C that lands while a finalizer runs (a GC pass in the writer) is swallowed by Python
    ("Exception ignored in ..."); the query loop must still stop, not write rows for ever."""
    import signal

    import flows.output as output

    db = tmp_path / "runs.duckdb"
    Store(db).close()

    class CtrlCOnCollect:
        def __del__(self):
            signal.raise_signal(signal.SIGINT)  # the handler's KeyboardInterrupt dies inside __del__

    real = output.column_values
    calls = [0]

    def column_values(arr):
        calls[0] += 1
        if calls[0] == 1:
            CtrlCOnCollect()  # dropped at once: __del__ runs here
        return real(arr)

    monkeypatch.setattr(output, "column_values", column_values)
    res = invoke(["query", "SELECT range AS i FROM range(10000000000000)", "--db", str(db),
                  "--format", "csv", "--timeout", "0"])
    assert calls[0] >= 1
    assert res.exit_code == 130, (res.exit_code, res.stderr[-300:], repr(res.exception))
    one_error_line(res, ["query interrupted"])
