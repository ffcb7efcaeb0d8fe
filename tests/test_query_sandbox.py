"""``Store(path, read_only=True)`` (what ``nkv query`` opens) reads the store and nothing else.

Two layers, each tested on its own: DuckDB's parser lets exactly one SELECT through before anything runs,
and the connection is in DuckDB's sandbox (no other files, no extensions, locked settings).
"""

import os

import duckdb
import pytest

from pipeline.config import RunConfig
from pipeline.store import Store, StoreError
from test_store import doc


@pytest.fixture
def store(tmp_path):
    path = tmp_path / "runs.duckdb"
    with Store(path) as w:
        run = w.start_run(RunConfig(), "x")
        w.write_document(run, doc())
        w.finish_run(run, "completed")
    return path


def n_runs(path):
    with Store(path, read_only=True) as ro:
        return ro.query("SELECT count(*) AS n FROM runs").column("n")[0].as_py()


def refused(ro, sql, match="read-only"):
    with pytest.raises(StoreError, match=match) as info:
        ro.query(sql)
    msg = str(info.value)
    assert "\n" not in msg and str(ro.path) in msg
    return msg


def test_writes_to_other_files_are_refused(store, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    kept = tmp_path / "kept.csv"
    kept.write_text("keep me\n")
    with Store(store, read_only=True) as ro:
        refused(ro, "COPY runs TO 'x.csv'")
        refused(ro, f"COPY runs TO '{kept}' (HEADER)")
        refused(ro, f"COPY (SELECT * FROM outputs) TO '{tmp_path / 'o.parquet'}' (FORMAT parquet)")
        refused(ro, f"EXPORT DATABASE '{tmp_path / 'dump'}'")
        refused(ro, f"ATTACH '{tmp_path / 'other.duckdb'}' AS a (READ_WRITE)")
        refused(ro, f"ATTACH '{tmp_path / 'other.duckdb'}' AS a (READ_WRITE); CREATE TABLE a.t AS SELECT 1",
                match="exactly one")
    assert not (tmp_path / "x.csv").exists() and not (tmp_path / "o.parquet").exists()
    assert not (tmp_path / "dump").exists() and not (tmp_path / "other.duckdb").exists()
    assert kept.read_text() == "keep me\n"


def test_a_hard_link_to_the_store_cannot_be_attached_for_writing(store, tmp_path):
    link = tmp_path / "link.duckdb"
    os.link(store, link)
    with Store(store, read_only=True) as ro:
        refused(ro, f"ATTACH '{link}' AS a (READ_WRITE); INSERT INTO a.runs (run_id) VALUES ('evil')",
                match="exactly one")
        refused(ro, f"ATTACH '{link}' AS a (READ_WRITE)")
        refused(ro, "INSERT INTO runs (run_id) VALUES ('evil')")
    assert n_runs(store) == 1


def test_extensions_settings_and_other_files_are_out_of_reach(store, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cr3t")
    with Store(store, read_only=True) as ro:
        refused(ro, "INSTALL httpfs")
        refused(ro, "LOAD httpfs")
        refused(ro, "SET enable_external_access = true")
        refused(ro, "SET lock_configuration = false")
        refused(ro, "PRAGMA enable_profiling")
        # One SELECT passes the parser; the sandbox stops it at the file.
        for sql in ["SELECT * FROM read_text('/etc/hostname')", f"SELECT * FROM read_text('{secret}')",
                    f"SELECT * FROM read_csv('{secret}')", f"SELECT * FROM '{secret}'",
                    f"SELECT * FROM glob('{tmp_path}/*')",
                    "SELECT * FROM read_parquet('https://example.com/x.parquet')"]:
            msg = refused(ro, sql, match="query failed")
            assert "s3cr3t" not in msg


@pytest.mark.parametrize("sql", [
    "SELECT 1; DROP TABLE runs",
    "SELECT 1; DELETE FROM outputs",
    "COPY runs TO '{tmp}/y.csv'; DROP TABLE runs",
    "SELECT 1; COPY runs TO '{tmp}/y.csv'",
])
def test_a_second_statement_is_refused_before_the_first_runs(store, tmp_path, sql):
    with Store(store, read_only=True) as ro:
        msg = refused(ro, sql.format(tmp=tmp_path), match="exactly one SELECT statement, found 2")
        assert ro.query("SELECT count(*) AS n FROM outputs").column("n")[0].as_py() == 2
    assert not (tmp_path / "y.csv").exists()
    assert "DROP" not in msg  # the refusal does not echo the SQL


def test_the_connection_itself_is_sandboxed(store, tmp_path):
    # Past the statement check (straight on the connection), DuckDB still refuses.
    with Store(store, read_only=True) as ro:
        for sql in [f"COPY runs TO '{tmp_path / 'z.csv'}'", "SELECT * FROM read_text('/etc/hostname')",
                    f"ATTACH '{tmp_path / 'other.duckdb'}' AS a", "INSTALL httpfs",
                    "SET enable_external_access = true"]:
            with pytest.raises(duckdb.Error):
                ro.con.execute(sql)
    assert not (tmp_path / "z.csv").exists() and not (tmp_path / "other.duckdb").exists()


def test_selects_on_tables_and_views_still_work(store):
    with Store(store, read_only=True) as ro:
        assert ro.query("SELECT count(*) AS n FROM outputs").column("n")[0].as_py() == 2
        assert ro.query("SELECT kept_share FROM memory_savings").num_rows == 1
        assert ro.query("FROM runs SELECT status").column("status").to_pylist() == ["completed"]
        assert ro.query("WITH o AS (SELECT * FROM outputs) SELECT count(*) AS n FROM o").num_rows == 1
        assert ro.query("SELECT doc_id FROM outputs WHERE question_idx = ?", [1]).column(0).to_pylist() == ["d1"]
        assert "status" in ro.query("DESCRIBE runs").column("column_name").to_pylist()
        assert "peak_savings" in ro.query("SHOW TABLES").column("name").to_pylist()
        assert ro.query("SUMMARIZE outputs").num_rows > 0
        assert "run_id" in ro.query("SELECT name FROM pragma_table_info('runs')").column("name").to_pylist()
        assert ro.query("VALUES (1), (2)").num_rows == 2
        assert ro.query("SELECT 1 AS a;").column("a").to_pylist() == [1]  # a trailing ; is still one statement
        refused(ro, "SELECT * FROM nope", match="query failed")
        refused(ro, "SELEC 1", match="query failed")


def test_the_writer_connection_is_not_sandboxed(store, tmp_path):
    with Store(store) as w:
        w.query("CREATE OR REPLACE VIEW mine AS SELECT run_id FROM runs")
        w.start_run(RunConfig(), "y")
        w.query(f"COPY runs TO '{tmp_path / 'export.csv'}'")
        assert w.query("SELECT count(*) AS n FROM mine").column("n")[0].as_py() == 2
    assert (tmp_path / "export.csv").exists()
    with Store(store, read_only=True) as ro:
        assert ro.query("SELECT count(*) AS n FROM mine").column("n")[0].as_py() == 2
