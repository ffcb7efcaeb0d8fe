"""Ctrl-C at any moment of ``nkv query`` (reliability matrix rows): opening the store, before DuckDB starts
the statement, while it computes, while rows stream out, while the store closes. Each offset must end the
command with one line and exit 130, and leave no query thread behind, while other processes load the cores
(the lost interrupt was a race that showed only on a busy machine)."""

import _thread
import contextlib
import os
import subprocess
import sys
import threading
import time

import pytest

from test_reliability import invoke, one_error_line

import flows.cli.results as results
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


def ctrl_c_after(delay: float, fired: list) -> None:
    time.sleep(delay)
    fired.append(time.monotonic())
    _thread.interrupt_main()  # what SIGINT's handler does to the main thread


@pytest.mark.slow  # 100 interrupted queries under load
def test_ctrl_c_at_any_offset_stops_the_query(tmp_path, monkeypatch):
    db = tmp_path / "runs.duckdb"
    Store(db).close()
    real = results.interrupted_exits
    plan: dict = {}

    @contextlib.contextmanager
    def timed(what):  # the clock starts as the command's body does
        with real(what):
            threading.Thread(target=ctrl_c_after, args=(plan["offset"], plan["fired"]), daemon=True).start()
            yield

    monkeypatch.setattr(results, "interrupted_exits", timed)
    failures = []
    with loaded_cores():
        for name, (sql, fmt) in QUERIES.items():
            for offset in OFFSETS:
                plan.update(offset=offset, fired=[])
                res = invoke(["query", sql, "--db", str(db), "--format", fmt, "--timeout", "0"])
                ended = time.monotonic()
                left = [t for t in threading.enumerate() if t.name == "nkv-query" and t.is_alive()]
                if res.exit_code != 130 or left or not plan["fired"]:
                    failures.append((name, offset, res.exit_code, len(left), res.stderr[-300:], repr(res.exception)))
                    continue
                one_error_line(res, ["query interrupted"])
                # not the hours the statement would take (a lost interrupt); about a second is the aim
                assert ended - plan["fired"][0] < 10, (name, offset)
    assert not failures, "\n".join(map(str, failures))
