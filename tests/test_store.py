"""The DuckDB store: schema, idempotent per-document transactions, views, resume, read-only and locking."""

import subprocess
import sys
import textwrap

import pytest

import pipeline.store as store_mod
from nestedkv.accounting import LayerMemory
from pipeline.config import RunConfig
from pipeline.results import ERROR, OK, DocumentResult, QuestionResult
from pipeline.store import VIEWS, Store, StoreError

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
    assert db.done_content_hashes(cfg) == set()
    db.write_document(run, doc("d1", "a" * 64))
    db.write_document(run, doc("d2", "b" * 64, status=ERROR, error="oom"))
    bad_q = doc("d3", "c" * 64)
    bad_q.questions[1].status, bad_q.questions[1].error = ERROR, "decode failed"
    db.write_document(run, bad_q)
    assert db.done_content_hashes(cfg) == {"a" * 64}
    assert db.done_content_hashes(cfg.model_copy(update={"compression_ratio": 0.9})) == set()

    later = db.start_run(cfg, "x")  # a later run of the same configuration finishes the failed one
    db.write_document(later, doc("d2", "b" * 64))
    assert db.done_content_hashes(cfg) == {"a" * 64, "b" * 64}


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
