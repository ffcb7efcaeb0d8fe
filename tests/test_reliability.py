"""The reliability matrix (issue 11): bad inputs and faults against ``nkv``, one row each.

A row runs the command in-process (typer's CliRunner, a tiny random model, ``--max-new-tokens 2``) and checks
the exit code; for an expected error, that stderr is ONE line naming the problem, that nothing was created and
that no flow (so no Prefect server) started; otherwise what the store holds afterwards and that the good
documents beside a bad one were done. No row lets a raw terminal escape through. Signals and crashes run the
real command in a subprocess (tests/slow_cli.py) on a tiny model directory.
"""

import hashlib
import json
import logging
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from tiny import TINY_NAME, sample_docs, save_tiny_model_dir, use_tiny_model, write_batch

from flows.cli import app
from pipeline.config import RunConfig
from pipeline.store import Store

ROOT = Path(__file__).resolve().parents[1]
GOOD = ("doc-0", "doc-1")  # the good documents of every batch below
RUN = ["run", "--input", "{input}", "--model", TINY_NAME, "--db", "{db}", "--max-new-tokens", "2"]


SUITE = ["suite", "--model", TINY_NAME, "--db", "{db}", "--out", "{tmp}/rep", "--lengths", "768", "--tasks", "two_hop"]


def run_with(*extra: str) -> list[str]:
    return RUN + list(extra)


# -- inputs --------------------------------------------------------------------------------------------
def docs(n: int = 2) -> list[dict]:
    return sample_docs(n, chars=160)


def raw_strings(values: list[bytes]) -> pa.Array:
    """A string array holding exactly these bytes, valid UTF-8 or not (Arrow's builders would refuse)."""
    offsets = [0]
    for v in values:
        offsets.append(offsets[-1] + len(v))
    return pa.Array.from_buffers(pa.string(), len(values), [
        None, pa.py_buffer(pa.array(offsets, pa.int32()).buffers()[1]), pa.py_buffer(b"".join(values))])


def not_utf8_batch(column: str, bad: bytes):
    """Two good documents and a third whose ``column`` holds bytes that are not UTF-8."""
    def setup(ctx):
        rows = docs(3)
        table = pq.read_table(write_batch(ctx.tmp / "ok.parquet", rows))
        if column == "questions":
            flat = [q.encode() for d in rows for q in d["questions"]]
            flat[4] = bad
            offsets = pa.array([0, 2, 4, 6], pa.int32())
            arr = pa.ListArray.from_arrays(offsets, raw_strings(flat))
        else:
            values = [d[column].encode() for d in rows]
            values[2] = bad + b" and text"
            arr = raw_strings(values)
        table = table.set_column(table.schema.get_field_index(column), column, arr)
        pq.write_table(table, ctx.tmp / "batch.parquet")
    return setup


STRING_LAYOUTS = {  # the Arrow layouts a Parquet text column comes back in
    "large_string": lambda a: a.cast(pa.large_string()),
    "string_view": lambda a: a.cast(pa.string_view()),
    "dictionary": lambda a: pa.DictionaryArray.from_arrays(pa.array(range(len(a)), pa.int32()), a),
    "chunked": lambda a: pa.chunked_array([STRING_LAYOUTS["dictionary"](a[:2]), STRING_LAYOUTS["dictionary"](a[2:])]),
}


def not_utf8_layout(layout: str):
    """Three documents, the third's text not UTF-8, the text column in ``layout`` (chunked: dictionary
    chunks, one row group per row)."""
    def setup(ctx):
        rows = docs(3)
        values = [d["text"].encode() for d in rows]
        values[2] = b"\xff\xfe and text"
        table = pq.read_table(write_batch(ctx.tmp / "ok.parquet", rows))
        column = STRING_LAYOUTS[layout](raw_strings(values))
        table = table.set_column(table.schema.get_field_index("text"), "text", column)
        pq.write_table(table, ctx.tmp / "batch.parquet", row_group_size=1 if layout == "chunked" else None)
    return setup


def batch(*extra: dict, good: int = 2):
    def setup(ctx):
        write_batch(ctx.tmp / "batch.parquet", docs(good) + list(extra))
    return setup


def beside_good(table: pa.Table):
    """A folder with the good batch and a second file, ``table``; the input is the folder."""
    def setup(ctx):
        folder = ctx.tmp / "in"
        folder.mkdir()
        write_batch(folder / "a.parquet", docs())
        pq.write_table(table, folder / "b.parquet")
        ctx.input = str(folder)
    return setup


def write_file(name: str, content: bytes | Callable, as_input: bool = True):
    def setup(ctx):
        path = ctx.tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content(ctx) if callable(content) else content)
        if as_input:
            ctx.input = str(path)
        ctx.vars["file"] = str(path)
    return setup


def good_bytes(ctx) -> bytes:
    return Path(write_batch(ctx.tmp / "whole.parquet", docs())).read_bytes()


def corrupt_pages(ctx) -> bytes:
    """Footer intact, the first data page overwritten: only reading the pages finds it."""
    path = ctx.tmp / "plain.parquet"
    pq.write_table(pq.read_table(write_batch(ctx.tmp / "w.parquet", docs())), path, compression="snappy")
    data = bytearray(path.read_bytes())
    data[4:68] = b"\xff" * 64
    return bytes(data)


# -- stores --------------------------------------------------------------------------------------------
def a_store(ctx):
    """A store with one completed run (no model needed); a snapshot proves a refused command left it as it was."""
    with Store(ctx.db) as s:
        s.finish_run(s.start_run(RunConfig(model=TINY_NAME), "earlier"), "completed")
    ctx.snapshot(ctx.db)


def foreign_duckdb(sql: str):
    def setup(ctx):
        ctx.db.parent.mkdir(parents=True)
        con = duckdb.connect(str(ctx.db))
        con.execute(sql)
        con.close()
        ctx.snapshot(ctx.db)
    return setup


def full_disk(existing: bool):
    """No file may grow past a few bytes (RLIMIT_FSIZE: writes fail as on a full disk) while the command
    runs; the row's cleanup lifts the limit right after it."""
    def setup(ctx):
        if existing:
            a_store(ctx)
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (0 if existing else 4096, hard))
        ctx.cleanup.append(lambda: (resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard)),
                                    signal.signal(signal.SIGXFSZ, handler)))
    return setup


def foreign_weights(ctx):
    """A models folder: weights older than any cache entry, first in line for a least-recently-used sweep."""
    save_tiny_model_dir(ctx.tmp / "tiny")  # the cache keys entries by the model's files: a real folder
    folder = ctx.tmp / "models"
    folder.mkdir()
    for name in ("model.safetensors", f"{'0' * 64}.safetensors"):
        (folder / name).write_bytes(os.urandom(20000))
        os.utime(folder / name, (time.time() - 3600,) * 2)
        ctx.snapshot(folder / name)


def foreign_weights_intact(ctx, res):
    ctx.unchanged()
    left = sorted(p.name for p in (ctx.tmp / "models").iterdir() if p.is_file())
    assert left == [f"{'0' * 64}.safetensors", "model.safetensors"], left  # the entries over the cap went


def disk_fills_after(n_writes: int):
    """Three documents; from the ``n_writes``-th document write on, that write may not grow any file
    (RLIMIT_FSIZE at the WAL's size: it fails as on a disk that just filled up). The limit holds only
    during the write: it is process-wide, and the test runner's and Prefect's own files must keep growing."""
    def setup(ctx):
        write_batch(ctx.tmp / "batch.parquet", docs(3))
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        ctx.cleanup.append(lambda: (resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard)),
                                    signal.signal(signal.SIGXFSZ, handler)))
        real, calls = Store.write_results, [0]

        def write_results(self, items):
            full = calls[0] >= n_writes
            calls[0] += 1
            if not full:
                return real(self, items)
            wal = ctx.db.with_name(ctx.db.name + ".wal")  # the next commit appends to it
            # A background thread's log record written meanwhile (Prefect's event worker) would hit the limit
            # in the test runner's capture file: the harness's file, not the product's, so it is dropped.
            raising, logging.raiseExceptions = logging.raiseExceptions, False
            resource.setrlimit(resource.RLIMIT_FSIZE, (wal.stat().st_size if wal.exists() else 0, hard))
            try:
                return real(self, items)
            finally:
                resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
                logging.raiseExceptions = raising

        ctx.monkeypatch.setattr(Store, "write_results", write_results)
    return setup


def with_flow_run(setup: Callable):
    """``setup``, and the id of the Prefect flow run the command starts kept in ``ctx.vars['flow_run']``."""
    def both(ctx):
        import pipeline.engine as engine
        from prefect.context import FlowRunContext

        setup(ctx)
        real = engine.run_batch

        def run_batch(*a, **kw):
            ctx.vars["flow_run"] = FlowRunContext.get().flow_run.id
            return real(*a, **kw)

        ctx.monkeypatch.setattr(engine, "run_batch", run_batch)
    return both


def flow_run_failed(*words: str, stored: set[str]):
    """The flow run (the same flow a served or deployed run is) ended Failed, as the Prefect API has it, its
    message the one line naming ``words``; the store holds exactly the ``stored`` documents."""
    def check(ctx, res):
        from prefect import get_client

        with get_client(sync_client=True) as client:
            state = client.read_flow_run(ctx.vars["flow_run"]).state
        assert state.type.value == "FAILED", state
        assert "\n" not in state.message and all(w in state.message for w in words), state.message
        assert stored_doc_ids(ctx) == stored
    return check


def every_write_fails(ctx):
    """A store whose outputs table was altered so that no document's rows fit it any more."""
    a_store(ctx)
    con = duckdb.connect(str(ctx.db))
    con.execute("ALTER TABLE outputs ALTER COLUMN doc_id SET DATA TYPE INTEGER")
    con.close()


def home_in_tmp(ctx) -> None:
    """HOME is the row's folder and so is the working directory: a '~' taken literally would show as ./~."""
    ctx.monkeypatch.setenv("HOME", str(ctx.tmp))
    ctx.monkeypatch.chdir(ctx.tmp)
    ctx.db = ctx.tmp / "stores" / "x.duckdb"


SPLIT_TEXT = "A document that quotes the prompt's cut marker \u241eNKV-QUESTION\u241e and goes on after it."


def _context_holds_all_of(doc_id: str, text: str, ctx) -> None:
    """The whole document went into the compressed context: its token count is the whole text's bytes
    (the byte tokenizer) plus the template, more than the text alone."""
    (n,) = [r["n_tokens"] for r in rows(ctx.db, f"SELECT n_tokens FROM outputs WHERE doc_id = '{doc_id}'")]
    assert n > len(text.encode()), n


LONG_QUESTION = "Why " + "and how " * 520 + "?"  # with any context and answer, past the tiny model's 4096


def only_the_long_question_lost(ctx, res) -> None:
    """The other question of the document was answered and stored ok; the long one is marked on its own row."""
    got = rows(ctx.db, "SELECT question_idx, status, error FROM outputs WHERE doc_id = 'doc-q' ORDER BY question_idx")
    assert [(r["question_idx"], r["status"]) for r in got] == [(0, "ok"), (1, "too_long")], got
    assert got[0]["error"] is None
    assert got[1]["error"].startswith("document 'doc-q' question 1: context ") and \
        "exceeds the model window of 4096" in got[1]["error"], got[1]["error"]
    assert rows(ctx.db, "SELECT n_errors FROM runs") == [{"n_errors": 1}]


CACHE_FIX = "point NKV_CACHE_DIR at a writable folder (an absolute path) or unset it"


def closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stored_doc_ids(ctx) -> set[str]:
    return {r["doc_id"] for r in rows(ctx.db, "SELECT DISTINCT doc_id FROM outputs")}


HOLD = "import duckdb, sys; c = duckdb.connect(sys.argv[1]); print('held', flush=True); sys.stdin.read()"


def held(release_after: Optional[float] = None, make_store: bool = True):
    """The store, held by another process (DuckDB's one writer); released after ``release_after`` seconds."""
    def setup(ctx):
        if make_store:
            a_store(ctx)
        holder = subprocess.Popen([sys.executable, "-c", HOLD, str(ctx.db)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "held"

        def release():  # idempotent: a timer and the row's cleanup may both call it
            holder.stdin.close()
            holder.wait(10)

        ctx.cleanup.append(release)
        if release_after is not None:
            threading.Timer(release_after, release).start()
    return setup


# -- the matrix ----------------------------------------------------------------------------------------
@dataclass
class Case:
    id: str
    args: list[str]
    code: int = 2  # 2: refused before any work; 1: the batch ran but did not do everything; 0: it did
    words: tuple[str, ...] = ()  # in the one error line (or, when code is 0 or 1, somewhere in stderr)
    setup: Optional[Callable] = None
    runs: tuple[str, ...] = ("completed",)  # run statuses afterwards (when code is 0 or 1)
    bad_rows: int = 0  # input_errors rows of the run
    bad_field: Optional[str] = None
    done: tuple[str, ...] = GOOD  # doc_ids with every output ok (when code is 0 or 1)
    check: Optional[Callable] = None  # (ctx, result) -> None: what else must hold
    xfail: Optional[str] = None


def error(id, args, *words, **kw) -> Case:
    return Case(id, args, 2, words, **kw)


def ok(id, args=RUN, *words, **kw) -> Case:
    return Case(id, args, 0, words, **kw)


def not_done(id, args, *words, **kw) -> Case:
    """The batch ran but not every document was done: exit 1, the last line says why."""
    return Case(id, args, 1, words, **kw)


def no_file(name: str) -> Callable:
    def check(ctx, res):
        assert not (ctx.tmp / name).exists(), f"{name} was created"
    return check


def tables_of(path) -> set[str]:
    con = duckdb.connect(str(path), read_only=True)
    try:
        return {r[0] for r in con.execute("SELECT table_name FROM duckdb_tables()").fetchall()}
    finally:
        con.close()


def query(sql: str, *words: str, check=None, setup=a_store) -> Case:
    return error(f"query-{sql[:40]}", ["query", sql, "--db", "{db}"], *words, setup=setup, check=check)


EVERY_TYPE = ("SELECT 1 AS a, 2 AS a, [1, 2] AS l, {'x': 1} AS s, MAP {1: 2} AS m, INTERVAL 1 MONTH AS i, "
              "1.5 AS d, 'infinity'::DATE AS inf_date, '294247-01-01'::DATE AS far, 'infinity'::TIMESTAMP AS inf_ts, "
              "'2020-01-01 10:00'::TIMESTAMPTZ AS tz, TIMETZ '1:02:03+05' AS ttz, 1::HUGEINT AS h, "
              "'a'::ENUM('a', 'b') AS e, union_value(k := 1) AS u, '0101'::BIT AS b, '\\xAA\\x00'::BLOB AS bl, "
              "'nan'::DOUBLE AS n, 'inf'::DOUBLE AS inf, 12345678901234567890123::VARINT AS big, "
              "gen_random_uuid() AS id, NULL AS nothing, [NULL, 'a' || chr(7)] AS nul_list")


def strict_json(text: str):
    """JSON as RFC 8259 has it: Python's parser would take NaN and Infinity, which are not JSON."""
    def refuse(constant):
        raise AssertionError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def parses_as(fmt: str):
    """The output is valid for its format's parser and holds one row of every column (names included)."""
    def check(ctx, res):
        names = ["a", "a", "l", "s", "m", "i", "d", "inf_date", "far", "inf_ts", "tz", "ttz", "h", "e", "u", "b",
                 "bl", "n", "inf", "big", "id", "nothing", "nul_list"]
        if fmt == "csv":
            import csv
            import io

            got = list(csv.reader(io.StringIO(res.stdout)))
            assert got[0] == names and len(got) == 2 and len(got[1]) == len(names), got
        elif fmt == "json":
            got = strict_json(res.stdout)
            assert len(got) == 1 and len(got[0]) == len(names) and got[0]["n"] == "NaN", got
        else:  # a table as wide as this one is cut at the terminal's width: its first columns are checked
            assert "│ 1 │ 2 │ [1, 2] │" in res.stdout and "<value out of range:" in res.stdout, res.stdout
    return check


LONG_TEXT = "A long document read whole past the tiny model's 4,096-token window. " * 90  # 6,210 bytes


def read_modes(ctx) -> dict:
    return {r["doc_id"]: r["read_mode"] for r in rows(ctx.db, "SELECT doc_id, read_mode FROM outputs")}


def over_limit(ctx, *words: str) -> None:
    """The document over --max-doc-tokens is one too_long row naming it and the limit."""
    got = rows(ctx.db, "SELECT status, error FROM outputs WHERE doc_id = 'doc-long'")
    assert [r["status"] for r in got] == ["too_long"], got
    assert all(w in got[0]["error"] for w in ("'doc-long'", *words)), got


def prints_what_it_made(ctx, res) -> None:
    """stdout (a pipe here): one line per document, then the memory table with every column, uncut."""
    from pipeline.engine import SAVINGS_COLUMNS

    lines = res.stdout.splitlines()
    assert [line.split(":")[0] for line in lines[:2]] == list(GOOD), res.stdout
    assert all(len(line.split(": ", 1)[1]) > 0 for line in lines[:2]), res.stdout
    header = next(line for line in lines if "run_id" in line)
    assert all(f" {c} " in header for c in SAVINGS_COLUMNS), header


CASES = [
    # ---- the input as a whole: one line, exit 2, nothing created
    error("input-missing", RUN, "no such file",
          setup=lambda ctx: setattr(ctx, "input", str(ctx.tmp / "missing.parquet"))),
    error("input-folder-without-parquet", RUN, "holds no .parquet files",
          setup=lambda ctx: ((ctx.tmp / "in").mkdir(), (ctx.tmp / "in" / "a.txt").write_text("x"),
                             setattr(ctx, "input", str(ctx.tmp / "in")))),
    error("input-glob-matches-nothing", RUN, "no file matches",
          setup=lambda ctx: setattr(ctx, "input", str(ctx.tmp / "*.nothing"))),
    error("input-not-parquet", RUN, "not a readable Parquet file", setup=write_file("notes.txt", b"just text\n")),
    error("input-empty-file", RUN, "not a readable Parquet file", setup=write_file("empty.parquet", b"")),
    error("input-truncated", RUN, "not a readable Parquet file",
          setup=write_file("cut.parquet", lambda ctx: good_bytes(ctx)[:300])),
    error("input-corrupt-pages", RUN, "corrupt Parquet data", setup=write_file("bad.parquet", corrupt_pages)),
    error("input-missing-text-column", RUN, "no 'text'",
          setup=write_file("b.parquet", lambda ctx: _parquet(ctx, {"doc_id": ["a"], "body": ["x"]}))),
    error("input-missing-doc_id-column", RUN, "no 'doc_id' column",
          setup=write_file("b.parquet", lambda ctx: _parquet(ctx, {"text": ["some text"]}))),
    error("input-folder-with-one-bad-file", RUN, "not a readable Parquet file",
          setup=lambda ctx: (batch()(ctx), (ctx.tmp / "z.parquet").write_bytes(b"PAR1 nope PAR1"),
                             setattr(ctx, "input", str(ctx.tmp)))),
    error("input-fifo", RUN, "not a regular file", setup=lambda ctx: (os.mkfifo(ctx.tmp / "x.parquet"),
                                                                      setattr(ctx, "input", str(ctx.tmp / "x.parquet")))),
    error("sweep-input-missing", ["sweep", "--input", "{tmp}/missing.parquet", "--model", TINY_NAME, "--db", "{db}"],
          "no such file"),
    error("eval-input-missing", ["eval", "--input", "{tmp}/missing.parquet", "--model", TINY_NAME, "--db", "{db}"],
          "no such file"),

    # ---- bad rows: recorded with row, field and reason; the good documents are done
    ok("row-text-null", RUN, "skipped row 2", "text: missing", setup=batch({"doc_id": "doc-x", "text": None}),
       bad_rows=1, bad_field="text"),
    ok("row-text-blank", RUN, "must not be empty", setup=batch({"doc_id": "doc-x", "text": "  \n "}),
       bad_rows=1, bad_field="text"),
    ok("row-text-zero-width-only", RUN, "invisible or control characters",
       setup=batch({"doc_id": "doc-x", "text": "\u200b\u2060\ufeff"}), bad_rows=1, bad_field="text"),
    ok("row-text-control-only", RUN, "invisible or control characters",
       setup=batch({"doc_id": "doc-x", "text": "\x01\x02\x1b"}), bad_rows=1, bad_field="text"),
    ok("row-doc_id-null", RUN, "doc_id: missing", setup=batch({"doc_id": None, "text": "some text"}),
       bad_rows=1, bad_field="doc_id"),
    ok("row-doc_id-blank", RUN, "must not be empty", setup=batch({"doc_id": " ", "text": "some text"}),
       bad_rows=1, bad_field="doc_id"),
    ok("prints-outputs-and-whole-table", RUN, setup=batch(), check=prints_what_it_made),
    ok("row-duplicate-doc_id", RUN, "duplicate doc_id", setup=batch({"doc_id": "doc-0", "text": "other text"}),
       bad_rows=1, bad_field="doc_id"),
    ok("row-answers-not-aligned", run_with("--task", "qa"), "1 answers for 2 questions",
       setup=batch({"doc_id": "doc-x", "text": "t", "questions": ["a?", "b?"], "answers": ["a"]}),
       bad_rows=1, bad_field="answers"),
    ok("row-text-wrong-type", RUN, "valid string (got int)",
       setup=beside_good(pa.table({"doc_id": ["x-0", "x-1"], "text": [1, 2]})), bad_rows=2, bad_field="text"),
    ok("row-doc_id-wrong-type", RUN, "valid string (got int)",
       setup=beside_good(pa.table({"doc_id": [7], "text": ["some text"]})), bad_rows=1, bad_field="doc_id"),
    ok("row-questions-wrong-type", run_with("--task", "qa"), "questions",
       setup=beside_good(pa.table({"doc_id": ["x"], "text": ["t"], "questions": ["not a list"]})),
       bad_rows=1, bad_field="questions"),
    ok("utf8-text-ff-fe", RUN, "not valid UTF-8", setup=not_utf8_batch("text", b"\xff\xfe"),
       bad_rows=1, bad_field="text"),
    ok("utf8-text-cesu-surrogate", RUN, "not valid UTF-8", setup=not_utf8_batch("text", b"\xed\xa0\x80"),
       bad_rows=1, bad_field="text"),
    ok("utf8-doc_id", RUN, "no doc_id", "not valid UTF-8", setup=not_utf8_batch("doc_id", b"\xff"),
       bad_rows=1, bad_field="doc_id"),
    ok("utf8-title", RUN, "not valid UTF-8", setup=not_utf8_batch("title", b"\xed\xa0\x80"),
       bad_rows=1, bad_field="title"),
    ok("utf8-question", run_with("--task", "qa"), "not valid UTF-8", setup=not_utf8_batch("questions", b"\xfe"),
       bad_rows=1, bad_field="questions.0"),

    *(ok(f"utf8-text-{layout}", RUN, "skipped row 2 (doc-2) in {input}: text: not valid UTF-8",
         setup=not_utf8_layout(layout), bad_rows=1, bad_field="text") for layout in STRING_LAYOUTS),

    # No valid document, so no run (input_errors rows belong to a run): the bad rows are on stderr only.
    # Nothing done is not a success: exit 1 (the bad rows are still recorded).
    not_done("all-rows-bad", RUN, "skipped row 0 (x)", "skipped row 1 (y)", "0 done", "2 bad rows",
             "no valid document", setup=batch({"doc_id": "x", "text": None}, {"doc_id": "y", "text": ""}, good=0),
             runs=("completed",), bad_rows=2, done=()),
    not_done("no-rows", RUN, "0 done", "no valid document", setup=batch(good=0), runs=(), done=()),
    ok("sweep-with-a-bad-row", ["sweep", "--input", "{input}", "--model", TINY_NAME, "--db", "{db}",
                                "--max-new-tokens", "2", "--press", "knorm", "--compression-ratio", "0.5,0.9"],
       "skipped row 2", setup=batch({"doc_id": "doc-x", "text": None}), runs=("completed",) * 3, bad_rows=1),

    # ---- the kvpress layout
    ok("kvpress-layout", run_with("--task", "qa"), "2 done",
       setup=write_file("kv.parquet", lambda ctx: _parquet(ctx, {
           "context": ["First context. " * 8, "First context. " * 8, "Second context. " * 8],
           "question": ["q1?", "q2?", "q3?"], "answer": ["a1", "a2", "a3"]})),
       done=(), check=lambda ctx, res: _outputs(ctx, 3)),
    ok("kvpress-null-context", run_with("--task", "qa"), "context: missing",
       setup=write_file("kv.parquet", lambda ctx: _parquet(ctx, {
           "context": ["First context. " * 8, None], "question": ["q1?", "q2?"], "answer": ["a1", "a2"]})),
       done=(), bad_rows=1, bad_field="context", check=lambda ctx, res: _outputs(ctx, 1)),

    # ---- options: one line naming the option, exit 2, nothing created
    error("press-unknown", run_with("--press", "bogus"), "press", "unknown press 'bogus'"),
    error("press-list-with-unknown", run_with("--press", "nestedkv,bogus"), "unknown press 'bogus'"),
    error("compression-ratio-1.0", run_with("--compression-ratio", "1.0"), "compression_ratio", "less than 1"),
    error("compression-ratio-negative", run_with("--compression-ratio", "-0.1"), "compression_ratio",
          "greater than or equal to 0"),
    error("compression-ratio-not-a-number", run_with("--compression-ratio", "x"), "--compression-ratio",
          "comma-separated"),
    error("budget-0", run_with("--budget", "0"), "budget", "greater than or equal to 1"),
    error("budget-past-int32", run_with("--budget", "3000000000"), "budget", "less than or equal to 2147483647"),
    error("budget-not-a-number", run_with("--budget", "many"), "--budget", "comma-separated"),
    error("budget-not-an-integer", run_with("--budget", "1.5"), "--budget", "comma-separated"),
    error("compression-ratio-nan", run_with("--compression-ratio", "nan"), "compression_ratio"),
    error("press-empty", run_with("--press", ""), "at least one configuration"),
    error("max-new-tokens-0", run_with("--max-new-tokens", "0"), "max_new_tokens", "greater than or equal to 1"),
    error("max-new-tokens-past-int32", run_with("--max-new-tokens", "3000000000"), "max_new_tokens",
          "less than or equal to 2147483647"),
    error("prefill-step-size-0", run_with("--prefill-step-size", "0"), "prefill_step_size"),
    error("retries-negative", run_with("--retries", "-1"), "retries", "greater than or equal to 0"),
    error("retry-delay-negative", run_with("--retry-delay-s", "-1"), "retry_delay_s"),
    error("wait-negative", run_with("--wait", "-5"), "wait", "greater than or equal to 0"),
    error("prefill-bogus", run_with("--prefill", "bogus"), "prefill", "'whole' or 'streaming'"),
    error("head-budget-bogus", run_with("--head-budget", "bogus"), "head_budget", "'uniform' or 'adaptive'"),
    error("task-bogus", run_with("--task", "bogus"), "task", "'summarize' or 'qa'"),
    error("press-param-unknown-name", run_with("--press-param", "nope=1"), "nope"),
    error("press-param-bad-value", run_with("--press-param", "tau=high"), "tau"),
    error("press-param-without-value", run_with("--press-param", "tau"), "expected name=value"),
    error("repetition-penalty-0", run_with("--repetition-penalty", "0"), "repetition_penalty"),
    error("qa-instruction-without-slot", run_with("--qa-instruction", "Answer briefly."), "qa_instruction",
          "placeholder"),
    error("press-param-window-past-int32", run_with("--press-param", "window=3000000000"), "window", "2147483647"),
    error("press-param-block-past-int32", run_with("--press-param", "block=3000000000"), "block", "2147483647"),
    error("press-param-tau-nan", run_with("--press-param", "tau=NaN"), "tau", "finite number, got nan"),
    error("press-param-beta-infinity", run_with("--press-param", "beta=Infinity"), "beta", "finite number, got inf"),
    error("press-param-prior-nan", run_with("--press-param", "prior=[0.4,NaN,0.2]"), "prior"),
    error("press-param-seed-negative", run_with("--press", "random", "--press-param", "seed=-1"), "seed", "got -1"),
    error("press-param-seed-not-an-int", run_with("--press", "random", "--press-param", "seed=abc"), "seed", "'abc'"),
    error("press-param-prefill", run_with("--press-param", "prefill=streaming"), "prefill", "option of its own"),
    error("press-param-compression-ratio", run_with("--press-param", "compression_ratio=0.5"), "compression_ratio",
          "option of its own"),
    error("no_press-with-press-params", run_with("--press", "no_press", "--press-param", "n_sink=2"), "no_press",
          "takes no press parameters"),
    error("prefill-cache-gb-inf", run_with("--prefill-cache-gb", "inf"), "prefill_cache_gb", "finite"),
    error("prefill-cache-gb-negative", run_with("--prefill-cache-gb", "-1"), "prefill_cache_gb", "greater than 0"),
    error("prefill-cache-on-a-file", run_with("--prefill-cache", "{file}"), "prefill_cache", "not a folder",
          setup=write_file("afile", b"x", as_input=False), check=lambda ctx, res: ctx.unchanged()),
    error("prefill-cache-unwritable", run_with("--prefill-cache", "{ro}/pc"), "prefill_cache", "cannot write",
          setup=lambda ctx: ctx.read_only_folder()),
    error("sweep-ratio-list-bad", ["sweep", "--compression-ratio", "0.5,x", "--db", "{db}"], "comma-separated"),
    error("query-format-bogus", ["query", "SELECT 1", "--db", "{db}", "--format", "xml"], "--format",
          setup=a_store),
    error("shards-0", run_with("--pool", "p", "--shards", "0", "--db", "ducklake:sqlite:{tmp}/meta.db"),
          "--shards must be at least 1, got 0", check=no_file("meta.db")),
    error("shard-size-negative", run_with("--pool", "p", "--shard-size", "-3", "--db", "ducklake:sqlite:{tmp}/meta.db"),
          "--shard-size must be at least 1, got -3", check=no_file("meta.db")),
    error("pool-on-a-duckdb-file", run_with("--pool", "p", "--shards", "2"), "--pool needs a lake store"),
    error("serve-shards-without-pool", ["serve", "--shards", "2", "--db", "{db}"], "give --pool NAME"),
    # nkv suite takes the batch commands' press grid: what it cannot run is one line before any document is made
    error("suite-kv-group-the-model-cannot-take", SUITE + ["--kv-bits", "8"], "--kv-group-size", "head dimension 16",
          check=no_file("rep")),
    # a bool press option is read as a word (bool("false") would be true), and a bad word is named with its value
    error("kv-hadamard-not-a-word", run_with("--kv-bits", "4", "--kv-hadamard", "maybe"), "kv_hadamard",
          "got 'maybe'"),
    # quantization settings without --kv-bits are one unquantized configuration, not one run per value
    ok("sweep-unquantized-once-whatever-the-kv-settings",
       ["sweep", "--input", "{input}", "--model", TINY_NAME, "--db", "{db}", "--max-new-tokens", "2", "--press",
        "knorm", "--compression-ratio", "0.5", "--kv-group-size", "32,64", "--kv-hadamard", "true,false"],
       runs=("completed",) * 2),
    error("suite-budget", SUITE + ["--budget", "64"], "budget: the suite compares ratios", check=no_file("rep")),
    error("suite-no_press-in-the-grid", SUITE + ["--press", "no_press,keydiff"], "no_press is the calibration",
          check=no_file("rep")),

    # ---- the environment: one line naming the variable and the fix, before anything is created
    error("env-tmpdir-unwritable", RUN, "TMPDIR=", "point TMPDIR at a writable folder",
          setup=lambda ctx: (ctx.read_only_folder(), ctx.monkeypatch.setenv("TMPDIR", ctx.vars["ro"]))),
    error("env-tmpdir-missing", RUN, "TMPDIR={tmp}/nope", "no such folder",
          setup=lambda ctx: ctx.monkeypatch.setenv("TMPDIR", str(ctx.tmp / "nope"))),
    error("env-prefect-home-unwritable", RUN, "PREFECT_HOME=", "set PREFECT_HOME to a writable folder",
          setup=lambda ctx: (ctx.read_only_folder(), ctx.monkeypatch.setenv("PREFECT_HOME", ctx.vars["ro"] + "/p"))),
    error("env-home-unwritable", RUN, "HOME=", "~/.prefect", "set PREFECT_HOME",
          setup=lambda ctx: (ctx.read_only_folder(), ctx.monkeypatch.delenv("PREFECT_HOME", raising=False),
                             ctx.monkeypatch.setenv("HOME", ctx.vars["ro"]))),
    error("env-prefect-api-url-closed-port", RUN, "PREFECT_API_URL=http://127.0.0.1:", "not answering",
          "unset PREFECT_API_URL", setup=lambda ctx: ctx.api_url(f"http://127.0.0.1:{closed_port()}/api")),
    error("env-nkv-cache-dir-unwritable", RUN, "NKV_CACHE_DIR={ro}/models", "cannot write", CACHE_FIX,
          setup=lambda ctx: (ctx.read_only_folder(), ctx.monkeypatch.setenv("NKV_CACHE_DIR", ctx.vars["ro"] + "/models"))),
    error("env-nkv-cache-dir-a-file", RUN, "NKV_CACHE_DIR={file}", "is not a folder", CACHE_FIX,
          setup=lambda ctx: (write_file("afile", b"x", as_input=False)(ctx), ctx.snapshot(ctx.vars["file"]),
                             ctx.monkeypatch.setenv("NKV_CACHE_DIR", ctx.vars["file"]))),
    error("env-nkv-cache-dir-relative", RUN, "NKV_CACHE_DIR=models/cache", "a relative path", CACHE_FIX,
          setup=lambda ctx: ctx.monkeypatch.setenv("NKV_CACHE_DIR", "models/cache"),
          check=lambda ctx, res: not Path("models/cache").exists()),
    error("env-nkv-cache-dir-empty", RUN, "NKV_CACHE_DIR=:", "it is empty", CACHE_FIX,
          setup=lambda ctx: ctx.monkeypatch.setenv("NKV_CACHE_DIR", "")),
    error("env-eval-nkv-cache-dir-relative", ["eval", "--input", "{input}", "--model", TINY_NAME, "--db", "{db}"],
          "NKV_CACHE_DIR=models", CACHE_FIX, setup=lambda ctx: ctx.monkeypatch.setenv("NKV_CACHE_DIR", "models")),
    error("env-serve-nkv-cache-dir-relative", ["serve", "--input", "{input}", "--model", TINY_NAME, "--db", "{db}"],
          "NKV_CACHE_DIR=models", CACHE_FIX, setup=lambda ctx: ctx.monkeypatch.setenv("NKV_CACHE_DIR", "models")),
    error("env-sweep-tmpdir-unwritable", ["sweep", "--input", "{input}", "--model", TINY_NAME, "--db", "{db}"],
          "TMPDIR=", setup=lambda ctx: (ctx.read_only_folder(), ctx.monkeypatch.setenv("TMPDIR", ctx.vars["ro"]))),

    # ---- models: checked before anything starts
    error("model-path-missing", run_with("--model", "./no/such/model"), "does not exist"),
    error("model-dir-without-config", run_with("--model", "{tmp}/m"), "without config.json",
          setup=lambda ctx: (ctx.tmp / "m").mkdir()),
    error("model-txt-file", run_with("--model", "{file}"), "not a .gguf model",
          setup=write_file("model.txt", b"hello", as_input=False)),
    error("model-unknown-name", run_with("--model", "no such model!"), "unknown model"),
    error("model-gguf-not-gguf", run_with("--model", "{file}"), "not a valid GGUF file",
          setup=write_file("fake.gguf", b"NOPE" * 64, as_input=False)),

    error("model-dir-without-weights", run_with("--model", "{tmp}/m"), "m",
          setup=write_file("m/config.json", b'{"model_type": "llama"}', as_input=False)),
    error("bench-memory-lengths-0", ["bench", "memory", "--lengths", "0"], "--lengths", "1..2147483647"),
    error("bench-model-unknown", ["bench", "kernels", "--model", "no such model!"], "unknown model"),
    error("bench-press-cost-unknown-press", ["bench", "press-cost", "--press", "nestedkv,nope"], "--press nope",
          "not a press"),

    # ---- the store
    error("db-parent-is-a-file", run_with("--db", "{file}/runs.duckdb"), "cannot create the folder",
          setup=write_file("afile", b"x", as_input=False), check=no_file("afile/runs.duckdb")),
    error("db-folder-read-only", run_with("--db", "{ro}/runs.duckdb"), "runs.duckdb", "cannot open database",
          setup=lambda ctx: ctx.read_only_folder()),
    error("db-is-a-folder", run_with("--db", "{tmp}"), "cannot open database"),
    error("db-empty-string", run_with("--db", ""), "cannot open database"),
    error("db-not-duckdb", run_with("--db", "{file}"), "cannot open database",
          setup=write_file("text.duckdb", b"not a database\n" * 100, as_input=False),
          check=lambda ctx, res: ctx.unchanged()),
    error("db-foreign-duckdb", RUN, "not a nestedkv store", "refusing",
          setup=foreign_duckdb("CREATE TABLE runs (id INTEGER, name VARCHAR); INSERT INTO runs VALUES (1, 'x')"),
          check=lambda ctx, res: tables_of(ctx.db) == {"runs"}),
    error("db-foreign-schema_version", RUN, "not a nestedkv store",
          setup=foreign_duckdb("CREATE TABLE schema_version (name VARCHAR)")),
    error("db-newer-schema", RUN, "schema version 99",
          setup=foreign_duckdb("CREATE TABLE schema_version (version INTEGER); "
                               "INSERT INTO schema_version VALUES (99)")),
    error("disk-full-new-store", RUN, "cannot open database", "File too large", setup=full_disk(False)),
    error("disk-full-existing-store", RUN, "write failed", "File too large", setup=full_disk(True)),
    # A write that fails mid-batch stops it: one line, exit 1, what was stored before is kept, the run is
    # closed failed, not completed.
    not_done("disk-full-mid-batch", RUN, "write failed", "File too large", "1 of 3 documents stored (kept), 2 not",
             setup=disk_fills_after(1), runs=("failed",), done=("doc-0",),
             check=lambda ctx, res: stored_doc_ids(ctx) == {"doc-0"}),
    # The flow run itself (what `nkv serve` and a deployment run) ends Failed with the same line, not Completed.
    not_done("flow-run-failed-on-disk-full-mid-batch", RUN, "1 of 3 documents stored (kept), 2 not",
             setup=with_flow_run(disk_fills_after(1)), runs=("failed",), done=("doc-0",),
             check=flow_run_failed("write failed", "File too large", "1 of 3 documents stored (kept), 2 not stored",
                                   stored={"doc-0"})),
    not_done("every-write-fails", RUN, "write failed", "0 of 2 documents stored", setup=with_flow_run(every_write_fails),
             runs=("completed", "failed"), done=(), check=flow_run_failed("0 of 2 documents stored", stored=set())),
    error("db-in-memory", run_with("--db", ":memory:"), ":memory:", "would lose every result"),
    ok("db-with-tilde", run_with("--db", "~/stores/x.duckdb"), setup=home_in_tmp,
       check=lambda ctx, res: not (ctx.tmp / "~").exists()),
    error("db-held-by-another-process", RUN, "another process holds", "DuckDB allows one writer", setup=held()),
    ok("db-held-then-released-with-wait", run_with("--wait", "60"), "held by another writer", setup=held(1.5),
       runs=("completed", "completed")),

    # ---- the prefill cache owns only its own entries
    ok("prefill-cache-keeps-foreign-files", run_with("--model", "{tmp}/tiny", "--prefill-cache", "{tmp}/models",
                                                      "--prefill-cache-gb", "1e-9"),
       setup=foreign_weights, check=foreign_weights_intact),

    # ---- nkv query: exactly one read-only statement, nothing outside the store
    query("COPY runs TO 'x.csv'", "COPY", check=no_file("x.csv")),
    query("COPY runs TO '{tmp}/kept.csv'", "COPY", setup=lambda ctx: (a_store(ctx), write_file(
        "kept.csv", b"keep me\n", as_input=False)(ctx), ctx.snapshot(ctx.tmp / "kept.csv"))),
    query("EXPORT DATABASE '{tmp}/dump'", "EXPORT", check=no_file("dump")),
    query("ATTACH '{tmp}/other.duckdb' AS a (READ_WRITE)", "ATTACH", check=no_file("other.duckdb")),
    query("ATTACH '{tmp}/o.duckdb' AS a; CREATE TABLE a.t AS SELECT 1", "exactly one", check=no_file("o.duckdb")),
    query("ATTACH '{tmp}/link.duckdb' AS a (READ_WRITE); INSERT INTO a.runs (run_id) VALUES ('x')", "exactly one",
          setup=lambda ctx: (a_store(ctx), os.link(ctx.db, ctx.tmp / "link.duckdb"))),
    query("SELECT 1; DROP TABLE runs", "exactly one", "found 2"),
    query("COPY runs TO '{tmp}/y.csv'; DROP TABLE runs", "exactly one", check=no_file("y.csv")),
    query("INSTALL httpfs", "refused"),
    query("LOAD httpfs", "refused"),
    query("SELECT * FROM read_text('/etc/hostname')", "query failed"),
    query("SELECT * FROM read_csv('{tmp}/kept.csv')", "query failed",
          setup=lambda ctx: (a_store(ctx), write_file("kept.csv", b"a\n1\n", as_input=False)(ctx))),
    query("SELECT * FROM glob('/etc/*')", "Permission Error"),
    query("SELECT * FROM read_blob('/etc/passwd')", "Permission Error"),
    query("SELECT * FROM '{tmp}/batch.parquet'", "Permission Error"),
    query("SELECT getenv('HOME')", "query failed"),
    query("EXPLAIN ANALYZE SELECT 1", "EXPLAIN statements are refused"),
    query("CALL pragma_version()", "CALL statements are refused"),
    query("SET enable_external_access = true", "refused"),
    query("DELETE FROM runs", "refused"),
    query("CREATE TABLE t AS SELECT 1", "refused"),
    query("PRAGMA enable_profiling", "refused"),
    query("SELEC nothing", "query failed"),
    error("query-held-db", ["query", "SELECT 1", "--db", "{db}"], "another process holds", "after waiting",
          setup=lambda ctx: (ctx.monkeypatch.setattr("pipeline.store.READER_WAIT_S", 0.3), held()(ctx))),
    error("report-missing-db", ["report", "--db", "{db}", "--out", "{tmp}/rep"], "runs.duckdb",
          check=no_file("rep")),
    error("query-missing-db", ["query", "SELECT 1", "--db", "{db}"], "no such database file"),
    error("query-foreign-db", ["query", "SELECT * FROM runs", "--db", "{db}"], "not a nestedkv store",
          setup=foreign_duckdb("CREATE TABLE runs (id INTEGER)")),
    ok("query-select", ["query", "SELECT count(*) AS n_runs FROM runs", "--db", "{db}", "--format", "csv"],
       setup=a_store, runs=("completed",), done=(), check=lambda ctx, res: _stdout(res, "n_runs\"\n1\n")),
    ok("query-describe", ["query", "DESCRIBE runs", "--db", "{db}", "--format", "json"], setup=a_store, done=(),
       check=lambda ctx, res: _stdout(res, '"column_name": "run_id"')),

    # ---- nkv query: every type in every format, duplicate names kept, nothing raw reaches the terminal
    *(ok(f"query-every-type-{fmt}", ["query", EVERY_TYPE, "--db", "{db}", "--format", fmt], setup=a_store, done=(),
         check=parses_as(fmt)) for fmt in ("table", "csv", "json")),
    ok("query-duplicate-names-table", ["query", "SELECT 1 AS a, 2 AS a", "--db", "{db}"], setup=a_store, done=(),
       check=lambda ctx, res: _stdout(res, "│ 1 │ 2 │")),
    ok("query-duplicate-names-csv", ["query", "SELECT 1 AS a, 2 AS a", "--db", "{db}", "--format", "csv"],
       setup=a_store, done=(), check=lambda ctx, res: _stdout(res, '"a","a"\n1,2\n')),
    ok("query-duplicate-names-json", ["query", "SELECT 1 AS a, 2 AS a, 3 AS a_2", "--db", "{db}", "--format", "json"],
       setup=a_store, done=(), check=lambda ctx, res: strict_json(res.stdout) == [{"a": 1, "a_3": 2, "a_2": 3}]),
    ok("query-control-characters-csv", ["query", "SELECT chr(27) || '[2J' || chr(10) || 'x' AS t", "--db", "{db}",
                                        "--format", "csv"], setup=a_store, done=(),
       check=lambda ctx, res: _stdout(res, '"t"\n"\\x1b[2J\\x0ax"\n')),
    ok("query-table-shows-the-first-rows", ["query", "SELECT * FROM range(50)", "--db", "{db}"], "first 20 rows",
       setup=lambda ctx: (a_store(ctx), ctx.monkeypatch.setattr("flows.output.TABLE_ROWS", 20)), done=(),
       check=lambda ctx, res: "│ 19 " in res.stdout and "│ 20 " not in res.stdout),
    not_done("query-timeout", ["query", "SELECT count(*) FROM range(10000000000000)", "--db", "{db}", "--timeout",
                               "0.5"], "query stopped after 0.5 s", setup=a_store),
    error("query-timeout-negative", ["query", "SELECT 1", "--db", "{db}", "--timeout", "-1"], "--timeout",
          setup=a_store),
    error("query-timeout-nan", ["query", "SELECT 1", "--db", "{db}", "--timeout", "nan"], "--timeout", setup=a_store),

    # ---- user text is literal: Rich markup and terminal escapes from input
    error("markup-in-missing-input", run_with("--input", "{tmp}/a[/red]b.parquet"), "[/red]"),
    error("markup-in-bad-input-path", run_with("--input", "{tmp}/we[/]ird/n.txt"), "we[/]ird",
          "not a readable Parquet file", setup=write_file("we[/]ird/n.txt", b"text")),
    ok("markup-doc_ids", RUN, "skipped row 4 (bad[/])",
       setup=batch({"doc_id": "[/]", "text": "closing tag"}, {"doc_id": "[/red]x", "text": "more text"},
                   {"doc_id": "bad[/]", "text": None}),
       bad_rows=1, done=GOOD + ("[/]", "[/red]x")),
    ok("markup-in-db-path", RUN, "x[/]y[/red]/runs.duckdb",
       setup=lambda ctx: setattr(ctx, "db", ctx.tmp / "x[/]y[/red]" / "runs.duckdb")),
    error("newline-in-input-path", run_with("--input", "{tmp}/two\nlines.parquet"), "two\\x0alines"),
    ok("newline-doc_id", RUN, "skipped row 2 (a\\x0ab)", setup=batch({"doc_id": "a\nb", "text": None}), bad_rows=1),
    ok("escape-sequence-doc_id", RUN, "\\x1b[31mred", setup=batch({"doc_id": "\x1b[31mred", "text": None}),
       bad_rows=1),
    ok("osc-sequence-doc_id", RUN, "\\x1b]0;pwned\\x07", setup=batch({"doc_id": "\x1b]0;pwned\x07", "text": ""}),
       bad_rows=1),
    ok("escape-sequence-in-good-doc_id", RUN, "3 done", setup=batch({"doc_id": "\x1b[2Jclear", "text": "fine"}),
       done=GOOD + ("\x1b[2Jclear",)),

    not_done("qa-one-question-too-long", run_with("--task", "qa"), "1 of 3 results did not end ok",
             setup=batch({"doc_id": "doc-q", "text": "A short document.", "questions": ["Who?", LONG_QUESTION]}),
             check=only_the_long_question_lost),
    ok("document-past-the-window", RUN, "3 done", setup=batch({"doc_id": "doc-long", "text": LONG_TEXT}),
       done=GOOD + ("doc-long",), check=lambda ctx, res: read_modes(ctx) == {"doc-0": "whole", "doc-1": "whole",
                                                                              "doc-long": "map_reduce"}),
    ok("document-past-the-window-streamed", run_with("--long-docs", "stream"), "3 done",
       setup=batch({"doc_id": "doc-long", "text": LONG_TEXT}), done=GOOD + ("doc-long",),
       check=lambda ctx, res: read_modes(ctx)["doc-long"] == "stream"),
    ok("document-past-the-window-steered", run_with("--press", "snapkv", "--long-docs", "stream"), "3 done",
       setup=batch({"doc_id": "doc-long", "text": LONG_TEXT}), done=GOOD + ("doc-long",),
       check=lambda ctx, res: read_modes(ctx)["doc-long"] == "stream"),
    not_done("document-over-max-doc-tokens", run_with("--max-doc-tokens", "1000"), "1 of 3 results did not end ok",
             setup=batch({"doc_id": "doc-long", "text": LONG_TEXT}),
             check=lambda ctx, res: over_limit(ctx, "tokens, over --max-doc-tokens 1,000")),
    not_done("document-over-max-doc-tokens-unread", run_with("--max-doc-tokens", "500"), "did not end ok",
             setup=batch({"doc_id": "doc-long", "text": LONG_TEXT}),
             check=lambda ctx, res: over_limit(ctx, f"{len(LONG_TEXT):,} characters", "over the limit of 4,000")),
    ok("split-marker-in-a-document", RUN, "3 done", setup=batch({"doc_id": "doc-q", "text": SPLIT_TEXT}),
       done=GOOD + ("doc-q",), check=lambda ctx, res: _context_holds_all_of("doc-q", SPLIT_TEXT, ctx)),
    not_done("too-long-with-truncate", run_with("--long-docs", "truncate", "--max-new-tokens", "5000"),
             "did not end ok", done=(), check=lambda ctx, res: all(
                 "lower --max-new-tokens" in r["error"] and "--long-docs" not in r["error"]
                 for r in rows(ctx.db, "SELECT error FROM outputs"))),
    not_done("too-long-refused", run_with("--long-docs", "refuse", "--max-new-tokens", "5000"),
             "did not end ok", done=(), check=lambda ctx, res: all(
                 "--long-docs stream" in r["error"] for r in rows(ctx.db, "SELECT error FROM outputs"))),

    # ---- resume and re-runs
    ok("rerun-does-nothing-twice", RUN, "0 runs", "2 already done", setup=lambda ctx: ctx.earlier_run(),
       runs=("completed",)),
    ok("same-text-new-doc_id-gets-its-own-rows", RUN, "1 done", "2 already done",
       setup=lambda ctx: (ctx.earlier_run(), batch({"doc_id": "copy-of-0", "text": docs()[0]["text"]})(ctx)),
       runs=("completed", "completed"), done=GOOD + ("copy-of-0",)),
    ok("summary-after-another-writer-took-the-store", RUN, "2 done", setup=lambda ctx: ctx.steal_after_flow()),
]


def _parquet(ctx, columns: dict) -> bytes:
    path = ctx.tmp / "_t.parquet"
    pq.write_table(pa.table(columns), path)
    return path.read_bytes()


def rows(db, sql: str) -> list[dict]:
    with Store(db, read_only=True) as s:
        return s.query(sql).to_pylist()


def _outputs(ctx, n: int) -> None:
    got = rows(ctx.db, "SELECT status FROM outputs")
    assert [r["status"] for r in got] == ["ok"] * n


def _stdout(res, text: str) -> None:
    assert text in res.stdout, res.stdout


class Ctx:
    """One row's folder: the good batch as input, a store path that does not exist yet, and what to undo."""

    def __init__(self, tmp: Path, monkeypatch):
        self.tmp = tmp
        self.monkeypatch = monkeypatch
        self.input = write_batch(tmp / "batch.parquet", docs())
        self.db = tmp / "store" / "runs.duckdb"
        self.vars: dict = {}
        self.snapshots: dict = {}
        self.cleanup: list[Callable] = []

    def fill(self, args: list[str]) -> list[str]:
        return [a.replace("{input}", str(self.input)).replace("{db}", str(self.db)).replace("{tmp}", str(self.tmp))
                .replace("{file}", self.vars.get("file", "")).replace("{ro}", self.vars.get("ro", ""))
                for a in args]

    def snapshot(self, path) -> None:
        self.snapshots[Path(path)] = hashlib.sha256(Path(path).read_bytes()).hexdigest()

    def unchanged(self) -> None:
        for path, digest in self.snapshots.items():
            assert hashlib.sha256(path.read_bytes()).hexdigest() == digest, f"{path} changed"

    def read_only_folder(self) -> None:
        if os.geteuid() == 0:  # root writes anywhere a chmod allows; /proc refuses new files even to root
            self.vars["ro"] = "/proc"
            return
        folder = self.tmp / "ro"
        folder.mkdir()
        folder.chmod(0o555)
        self.cleanup.append(lambda: folder.chmod(0o755))
        self.vars["ro"] = str(folder)

    def api_url(self, url: str) -> None:
        """Prefect configured with this server URL for the row (as PREFECT_API_URL would)."""
        from prefect.settings import PREFECT_API_URL, temporary_settings

        settings = temporary_settings(updates={PREFECT_API_URL: url})
        settings.__enter__()
        done = []
        self.cleanup.append(lambda: done or (done.append(1), settings.__exit__(None, None, None)))

    def earlier_run(self) -> None:
        """The good batch already done, by the same command."""
        res = invoke(self.fill(RUN))
        assert res.exit_code == 0, res.output

    def steal_after_flow(self) -> None:
        """Another process takes the store right after the flow returns, before the CLI prints its summary."""
        import flows.batch as batch_mod

        real = batch_mod.artifacts.publish_report

        def publish_then_steal(*a, **kw):
            real(*a, **kw)
            held(make_store=False)(self)

        self.monkeypatch.setattr(batch_mod.artifacts, "publish_report", publish_then_steal)


def invoke(args: list[str]):
    follow_stderr()
    try:
        return CliRunner().invoke(app, args)
    finally:
        follow_stderr()


def follow_stderr() -> None:
    """Prefect's console log handlers keep the stream they were built with, and CliRunner gives each command
    its own sys.stderr (closed afterwards): make them write to whatever sys.stderr is now, as in a process."""
    from prefect.logging.handlers import PrefectConsoleHandler

    loggers = [logging.getLogger(), *(lg for lg in logging.Logger.manager.loggerDict.values()
                                      if isinstance(lg, logging.Logger))]
    for handler in (h for lg in loggers for h in lg.handlers if isinstance(h, PrefectConsoleHandler)):
        handler.console._file, handler.console.stderr = None, True  # rich resolves sys.stderr per write
        handler.stream = sys.__stderr__


@pytest.fixture
def started(monkeypatch):
    """Records each flow (or, for ``eval``, engine run) the CLI starts."""
    import flows.local_server as local_server
    import pipeline.engine as engine

    seen = []
    real_api, real_run = local_server.local_api, engine.run
    monkeypatch.setattr(local_server, "local_api", lambda *a, **k: (seen.append("flow"), real_api(*a, **k))[1])
    monkeypatch.setattr(engine, "run", lambda *a, **k: (seen.append("engine"), real_run(*a, **k))[1])
    return seen


@pytest.fixture(autouse=True)
def keep_sigterm():
    """The CLI installs SIGTERM and SIGINT handlers; the test process gets its own back."""
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, handler in before.items():
        signal.signal(s, handler)


def one_error_line(res, words) -> str:
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("error: "), lines[0]
    for w in words:
        assert w.lower() in lines[0].lower(), f"{w!r} not in {lines[0]!r}"
    return lines[0]


def runs_a_flow(case: Case) -> bool:
    return case.code in (0, 1) and case.args[0] in ("run", "sweep")


def marks(case: Case) -> list:
    # A row that runs a flow needs the Prefect server: the slow lane's
    return ([pytest.mark.xfail(reason=case.xfail, strict=True)] if case.xfail else []) + \
        ([pytest.mark.slow] if runs_a_flow(case) else [])


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=marks(c)) for c in CASES])
def test_matrix(case: Case, tmp_path, monkeypatch, request, started):
    if runs_a_flow(case):
        request.getfixturevalue("prefect_api")
    ctx = Ctx(tmp_path, monkeypatch)
    try:
        with use_tiny_model(monkeypatch):
            if case.setup:
                case.setup(ctx)
            created_before = ctx.db.exists()
            res = invoke(ctx.fill(case.args))
        for undo in ctx.cleanup:  # release what the row held before reading the store
            undo()
        assert res.exit_code == case.code, res.output
        assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
        assert "Traceback" not in res.output and "\x1b" not in res.output, res.output
        if case.code == 1:
            lines = [line for line in res.stderr.splitlines() if line.strip()]
            assert lines[-1].startswith("error: ") and sum(x.startswith("error:") for x in lines) == 1, res.stderr
            for w in case.words:
                assert ctx.fill([w])[0] in res.stderr, res.stderr
            if case.args[0] != "query":
                check_store(case, ctx)
        elif case.code:
            one_error_line(res, [ctx.fill([w])[0] for w in case.words])
            assert not started, "a flow started before the error"
            if not created_before:
                assert not ctx.db.exists() and not ctx.db.parent.exists(), "a store was created"
            ctx.unchanged()
        else:
            for w in case.words:
                assert ctx.fill([w])[0] in res.stderr, res.stderr
            if case.args[0] != "query":
                check_store(case, ctx)
        if case.check:
            assert case.check(ctx, res) in (None, True)
    finally:
        for undo in ctx.cleanup:
            undo()


def check_store(case: Case, ctx: Ctx) -> None:
    runs = rows(ctx.db, "SELECT run_id, status FROM runs ORDER BY created_at")
    assert [r["status"] for r in runs] == list(case.runs)
    last = runs[-1]["run_id"] if runs else None
    errors = rows(ctx.db, f"SELECT field FROM input_errors WHERE run_id = '{last}'")
    assert len(errors) == case.bad_rows, errors
    if case.bad_field:
        assert errors[0]["field"] == case.bad_field
    out = rows(ctx.db, "SELECT doc_id, status, count(*) AS n FROM outputs "
                       "GROUP BY run_id, doc_id, question_idx, status")
    assert all(r["n"] == 1 for r in out), "duplicate output rows"
    for doc_id in case.done:
        mine = [r for r in out if r["doc_id"] == doc_id]
        assert mine and all(r["status"] == "ok" for r in mine), (doc_id, out)


def test_matrix_covers_the_issue():
    assert len(CASES) + SIGNAL_ROWS >= 185


# -- signals and crashes: the real command in a subprocess ---------------------------------------------
SIGNAL_ROWS = 10  # the cases below (signals, Ctrl-C in a long document, crash, --verbose, --wait expiring, nkv query: Ctrl-C, streaming, read during a batch)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model_dir(tmp_path_factory.mktemp("model") / "tiny"))


@pytest.fixture(scope="module")
def prefect_env(prefect_api, tmp_path_factory) -> dict:
    """The session's Prefect settings as environment variables: a temporary server that a subprocess starts
    uses the session server's database, already migrated (a fresh one costs seconds)."""
    from prefect.settings import get_current_settings

    return {**get_current_settings().to_environment_variables(exclude_unset=True),
            "PREFECT_HOME": str(tmp_path_factory.mktemp("prefect"))}


IGNORE_SIGINT_THEN_EXEC = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); os.execv(sys.argv[1], sys.argv[1:])"


class Batch:
    """``nkv run`` over four documents in a subprocess, stopped while the second document starts."""

    def __init__(self, tmp: Path, model_dir: str, prefect_env: dict, own_server: bool, sigint_ignored: bool = False,
                 documents: Optional[list[dict]] = None, **env):
        self.tmp, self.model_dir = tmp, model_dir
        self.db = tmp / "runs.duckdb"
        self.input = write_batch(tmp / "four.parquet", documents or docs(4))
        self.marks = tmp / "marks"
        self.args = ["run", "--input", self.input, "--model", model_dir, "--db", str(self.db),
                     "--max-new-tokens", "2", "--retries", "0"]
        e = {**os.environ, **prefect_env, "PYTHONPATH": str(ROOT), "NKV_TEST_MARKS": str(self.marks),
             "NKV_TEST_PAUSE_AT": "doc-1", "NKV_TEST_PAUSE_S": "600", **env}
        if own_server:  # without a configured server the command starts its own temporary one
            e.pop("PREFECT_API_URL", None)
        self.err = tmp / "stderr.txt"  # a file, not a pipe: a full pipe would stall the command
        with open(tmp / "stdout.txt", "w") as out, open(self.err, "w") as err:
            # sigint_ignored: started as a non-interactive shell starts a background job (`nkv run ... &`); an
            # ignored signal stays ignored across exec
            ignoring = [sys.executable, "-c", IGNORE_SIGINT_THEN_EXEC] if sigint_ignored else []
            self.proc = subprocess.Popen([*ignoring, sys.executable, str(ROOT / "tests" / "slow_cli.py"), *self.args],
                                         env=e, stdout=out, stderr=err, cwd=tmp)

    def wait_for(self, doc_id: str, timeout: float = 120) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.marks.exists() and doc_id in self.marks.read_text().split():
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"nkv ended early ({self.proc.returncode}): {self.err.read_text()[-3000:]}")
            time.sleep(0.1)
        raise AssertionError(f"{doc_id} never started")

    def finish(self, timeout: float = 60) -> tuple[int, str]:
        self.proc.wait(timeout)
        return self.proc.returncode, self.err.read_text()

    def servers(self) -> list[int]:
        """Pids of the temporary Prefect server this command started (flows.local_server PARENT_PID ...)."""
        out = subprocess.run(["ps", "-A", "-o", "pid=,args="], capture_output=True, text=True).stdout
        return [int(line.split()[0]) for line in out.splitlines()
                if f"flows.local_server {self.proc.pid} " in line]

    def statuses(self) -> list[str]:
        return [r["status"] for r in rows(self.db, "SELECT status FROM runs ORDER BY created_at")]

    def rerun(self) -> None:
        """The same command again, in-process: it completes the batch, each document once."""
        res = invoke(self.args)
        assert res.exit_code == 0, res.output
        counts = rows(self.db, "SELECT doc_id, count(*) AS n, bool_and(status = 'ok') AS ok FROM outputs "
                               "GROUP BY doc_id ORDER BY doc_id")
        assert counts == [{"doc_id": f"doc-{i}", "n": 1, "ok": True} for i in range(4)]


def gone_within(pids: list[int], seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not any(Path(f"/proc/{p}").exists() or _alive(p) for p in pids):
            return True
        time.sleep(0.2)
    return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie still answers kill(pid, 0); it holds nothing, so it counts as gone
    out = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    return bool(out) and not out.startswith("Z")


@pytest.fixture(scope="module")
def batches(tmp_path_factory, model_dir, prefect_env):
    """The subprocess cases, started together: one setup, and each spends its start waiting more than working.
    SIGTERM and SIGKILL hit a command running its own temporary Prefect server; the others use the session's."""
    def start(name: str, own_server: bool, **env) -> Batch:
        return Batch(tmp_path_factory.mktemp(name), model_dir, prefect_env, own_server, **env)

    # SIGINT: inherited ignored, which used to leave the interrupted command holding the store
    started = {"SIGTERM": start("term", True), "SIGINT": start("int", False, sigint_ignored=True),
               "SIGKILL": start("kill", True),
               "crash": start("crash", False, NKV_TEST_CRASH_AT="doc-2", NKV_TEST_PAUSE_AT="")}
    yield started
    for b in started.values():
        if b.proc.poll() is None:
            b.proc.kill()
            b.proc.wait()


@pytest.mark.slow  # real commands in subprocesses, with a Prefect server
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_signal_during_a_run_exits_cleanly(sig, code, batches):
    """The run is closed (not left ``running``), the finished document kept, the temporary server stopped.
    Meanwhile a second command on the same store is refused at once, or with ``--wait`` waits for the first
    to end and then does the rest."""
    b = batches[sig.name]
    b.wait_for("doc-1")
    servers = b.servers()
    assert bool(servers) == (sig == signal.SIGTERM)
    if sig == signal.SIGTERM:
        second = invoke(b.args)
        assert second.exit_code == 2
        one_error_line(second, ["another process holds"])
        b.proc.send_signal(sig)
    else:
        threading.Timer(1.0, b.proc.send_signal, [sig]).start()
        second = invoke(b.args + ["--wait", "120"])
        assert second.exit_code == 0, second.output
        assert "held by another writer" in second.stderr and "3 done" in second.stderr
    rc, err = b.finish()
    assert rc == code, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert gone_within(servers, 60), "the temporary Prefect server outlived the command"
    done = rows(b.db, "SELECT doc_id, count(*) AS n, bool_and(status = 'ok') AS ok FROM outputs "
                      "GROUP BY doc_id ORDER BY doc_id")
    if sig == signal.SIGTERM:
        assert b.statuses() == ["failed"]
        assert done == [{"doc_id": "doc-0", "n": 1, "ok": True}]
    else:
        assert b.statuses() == ["failed", "completed"]
        assert done == [{"doc_id": f"doc-{i}", "n": 1, "ok": True} for i in range(4)]


@pytest.mark.slow  # a real command in a subprocess, with a Prefect server
def test_ctrl_c_in_a_long_document_keeps_the_finished_ones(tmp_path, model_dir, prefect_env):
    """Ctrl-C while a document far past the window is being read (in parts, the default): exit 130, no
    traceback, the run closed, the documents before it stored, nothing of the interrupted one."""
    long = {"doc_id": "doc-long", "text": LONG_TEXT * 40, "questions": ["Who?"]}  # ~250k byte tokens, ~60 parts
    b = Batch(tmp_path, model_dir, prefect_env, False, documents=docs(2) + [long], NKV_TEST_PAUSE_AT="")
    b.wait_for("doc-long")
    time.sleep(3)  # well into its parts
    assert b.proc.poll() is None, "the long document was read before the interrupt"
    b.proc.send_signal(signal.SIGINT)
    rc, err = b.finish()
    assert rc == 130 and "Traceback" not in err, err[-3000:]
    assert b.statuses() == ["failed"]
    done = rows(b.db, "SELECT doc_id, bool_and(status = 'ok') AS ok FROM outputs GROUP BY doc_id ORDER BY doc_id")
    assert done == [{"doc_id": "doc-0", "ok": True}, {"doc_id": "doc-1", "ok": True}]


@pytest.mark.slow  # real commands in subprocesses, with a Prefect server
def test_sigkill_leaves_no_process_and_the_next_command_closes_the_run(batches):
    b = batches["SIGKILL"]
    b.wait_for("doc-1")
    servers = b.servers()
    assert servers, "the command did not start its own temporary server"
    b.proc.kill()
    b.finish()
    assert gone_within(servers, 60), "the temporary Prefect server outlived a SIGKILLed command"
    assert b.statuses() == ["running"]  # nothing could close it
    b.rerun()
    assert b.statuses() == ["interrupted", "completed"]


@pytest.mark.slow  # real commands in subprocesses, with a Prefect server
def test_crash_between_documents_then_resume(batches):
    b = batches["crash"]
    rc, _ = b.finish(timeout=120)
    assert rc == 70
    assert b.statuses() == ["running"]
    assert [r["doc_id"] for r in rows(b.db, "SELECT doc_id FROM outputs ORDER BY doc_id")] == ["doc-0", "doc-1"]
    b.rerun()
    assert b.statuses() == ["interrupted", "completed"]


def test_verbose_shows_the_traceback_before_the_line(tmp_path):
    res = invoke(["--verbose", "run", "--input", str(tmp_path / "missing.parquet")])
    assert res.exit_code == 2
    assert "Traceback" in res.stderr and "InputError" in res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "no such file" in last



def test_wait_that_expires_is_one_error_after_the_progress_lines(tmp_path, monkeypatch, started):
    ctx = Ctx(tmp_path, monkeypatch)
    held()(ctx)
    try:
        with use_tiny_model(monkeypatch):
            res = invoke(ctx.fill(run_with("--wait", "1")))
    finally:
        for undo in ctx.cleanup:
            undo()
    assert res.exit_code == 2 and not started
    *waits, last = res.stderr.strip().splitlines()
    assert waits and all("held by another writer; waited" in w for w in waits), res.stderr
    assert last.startswith("error: ") and "another process holds" in last and "after waiting 1s" in last
    ctx.unchanged()


def test_query_results_reach_the_writer_in_batches(tmp_path, monkeypatch):
    """A large result is written as it is read, never held whole: the JSON writer gets bounded batches."""
    import flows.output as output

    db = tmp_path / "runs.duckdb"
    Store(db).close()
    sizes, real = [], output.JsonWriter.write
    monkeypatch.setattr(output.JsonWriter, "write", lambda self, b: (sizes.append(b.num_rows), real(self, b))[1])
    res = invoke(["query", "SELECT range AS i FROM range(20000)", "--db", str(db), "--format", "json"])
    assert res.exit_code == 0, res.output
    assert sum(sizes) == 20000 and len(sizes) > 1 and max(sizes) <= 4096, sizes
    assert [r["i"] for r in strict_json(res.stdout)] == list(range(20000))


WRITER = """
import sys
from pipeline.config import RunConfig
from pipeline.results import DocumentResult, QuestionResult
from pipeline.store import Store

with Store(sys.argv[1]) as s:
    run = s.start_run(RunConfig(model="m"), "in")
    for i in range(int(sys.argv[2])):
        s.write_document(run, DocumentResult(f"doc-{i}", f"{i:064x}", 9, questions=[QuestionResult(0, "q?", "a")]))
        print("stored", i + 1, flush=True)
        sys.stdin.readline()  # the test says when to store the next one
    s.finish_run(run, "completed")
"""


def test_nkv_query_reads_the_store_while_a_batch_writes_it(tmp_path):
    """A batch holds the DuckDB file only while it stores a document: between documents `nkv query` reads
    every finished one, a second batch is still refused, and a reader holding the file delays the writer
    instead of failing it."""
    db = tmp_path / "runs.duckdb"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(db), "3"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        for n in (1, 2):
            assert writer.stdout.readline().split() == ["stored", str(n)]
            res = invoke(["query", "SELECT count(*) AS n FROM outputs", "--db", str(db), "--format", "csv"])
            assert res.exit_code == 0 and res.stdout == f'"n"\n{n}\n', res.output
            if n == 1:
                writer.stdin.write("\n")
                writer.stdin.flush()
        with pytest.raises(Exception, match="an nkv batch is writing it"):
            Store(db)  # the one-writer guarantee holds between the batch's transactions too
        reader = duckdb.connect(str(db), read_only=True)  # a reader that holds the file while the writer goes on
        writer.stdin.write("\n")
        writer.stdin.flush()
        time.sleep(0.5)
        assert writer.poll() is None
        reader.close()
        assert writer.stdout.readline().split() == ["stored", "3"]  # it waited for the reader, then stored
        writer.stdin.write("\n")
        writer.stdin.close()
        assert writer.wait(30) == 0
        assert rows(db, "SELECT status FROM runs") == [{"status": "completed"}]
    finally:
        writer.kill()
