"""The DuckLake backend of the store: the file store's behaviour on a lake, concurrent writers, read-only queries.

Runs on a SQLite catalog (several processes on one machine); the Postgres catalog is exercised by
tests/test_scaleout.py. Skipped where the DuckLake extension cannot be loaded (``pip install -e ".[lake]"``).
"""

import functools
import os
import subprocess
import sys
import textwrap

import duckdb
import pytest

import test_store
from pipeline.config import RunConfig
from pipeline.store import Store, StoreError, lake
from test_store import count, doc


pytestmark = pytest.mark.slow  # a DuckLake per test (the scale-out store): seconds each to set up


def lake_spec(tmp_path) -> str:
    return f"ducklake:sqlite:{tmp_path / 'meta.db'}"


@functools.lru_cache(maxsize=None)
def lake_unavailable(*extensions: str) -> str:
    """Why the extensions cannot be loaded here ('' when they can); asked once per session, since an
    offline INSTALL attempt takes seconds."""
    con = duckdb.connect(config={"autoinstall_known_extensions": False, "autoload_known_extensions": False})
    try:
        for name in extensions:
            lake.load_extension(con, name)
    except lake.LakeSetupError as e:
        return f"DuckLake not loadable here: {e}"
    finally:
        con.close()
    return ""


def skip_missing(why: str) -> None:
    """Skip a test whose extra is not installed; CI's step for the extras (NKV_REQUIRE_EXTRAS=1) fails it."""
    if os.environ.get("NKV_REQUIRE_EXTRAS") == "1":
        pytest.fail(f"NKV_REQUIRE_EXTRAS=1 but {why}")
    pytest.skip(why)


def open_lake(tmp_path, **kw) -> Store:
    why = lake_unavailable("ducklake", "sqlite_scanner")
    if why:
        skip_missing(why)
    return Store(lake_spec(tmp_path), data_path=str(tmp_path / "data"), **kw)


@pytest.fixture
def db(tmp_path):
    """The lake under the name test_store's tests ask for: they run here unchanged."""
    with open_lake(tmp_path) as s:
        yield s


# The file store's behaviour, on a lake (same tables, views, resume and replace-on-retry).
test_schema_and_views_exist = test_store.test_schema_and_views_exist
test_start_and_finish_run = test_store.test_start_and_finish_run
test_write_document_rows = test_store.test_write_document_rows
test_document_without_questions_still_records_its_status = \
    test_store.test_document_without_questions_still_records_its_status
test_views_compute_shares_from_the_inputs = test_store.test_views_compute_shares_from_the_inputs
test_quality_vs_full = test_store.test_quality_vs_full
test_resume_sees_only_ok_documents_of_the_same_config = test_store.test_resume_sees_only_ok_documents_of_the_same_config
test_rewriting_a_document_replaces_its_rows = test_store.test_rewriting_a_document_replaces_its_rows
test_documents_upsert_n_tokens = test_store.test_documents_upsert_n_tokens
test_crash_mid_document_leaves_no_partial_rows = test_store.test_crash_mid_document_leaves_no_partial_rows
test_query_errors_are_store_errors = test_store.test_query_errors_are_store_errors
test_runs_record_host_and_pid = test_store.test_runs_record_host_and_pid
test_resume_is_by_doc_id_and_content = test_store.test_resume_is_by_doc_id_and_content
test_peak_kv_columns_and_peak_savings_view = test_store.test_peak_kv_columns_and_peak_savings_view
test_values_past_int32_are_one_line_store_errors = test_store.test_values_past_int32_are_one_line_store_errors


def test_the_lake_has_no_keys_and_remembers_its_data_path(tmp_path):
    with open_lake(tmp_path) as s:
        settings = dict(s.con.execute("SELECT name, value FROM duckdb_settings() WHERE name LIKE 'ducklake_retry%' "
                                      "OR name = 'ducklake_max_retry_count'").fetchall())
        assert settings == {k: str(v) for k, v in lake.RETRY_SETTINGS.items()}  # writers retry conflicting commits
        run = s.start_run(RunConfig(), "x")
        s.write_document(run, doc(n_q=30))  # past DuckLake's inlining limit: a Parquet file
    with Store(lake_spec(tmp_path)) as s:  # no data_path: the catalog has it
        assert count(s, "outputs") == 30
        files = s.query("SELECT data_file FROM ducklake_list_files('lake', 'outputs')").column(0).to_pylist()
        assert files and all(f.startswith(str(tmp_path / "data")) for f in files)
        assert s.query("SELECT count(*) FROM duckdb_constraints() WHERE database_name = 'lake' "
                       "AND constraint_type = 'PRIMARY KEY'").column(0)[0].as_py() == 0


def test_read_only_lake_is_sandboxed(tmp_path):
    with open_lake(tmp_path):
        pass
    (tmp_path / "secret.csv").write_text("a\n1\n")
    with Store(lake_spec(tmp_path), read_only=True) as r:
        with open_lake(tmp_path) as s:  # Parquet files committed after the reader opened
            s.write_document(s.start_run(RunConfig(), "x"), doc(n_q=30))
            s.write_document(s.start_run(RunConfig(), "x"), doc("d2", "b" * 64, n_q=30))
        assert count(r, "outputs") == 60
        assert r.query("SELECT n_documents FROM memory_savings").column(0).to_pylist() == [1, 1]
        with pytest.raises(StoreError, match="INSERT statements are refused"):
            r.query("INSERT INTO runs (run_id) VALUES ('x')")
        for sql in [f"SELECT * FROM read_csv('{tmp_path / 'secret.csv'}')", "SELECT * FROM read_csv('/etc/passwd')"]:
            with pytest.raises(StoreError, match="disabled by configuration"):
                r.query(sql)
        with pytest.raises(StoreError, match="refused"):
            r.query(f"COPY outputs TO '{tmp_path / 'data' / 'x.csv'}'")
        # The catalog extension's functions would reach other databases: refused wherever they appear.
        with pytest.raises(StoreError, match="sqlite_scan reach other databases and are refused"):
            r.query(f"SELECT 1 WHERE EXISTS (FROM sqlite_scan('{tmp_path / 'meta.db'}', 'ducklake_snapshot'))")


def test_read_only_open_of_a_missing_catalog_is_one_line(tmp_path):
    with pytest.raises(StoreError, match="no such catalog file"):
        Store(lake_spec(tmp_path), read_only=True)
    assert not (tmp_path / "meta.db").exists()


@pytest.mark.parametrize("spec", ["ducklake:", "ducklake:mysql:x", "ducklake:sqlite:", "ducklake:postgres"])
def test_bad_lake_spec_names_the_db(spec):
    with pytest.raises(StoreError, match="a lake is ducklake:sqlite:PATH"):
        Store(spec)


class FakeConnection:
    """A DuckDB connection whose INSTALL fails as it does offline."""

    def __init__(self):
        self.sql = []

    def execute(self, sql):
        self.sql.append(sql)
        if sql.startswith("PRAGMA version"):
            return duckdb.connect().execute("SELECT 'v9.9.9'")
        raise duckdb.IOException('Failed to download extension "ducklake"')


def test_no_wheel_and_no_network_is_one_clear_line():
    con = FakeConnection()
    with pytest.raises(lake.LakeSetupError) as e:
        lake.load_extension(con, "ducklake")
    msg = str(e.value)
    assert "\n" not in msg and "nestedkv-pipeline[lake]" in msg and "could not install" in msg
    # the wheel, when installed, is for another DuckDB: the message says which
    assert "not installed" in msg or "built for DuckDB v" in msg
    assert con.sql[-1] == "INSTALL ducklake"  # nothing loaded from anywhere else


def test_the_wheel_is_loaded_from_its_file(tmp_path):
    con = duckdb.connect(config={"autoinstall_known_extensions": False, "autoload_known_extensions": False})
    version = con.execute("PRAGMA version").fetchone()[0]
    path, why = lake._wheel_file("ducklake", version)
    if path is None:
        skip_missing(why)
    assert lake.load_extension(con, "ducklake") == str(path)
    assert con.execute("SELECT loaded FROM duckdb_extensions() WHERE extension_name = 'ducklake'").fetchone() == (True,)


WRITER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from pipeline.config import RunConfig
    from pipeline.store import Store
    from test_store import doc
    me, n = sys.argv[1], int(sys.argv[2])
    with Store({spec!r}) as s:
        run = s.start_run(RunConfig(), me)
        for i in range(n):
            s.write_document(run, doc(f"{{me}}-{{i}}", f"{{me}}{{i}}".ljust(64, "0")))
            s.write_document(run, doc("shared", "s" * 64))  # the same document, written by both
        s.finish_run(run, "completed")
        print("retries", s.commit_retries)
""")


def test_concurrent_writers_lose_and_duplicate_nothing(tmp_path):
    """Two processes commit documents into one lake at the same time, one of them into the same rows;
    a reader queries while they write. Every row lands exactly once."""
    import os

    with open_lake(tmp_path):
        pass  # created, with its data path
    script = tmp_path / "writer.py"
    script.write_text(WRITER.format(tests=os.path.dirname(__file__), spec=lake_spec(tmp_path)))
    n = 6
    procs = [subprocess.Popen([sys.executable, str(script), w, str(n)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for w in ("A", "B")]
    seen = []
    while any(p.poll() is None for p in procs):  # reads while the writers write
        with Store(lake_spec(tmp_path), read_only=True) as r:
            seen.append(count(r, "outputs"))
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    retries = sum(int(o[0].split()[-1]) for o in outs)
    print(f"commit retries: {retries}; reads during the writes: {len(seen)}")
    with Store(lake_spec(tmp_path), read_only=True) as r:
        per_doc = r.query("SELECT doc_id, count(*) AS n FROM outputs GROUP BY doc_id").to_pylist()
        assert len(per_doc) == 2 * n + 1
        # each writer's own documents twice (2 questions); the shared one 2 questions x 2 runs
        assert {d["doc_id"]: d["n"] for d in per_doc} == {**{f"{w}-{i}": 2 for w in "AB" for i in range(n)},
                                                          "shared": 4}
        assert count(r, "documents", "doc_id = 'shared'") == 1
        assert count(r, "layer_memory") == (2 * n + 2) * 2
        assert r.query("SELECT status FROM runs").column(0).to_pylist() == ["completed", "completed"]
    assert seen and seen == sorted(seen)  # reads see whole commits, never fewer rows than before
