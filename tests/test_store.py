"""The DuckDB store: schema, idempotent per-document transactions, views, resume, read-only and locking."""

import subprocess
import sys
import textwrap

import duckdb
import pytest

import pipeline.store as store_mod
from nestedkv.accounting import LayerMemory
from pipeline.config import RunConfig
from pipeline.results import ERROR, OK, DocumentResult, QuestionResult
from pipeline.store import VIEWS, Store, StoreError, lake, schema

MIB = 1024 * 1024


def layers(kept_per_layer, tokens=100, heads=2, head_dim=64, itemsize=4):
    """LayerMemory records for a document; bytes follow from kept rows the way the cache counts them."""
    row = 2 * heads * head_dim * itemsize  # keys + values, all heads, one position
    out = []
    for i, (kmin, kmax, kmean) in enumerate(kept_per_layer):
        out.append(LayerMemory(
            layer=i, n_kv_heads=heads, head_dim=head_dim, dtype="float32", tokens_seen=tokens,
            kept_min=kmin, kept_max=kmax, kept_mean=kmean,
            bytes_full=tokens * row, bytes_kept=int(kmean * row), bytes_resident=kmax * row,
        ))
    return out


def doc(doc_id="d1", sha="a" * 64, n_q=2, status=OK, kept=((25, 25, 25.0), (10, 40, 25.0)), **kw):
    qs = [
        QuestionResult(question_idx=i, question=f"q{i}?", output=f"answer {i}", gold=f"gold {i}",
                       n_question_tokens=5, n_generated=8, decode_s=0.5)
        for i in range(n_q)
    ]
    return DocumentResult(doc_id=doc_id, content_sha256=sha, n_chars=1000, title="T", n_tokens=100,
                          status=status, prefill_s=2.0, compress_s=0.1, peak_prefill_bytes=10 * MIB,
                          peak_decode_bytes=12 * MIB, questions=qs, layers=layers(kept), **kw)


@pytest.fixture
def db(tmp_path):
    with Store(tmp_path / "runs.duckdb") as s:
        yield s


def count(store, table, where="TRUE"):
    return store.query(f"SELECT count(*) AS n FROM {table} WHERE {where}").column("n")[0].as_py()


def test_schema_and_views_exist(db):
    tables = set(db.query("SELECT table_name FROM duckdb_tables()").column("table_name").to_pylist())
    assert {"runs", "documents", "outputs", "layer_memory", "evaluations", "input_errors",
            "schema_version"} <= tables
    views = set(db.query("SELECT view_name FROM duckdb_views() WHERE NOT internal").column("view_name").to_pylist())
    assert set(VIEWS) <= views
    assert db.query("SELECT version FROM schema_version").column("version").to_pylist() == [store_mod.SCHEMA_VERSION]
    cols = db.query("SELECT * FROM quality_vs_full").column_names
    for c in ["run_id", "reference_run_id", "press", "compression_ratio", "head_budget", "metric",
              "mean_value", "n", "kept_share"]:
        assert c in cols


def test_start_and_finish_run(db):
    cfg = RunConfig(compression_ratio=0.5, budget=64, head_budget="adaptive")
    run = db.start_run(cfg, "data/in.parquet")
    assert len(run.split("-")[1]) == 6 and run[8] == "T"
    row = db.query("SELECT * FROM runs").to_pylist()[0]
    assert row["status"] == "running" and row["config_hash"] == cfg.config_hash()
    assert row["reference_config_hash"] == cfg.reference().config_hash()
    assert (row["budget"], row["head_budget"], row["input"]) == (64, "adaptive", "data/in.parquet")

    db.write_document(run, doc("d1", "a" * 64))
    db.write_document(run, doc("d2", "b" * 64, status=ERROR, error="boom"))

    class Err:
        source, row, doc_id, field, message = "f.parquet", 3, None, "text", "missing (null)"

    db.write_input_errors(run, [Err()])
    db.write_input_errors(run, [Err()])  # a retried write replaces, never duplicates
    assert count(db, "input_errors") == 1
    db.finish_run(run, "completed")
    row = db.query("SELECT * FROM runs").to_pylist()[0]
    assert (row["status"], row["n_documents"], row["n_errors"]) == ("completed", 2, 2)
    assert row["finished_at"] >= row["created_at"]
    with pytest.raises(ValueError):
        db.finish_run(run, "done")


def test_write_document_rows(db):
    run = db.start_run(RunConfig(), "x")
    r = doc()
    db.write_document(run, r)
    out = db.query("SELECT * FROM outputs ORDER BY question_idx").to_pylist()
    assert [o["question_idx"] for o in out] == [0, 1]
    assert out[1]["output"] == "answer 1" and out[1]["gold"] == "gold 1"
    assert out[0]["prefill_tok_s"] == pytest.approx(r.prefill_tok_s)
    assert out[0]["decode_tok_s"] == pytest.approx(r.questions[0].decode_tok_s)
    assert out[0]["peak_decode_bytes"] == r.peak_decode_bytes
    lm = db.query("SELECT * FROM layer_memory ORDER BY layer").to_pylist()
    assert [{k: v for k, v in row.items() if k in LayerMemory.field_names()} for row in lm] == [
        x.as_dict() for x in r.layers
    ]
    assert db.query("SELECT * FROM documents").to_pylist() == [
        {"doc_id": "d1", "content_sha256": "a" * 64, "n_chars": 1000, "n_tokens": 100, "title": "T"}
    ]


def test_document_without_questions_still_records_its_status(db):
    run = db.start_run(RunConfig(), "x")
    db.write_document(run, DocumentResult(doc_id="big", content_sha256="c" * 64, n_chars=9, status="too_long",
                                          error="context exceeds the model"))
    (row,) = db.query("SELECT question_idx, status, error FROM outputs").to_pylist()
    assert row == {"question_idx": None, "status": "too_long", "error": "context exceeds the model"}


def test_views_compute_shares_from_the_inputs(db):
    r1, r2 = doc("d1", "a" * 64), doc("d2", "b" * 64, kept=((50, 50, 50.0), (20, 80, 50.0)))
    run = db.start_run(RunConfig(compression_ratio=0.5), "x")
    db.write_document(run, r1)
    db.write_document(run, r2)
    all_layers = r1.layers + r2.layers
    full = sum(x.bytes_full for x in all_layers)
    kept = sum(x.bytes_kept for x in all_layers)
    resident = sum(x.bytes_resident for x in all_layers)

    (m,) = db.query("SELECT * FROM memory_savings").to_pylist()
    assert (m["run_id"], m["press"], m["n_documents"]) == (run, "nestedkv", 2)
    assert (m["bytes_full"], m["bytes_kept"], m["bytes_resident"]) == (full, kept, resident)
    assert m["kept_share"] == pytest.approx(kept / full)
    assert m["saved_share"] == pytest.approx(1 - kept / full)
    assert m["resident_share"] == pytest.approx(resident / full)
    assert m["saved_mib"] == pytest.approx((full - kept) / MIB)

    per_layer = db.query("SELECT * FROM layer_savings ORDER BY layer").to_pylist()
    assert [x["layer"] for x in per_layer] == [0, 1]
    for row in per_layer:
        ls = [x for x in all_layers if x.layer == row["layer"]]
        f, k = sum(x.bytes_full for x in ls), sum(x.bytes_kept for x in ls)
        assert row["kept_share"] == pytest.approx(k / f)
        assert row["saved_share"] == pytest.approx(1 - k / f)
        assert row["kept_min"] == pytest.approx(sum(x.kept_min for x in ls) / len(ls))
        assert row["kept_max"] == pytest.approx(sum(x.kept_max for x in ls) / len(ls))
        assert row["kept_mean"] == pytest.approx(sum(x.kept_mean for x in ls) / len(ls))


def test_quality_vs_full(db):
    cfg = RunConfig(compression_ratio=0.5)
    full_run = db.start_run(cfg.reference(), "x")
    other_full = db.start_run(cfg.reference().model_copy(update={"max_new_tokens": 7}), "x")  # not a twin
    run = db.start_run(cfg, "x")
    r = doc()
    db.write_document(run, r)
    gold_c, gold_f, agree = [0.2, 0.4], [0.5, 0.7], [0.9, 0.6]
    rows = []
    for i in range(2):
        rows.append({"run_id": run, "doc_id": "d1", "question_idx": i, "metric": "rougeL", "value": gold_c[i]})
        rows.append({"run_id": full_run, "doc_id": "d1", "question_idx": i, "metric": "rougeL", "value": gold_f[i]})
        rows.append({"run_id": other_full, "doc_id": "d1", "question_idx": i, "metric": "rougeL", "value": 0.0})
        rows.append({"run_id": run, "doc_id": "d1", "question_idx": i, "metric": "agreement", "value": agree[i],
                     "reference_run_id": full_run})
    db.write_evaluations(rows)
    db.write_evaluations(rows)  # replaced, not doubled
    assert count(db, "evaluations") == 8

    q = {x["metric"]: x for x in db.query("SELECT * FROM quality_vs_full").to_pylist()}
    assert set(q) == {"rougeL", "agreement"}
    kept_share = sum(x.bytes_kept for x in r.layers) / sum(x.bytes_full for x in r.layers)
    for m in q.values():
        assert (m["run_id"], m["reference_run_id"], m["press"], m["n"]) == (run, full_run, "nestedkv", 2)
        assert m["compression_ratio"] == 0.5 and m["kept_share"] == pytest.approx(kept_share)
    assert q["rougeL"]["mean_value"] == pytest.approx(sum(gold_c) / 2)
    assert q["rougeL"]["full_value"] == pytest.approx(sum(gold_f) / 2)
    assert q["rougeL"]["delta"] == pytest.approx((sum(gold_c) - sum(gold_f)) / 2)
    assert q["agreement"]["mean_value"] == pytest.approx(sum(agree) / 2)
    assert q["agreement"]["full_value"] is None


def test_resume_sees_only_ok_documents_of_the_same_config(db):
    cfg = RunConfig(compression_ratio=0.5)
    run = db.start_run(cfg, "x")
    assert db.done_documents(cfg) == set()
    db.write_document(run, doc("d1", "a" * 64))
    db.write_document(run, doc("d2", "b" * 64, status=ERROR, error="oom"))
    bad_q = doc("d3", "c" * 64)
    bad_q.questions[1].status, bad_q.questions[1].error = ERROR, "decode failed"
    db.write_document(run, bad_q)
    assert db.done_documents(cfg) == {("d1", "a" * 64)}
    assert db.done_documents(cfg.model_copy(update={"compression_ratio": 0.9})) == set()

    later = db.start_run(cfg, "x")  # a later run of the same configuration finishes the failed one
    db.write_document(later, doc("d2", "b" * 64))
    assert db.done_documents(cfg) == {("d1", "a" * 64), ("d2", "b" * 64)}


def test_rewriting_a_document_replaces_its_rows(db):
    run = db.start_run(RunConfig(), "x")
    db.write_document(run, doc(n_q=3))
    db.write_document(run, doc(n_q=2))
    assert count(db, "outputs") == 2
    assert count(db, "layer_memory") == 2
    assert count(db, "documents") == 1
    other = db.start_run(RunConfig(), "x")
    db.write_document(other, doc(n_q=2))
    assert count(db, "outputs") == 4 and count(db, "documents") == 1


def test_documents_upsert_n_tokens(db):
    run = db.start_run(RunConfig(), "x")
    db.write_document(run, doc())
    failed = doc()
    failed.n_tokens = 0  # failed before tokenizing: keeps the known count
    db.write_document(db.start_run(RunConfig(), "x"), failed)
    assert db.query("SELECT n_tokens FROM documents").column(0).to_pylist() == [100]
    retok = doc()
    retok.n_tokens = 130
    db.write_document(db.start_run(RunConfig(), "x"), retok)
    assert db.query("SELECT n_tokens FROM documents").column(0).to_pylist() == [130]


def test_crash_mid_document_leaves_no_partial_rows(db, monkeypatch):
    run = db.start_run(RunConfig(), "x")
    db.write_document(run, doc("d0", "0" * 64))

    def boom(*a, **k):
        raise RuntimeError("crash while building layer rows")

    monkeypatch.setattr(store_mod, "layer_memory_table", boom)
    with pytest.raises(RuntimeError, match="crash"):
        db.write_document(run, doc("d1", "a" * 64))
    assert count(db, "outputs", "doc_id = 'd1'") == 0
    assert count(db, "documents", "doc_id = 'd1'") == 0
    # A failed re-write of a finished document keeps the earlier rows whole.
    with pytest.raises(RuntimeError):
        db.write_document(run, doc("d0", "0" * 64, n_q=5))
    assert count(db, "outputs", "doc_id = 'd0'") == 2
    assert count(db, "layer_memory", "doc_id = 'd0'") == 2
    monkeypatch.undo()
    db.write_document(run, doc("d1", "a" * 64))  # the connection is usable after the rollback
    assert count(db, "outputs", "doc_id = 'd1'") == 2


def test_read_only_store_refuses_writes(tmp_path):
    path = tmp_path / "r.duckdb"
    with Store(path) as w:
        run = w.start_run(RunConfig(), "x")
        w.write_document(run, doc())
    with Store(path, read_only=True) as ro:
        assert count(ro, "outputs") == 2
        assert ro.query("SELECT kept_share FROM memory_savings").num_rows == 1
        for sql in ["INSERT INTO runs (run_id) VALUES ('x')", "UPDATE runs SET status = 'failed'",
                    "CREATE TABLE t (a INTEGER)", "DELETE FROM outputs"]:
            with pytest.raises(StoreError, match="read-only") as info:
                ro.query(sql)
            assert str(path) in str(info.value)
        with pytest.raises(StoreError, match="read-only"):
            ro.write_document(run, doc())
        with pytest.raises(StoreError, match="read-only"):
            ro.start_run(RunConfig(), "x")
        assert count(ro, "outputs") == 2


def test_query_errors_are_store_errors(db):
    with pytest.raises(StoreError, match="query failed"):
        db.query("SELECT * FROM no_such_table")


def test_missing_file_read_only(tmp_path):
    path = tmp_path / "absent.duckdb"
    with pytest.raises(StoreError, match="absent.duckdb"):
        Store(path, read_only=True)
    assert not path.exists()


def test_second_writer_process_gets_a_clear_error(tmp_path):
    path = tmp_path / "locked.duckdb"
    Store(path).close()
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, duckdb
            con = duckdb.connect({str(path)!r})
            print("ready", flush=True)
            sys.stdin.read()
        """)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(StoreError) as info:
            Store(path)
        msg = str(info.value)
        assert str(path) in msg and "another process" in msg and "\n" not in msg
        with pytest.raises(StoreError, match="another process"):
            Store(path, read_only=True)
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    Store(path).close()  # free again once the holder exits


# -- issue 11: reliability ----------------------------------------------------------------------------

def one_line_error(fn, match):
    with pytest.raises(StoreError, match=match) as info:
        fn()
    assert "\n" not in str(info.value)
    return str(info.value)


def dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()  # reaped: the pid names no process now
    return p.pid


def test_runs_record_host_and_pid(db):
    import os
    import socket

    db.start_run(RunConfig(), "x")
    row = db.query("SELECT host, pid, pid_started_at FROM runs").to_pylist()[0]
    assert (row["host"], row["pid"]) == (socket.gethostname(), os.getpid())
    assert row["pid_started_at"] == store_mod.process_started_at(os.getpid())


def test_stale_running_runs_of_this_host_are_marked_interrupted(tmp_path):
    import os

    path = tmp_path / "s.duckdb"
    with Store(path) as s:
        alive = s.start_run(RunConfig(), "x")  # this process: still running
        gone = s.start_run(RunConfig(), "x")
        s.write_document(gone, doc())
        reused = s.start_run(RunConfig(), "x")  # the pid lives, but it is another process now
        elsewhere = s.start_run(RunConfig(), "x")
        done = s.start_run(RunConfig(), "x")
        s.finish_run(done, "completed")
        pid = dead_pid()
        s.query(f"UPDATE runs SET pid = {pid} WHERE run_id IN ('{gone}', '{elsewhere}', '{done}')")
        s.query(f"UPDATE runs SET pid_started_at = pid_started_at - 3600 WHERE run_id = '{reused}'")
        s.query(f"UPDATE runs SET host = 'another-host' WHERE run_id = '{elsewhere}'")
        assert s.interrupted_runs == []
    with Store(path, read_only=True) as ro:  # a reader changes nothing
        assert ro.query("SELECT count(*) FROM runs WHERE status = 'running'").column(0)[0].as_py() == 4
    can_tell_start = store_mod.process_started_at(os.getpid()) is not None
    with Store(path) as s:
        expected = {gone, reused} if can_tell_start else {gone}
        assert set(s.interrupted_runs) == expected
        status = {r["run_id"]: r for r in s.query("SELECT * FROM runs").to_pylist()}
    assert {r for r, row in status.items() if row["status"] == "interrupted"} == expected
    assert status[alive]["status"] == "running" and status[elsewhere]["status"] == "running"
    assert status[done]["status"] == "completed"
    assert status[gone]["n_documents"] == 1 and status[gone]["finished_at"] is not None
    assert "interrupted" in store_mod.RUN_STATUSES


def test_foreign_duckdb_file_is_refused_before_anything_is_written(tmp_path):
    import duckdb

    path = tmp_path / "theirs.duckdb"
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE runs (id INTEGER, name VARCHAR); INSERT INTO runs VALUES (1, 'mine')")
    con.close()
    before = path.read_bytes()
    msg = one_line_error(lambda: Store(path), "not a nestedkv store")
    assert str(path) in msg
    one_line_error(lambda: Store(path, read_only=True), "not a nestedkv store")
    assert path.read_bytes() == before
    con = duckdb.connect(str(path), read_only=True)
    assert con.execute("SELECT table_name FROM duckdb_tables()").fetchall() == [("runs",)]
    assert con.execute("SELECT * FROM runs").fetchall() == [(1, "mine")]
    con.close()


@pytest.mark.parametrize("ddl, match", [
    ("CREATE TABLE schema_version (version INTEGER); INSERT INTO schema_version VALUES (99)", "schema version 99"),
    ("CREATE TABLE schema_version (v VARCHAR); INSERT INTO schema_version VALUES ('x')", "not a nestedkv store"),
    ("CREATE VIEW v AS SELECT 1 AS a", "not a nestedkv store"),
])
def test_other_schema_versions_are_refused(tmp_path, ddl, match):
    import duckdb

    path = tmp_path / "other.duckdb"
    con = duckdb.connect(str(path))
    con.execute(ddl)
    con.close()
    one_line_error(lambda: Store(path), match)
    con = duckdb.connect(str(path), read_only=True)
    assert con.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = 'runs'").fetchall() == [(0,)]
    con.close()


def test_an_empty_duckdb_file_is_initialized(tmp_path):
    import duckdb

    path = tmp_path / "empty.duckdb"
    duckdb.connect(str(path)).close()
    with Store(path) as s:
        assert s.query("SELECT version FROM schema_version").column(0).to_pylist() == [store_mod.SCHEMA_VERSION]


# The version-1 schema as commit 2a6306a created it (tables only; its views are replaced on migration).
V1_DDL = """
CREATE TABLE schema_version (version INTEGER);
INSERT INTO schema_version VALUES (1);
CREATE TABLE runs (run_id VARCHAR, created_at TIMESTAMP, finished_at TIMESTAMP, task VARCHAR, model VARCHAR,
  press VARCHAR, compression_ratio DOUBLE, budget INTEGER, head_budget VARCHAR, prefill_step_size INTEGER,
  max_new_tokens INTEGER, config_json VARCHAR, config_hash VARCHAR, reference_config_hash VARCHAR,
  code_version VARCHAR, input VARCHAR, status VARCHAR, n_documents INTEGER, n_errors INTEGER, PRIMARY KEY (run_id));
CREATE TABLE documents (doc_id VARCHAR, content_sha256 VARCHAR, n_chars BIGINT, n_tokens INTEGER, title VARCHAR,
  PRIMARY KEY (content_sha256, doc_id));
CREATE TABLE outputs (run_id VARCHAR, doc_id VARCHAR, content_sha256 VARCHAR, question_idx INTEGER,
  question VARCHAR, output VARCHAR, gold VARCHAR, status VARCHAR, error VARCHAR, n_tokens INTEGER,
  n_question_tokens INTEGER, n_generated INTEGER, prefill_s DOUBLE, compress_s DOUBLE, decode_s DOUBLE,
  prefill_tok_s DOUBLE, decode_tok_s DOUBLE, peak_prefill_bytes BIGINT, peak_decode_bytes BIGINT);
CREATE TABLE layer_memory (run_id VARCHAR, doc_id VARCHAR, content_sha256 VARCHAR, layer INTEGER,
  n_kv_heads INTEGER, head_dim INTEGER, dtype VARCHAR, tokens_seen INTEGER, kept_min INTEGER, kept_max INTEGER,
  kept_mean DOUBLE, bytes_full BIGINT, bytes_kept BIGINT, bytes_resident BIGINT);
CREATE TABLE evaluations (run_id VARCHAR, doc_id VARCHAR, question_idx INTEGER, metric VARCHAR, value DOUBLE,
  reference_run_id VARCHAR);
CREATE TABLE input_errors (run_id VARCHAR, source VARCHAR, row_number INTEGER, doc_id VARCHAR, field VARCHAR,
  message VARCHAR);
CREATE VIEW memory_savings AS SELECT run_id FROM runs;
INSERT INTO runs (run_id, press, config_hash, status) VALUES ('old-run', 'nestedkv', 'h', 'completed');
INSERT INTO documents VALUES ('d0', 'sha0', 10, 5, 'Old');
INSERT INTO outputs (run_id, doc_id, content_sha256, question_idx, status, n_tokens, prefill_s)
  VALUES ('old-run', 'd0', 'sha0', 0, 'ok', 5, 2.5);
INSERT INTO layer_memory (run_id, doc_id, content_sha256, layer, bytes_full, bytes_kept, bytes_resident)
  VALUES ('old-run', 'd0', 'sha0', 0, 1000, 400, 500);
"""


def test_a_version_1_store_is_migrated_in_place(tmp_path):
    import duckdb

    path = tmp_path / "v1.duckdb"
    con = duckdb.connect(str(path))
    con.execute(V1_DDL)
    con.close()
    with Store(path, read_only=True) as ro:  # read as it is, not migrated
        assert ro.query("SELECT version FROM schema_version").column(0).to_pylist() == [1]
    with Store(path) as s:
        assert s.query("SELECT version FROM schema_version").column(0).to_pylist() == [2]
        cols = {(r["table_name"], r["column_name"]) for r in s.query(
            "SELECT table_name, column_name FROM duckdb_columns() WHERE database_name = current_database()"
        ).to_pylist()}
        for table, columns in store_mod.TABLES.items():
            assert {(table, c) for c, _ in columns} <= cols
        assert s.query("SELECT run_id, status, host FROM runs").to_pylist() == [
            {"run_id": "old-run", "status": "completed", "host": None}]
        assert s.query("SELECT n_tokens FROM outputs").column(0).to_pylist() == [5]
        # an old row's prefill was computed as far as it knows (the prefill cache kept no seconds then)
        assert s.query("SELECT prefill_compute_s FROM outputs").column(0).to_pylist() == [2.5]
        assert s.query("SELECT bytes_kept FROM memory_savings").column(0).to_pylist() == [400]  # view replaced
        # layers stored before hybrid models were all full attention
        assert s.query("SELECT kind FROM layer_memory").column(0).to_pylist() == ["full"]
        assert s.query("SELECT kind FROM layer_savings").column(0).to_pylist() == ["full"]
        assert s.query("SELECT * FROM peak_savings").num_rows == 0
        run = s.start_run(RunConfig(), "x")  # the migrated store takes new rows
        s.write_document(run, doc())
        s.finish_run(run, "completed")
        s.start_run(RunConfig(task="qa", press="snapkv"), "x")
        # no press read the questions before question-aware presses; a run of one says so
        got = s.query("SELECT run_id = 'old-run' AS old, press, saw_questions FROM runs ORDER BY ALL").to_pylist()
        assert [(r["old"], r["press"] if not r["old"] else None, r["saw_questions"]) for r in got] == [
            (False, "nestedkv", False), (False, "snapkv", True), (True, None, False)]
    with Store(path) as s:  # a second open finds version 2 and changes nothing
        assert s.query("SELECT count(*) FROM runs").column(0)[0].as_py() == 3


def test_parent_folder_that_cannot_be_created(tmp_path, monkeypatch):
    import errno
    from pathlib import Path

    (tmp_path / "afile").write_text("x")
    msg = one_line_error(lambda: Store(tmp_path / "afile" / "sub" / "r.duckdb"), "cannot create the folder")
    assert "afile" in msg

    def read_only_fs(self, *a, **k):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "mkdir", read_only_fs)
    one_line_error(lambda: Store(tmp_path / "ro" / "r.duckdb"), "Read-only file system")


DISK_FULL = """
import resource, signal, sys
from pipeline.store import Store, StoreError
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, like a full disk
limit = int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
try:
    Store(sys.argv[1]).close()
    print("opened")
except StoreError as e:
    print("StoreError:", e)
"""


@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE is POSIX")
@pytest.mark.parametrize("limit", [4096, 12288])  # full while creating the file; full while setting it up
def test_disk_full_at_start_is_one_line_and_leaves_no_file(tmp_path, limit):
    path = tmp_path / "full.duckdb"
    out = subprocess.run([sys.executable, "-c", DISK_FULL, str(path), str(limit)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    (line,) = out.stdout.splitlines()
    assert line.startswith(f"StoreError: {path}:") and "File too large" in line
    assert not path.exists() and not (tmp_path / "full.duckdb.wal").exists()


HOLDER = """
import sys, duckdb
con = duckdb.connect(sys.argv[1])
print("ready", flush=True)
sys.stdin.read()
con.close()
"""


def test_wait_retries_a_held_lock_until_it_is_free(tmp_path):
    path = tmp_path / "held.duckdb"
    Store(path).close()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    waits = []

    def on_wait(waited_s, wait_s):
        waits.append((waited_s, wait_s))
        if len(waits) == 2:  # the holder lets go while we wait
            holder.stdin.close()
            holder.wait(timeout=30)

    try:
        assert holder.stdout.readline().strip() == "ready"
        with Store(path, wait_s=120, on_wait=on_wait) as s:
            s.start_run(RunConfig(), "x")
        assert len(waits) >= 2 and all(w == 120 for _, w in waits)
        assert waits[0][0] <= waits[1][0]
    finally:
        if holder.poll() is None:
            holder.stdin.close()
            holder.wait(timeout=30)


def test_wait_gives_up_with_one_line(tmp_path):
    path = tmp_path / "held.duckdb"
    Store(path).close()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    waits = []
    try:
        assert holder.stdout.readline().strip() == "ready"
        msg = one_line_error(lambda: Store(path, wait_s=0.5, on_wait=lambda *a: waits.append(a)),
                             "another process holds")
        assert "after waiting" in msg and waits
        assert isinstance(pytest.raises(store_mod.StoreLockedError, Store, path).value, StoreError)
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert path.exists()  # a held store is never removed


def test_resume_is_by_doc_id_and_content(db):
    cfg = RunConfig(compression_ratio=0.5)
    run = db.start_run(cfg, "x")
    db.write_document(run, doc("d1", "a" * 64))
    db.write_document(run, doc("d2", "b" * 64, status=ERROR, error="oom"))
    assert db.done_documents(cfg) == {("d1", "a" * 64)}
    # The same text under a new id is not done: ("copy", "a"*64) is not in the set.
    assert ("copy", "a" * 64) not in db.done_documents(cfg)
    later = db.start_run(cfg, "x")
    db.write_document(later, doc("copy", "a" * 64))
    assert db.done_documents(cfg) == {("d1", "a" * 64), ("copy", "a" * 64)}
    assert count(db, "documents", "content_sha256 = '" + "a" * 64 + "'") == 2


def test_truncated_rerun_keeps_the_documents_full_length(db):
    db.write_document(db.start_run(RunConfig(), "x"), doc())  # 100 tokens, fed whole
    truncated = doc()
    truncated.n_tokens = 60  # what was fed
    truncated.n_tokens_full = 100  # the document's own length
    run = db.start_run(RunConfig(), "x")
    db.write_document(run, truncated)
    assert db.query("SELECT n_tokens FROM documents").column(0).to_pylist() == [100]
    assert set(db.query(f"SELECT n_tokens FROM outputs WHERE run_id = '{run}'").column(0).to_pylist()) == {60}


def test_peak_kv_columns_and_peak_savings_view(db):
    from dataclasses import replace

    cfg = RunConfig(compression_ratio=0.5)
    run = db.start_run(cfg, "x")
    a = doc("d1", "a" * 64)  # document-level peaks
    a.peak_kv_prefill_bytes, a.peak_kv_decode_bytes = 3000, 4000
    b = doc("d2", "b" * 64)  # only per-layer peaks: the view sums them
    b.layers = [replace(lm, peak_prefill_kv_bytes=1000, peak_decode_kv_bytes=1500) for lm in b.layers]
    c = doc("d3", "c" * 64)  # no peaks measured (0, the default): left out of the view
    for r in (a, b, c):
        db.write_document(run, r)
    out = {r["doc_id"]: r for r in db.query(
        "SELECT DISTINCT doc_id, peak_kv_prefill_bytes, peak_kv_decode_bytes FROM outputs").to_pylist()}
    assert (out["d1"]["peak_kv_prefill_bytes"], out["d1"]["peak_kv_decode_bytes"]) == (3000, 4000)
    assert out["d2"]["peak_kv_prefill_bytes"] in (None, 0)
    lm = db.query("SELECT peak_prefill_kv_bytes, peak_decode_kv_bytes FROM layer_memory WHERE doc_id = 'd2'")
    assert lm.column(0).to_pylist() == [1000, 1000] and lm.column(1).to_pylist() == [1500, 1500]

    (p,) = db.query("SELECT * FROM peak_savings").to_pylist()
    full = sum(x.bytes_full for x in a.layers) + sum(x.bytes_full for x in b.layers)
    assert (p["run_id"], p["n_documents"], p["bytes_full"]) == (run, 2, full)
    assert (p["peak_prefill_kv_bytes"], p["peak_decode_kv_bytes"]) == (3000 + 2000, 4000 + 3000)
    assert p["prefill_peak_share"] == pytest.approx(5000 / full)
    assert p["decode_peak_share"] == pytest.approx(7000 / full)
    assert p["prefill_saved_mib"] == pytest.approx((full - 5000) / MIB)
    assert p["decode_saved_mib"] == pytest.approx((full - 7000) / MIB)


def test_runs_prefill_comes_from_the_config(db):
    class Cfg(RunConfig):  # a subclass, so the test holds with or without RunConfig.prefill
        prefill: str = "streaming"

    db.start_run(Cfg(), "x")
    assert db.query("SELECT prefill FROM runs").column(0).to_pylist() == ["streaming"]


def test_values_past_int32_are_one_line_store_errors(db):
    big = RunConfig().model_copy(update={"budget": 3_000_000_000})
    msg = one_line_error(lambda: db.start_run(big, "x"), r"runs\.budget")
    assert "INTEGER" in msg and str(db.path) in msg
    big = RunConfig().model_copy(update={"max_new_tokens": 3_000_000_000})
    one_line_error(lambda: db.start_run(big, "x"), r"runs\.max_new_tokens")
    assert count(db, "runs") == 0

    run = db.start_run(RunConfig(), "x")
    bad = doc()
    bad.questions[0].n_generated = 2**31
    one_line_error(lambda: db.write_document(run, bad), r"outputs\.n_generated")
    assert count(db, "outputs") == 0 and count(db, "documents") == 0
    db.write_document(run, doc())  # the store is still usable
    assert count(db, "outputs") == 2


def test_a_run_whose_process_was_killed_is_interrupted_by_the_next_writer(tmp_path):
    path = tmp_path / "k.duckdb"
    killed = textwrap.dedent(f"""
        import os
        from pipeline.config import RunConfig
        from pipeline.store import Store
        s = Store({str(path)!r})
        print(s.start_run(RunConfig(), "x"), flush=True)
        os._exit(9)  # no close, no finish_run: as after kill -9
    """)
    out = subprocess.run([sys.executable, "-c", killed], capture_output=True, text=True, timeout=120)
    run = out.stdout.strip()
    with Store(path, read_only=True) as ro:
        assert ro.query("SELECT status FROM runs").column(0).to_pylist() == ["running"]
    with Store(path) as s:
        assert s.interrupted_runs == [run]
        assert s.query("SELECT status FROM runs").column(0).to_pylist() == ["interrupted"]


def test_a_file_that_is_not_duckdb_is_refused_and_kept(tmp_path):
    path = tmp_path / "notes.duckdb"
    path.write_text("not a database")
    for read_only in (False, True):
        one_line_error(lambda: Store(path, read_only=read_only), "cannot open database")
    assert path.read_text() == "not a database"


def test_sliding_layers_count_in_the_saved_share(db):
    """A hybrid model's sliding layer (nothing evicted) is stored with its kind and summed into the views, so
    the saved share is that of the whole KV, not of the compressed layers alone."""
    from dataclasses import replace

    r = doc(kept=((25, 25, 25.0), (100, 100, 100.0)))
    r.layers[1] = replace(r.layers[1], kind="sliding")
    run = db.start_run(RunConfig(compression_ratio=0.75), "x")
    db.write_document(run, r)
    full, kept = r.layers[0].bytes_full, r.layers[0].bytes_kept
    (m,) = db.query("SELECT saved_share FROM memory_savings").to_pylist()
    assert m["saved_share"] == pytest.approx(1 - (kept + full) / (2 * full))  # 0.375, not 0.75
    kinds = db.query("SELECT layer, kind FROM layer_savings ORDER BY layer").to_pylist()
    assert [x["kind"] for x in kinds] == ["full", "sliding"]


def test_a_lake_catalog_locked_mid_commit_is_waited_for_not_called_foreign():
    # A reader opening a lake while writers commit saw "database is locked" in the schema check, and it was
    # reported as a store that is not ours (test_lake's concurrent writers, once in CI).
    class Failing:
        def __init__(self, error):
            self.error = error

        def execute(self, sql):
            if sql.startswith("SELECT max(version) FROM schema_version"):
                raise duckdb.Error(self.error)
            return self

        def fetchall(self):
            return [("schema_version",)]

    with pytest.raises(duckdb.Error, match="locked") as got:
        schema.check(Failing("IO Error: database is locked"), "x")
    assert lake.is_locked(got.value)  # what lake.retry_locked waits on
    with pytest.raises(StoreError, match="not ours"):
        schema.check(Failing('Binder Error: column "version" not found'), "x")
