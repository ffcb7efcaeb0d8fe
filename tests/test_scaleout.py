"""Scale-out for real: a throwaway PostgreSQL catalog, a Prefect server, a process work pool and two workers
on loopback, one DuckLake store. ``nkv run --pool`` fans 6 documents out in 3 shards; then, in a second
batch (24 documents, 3 shards), one worker is killed mid-shard with its flow run (the machine dies): the
parent resubmits that shard, and re-submitting the whole batch afterwards runs nothing again. Last, ``nkv
serve --pool --shards`` serves the same fan-out as a scheduled deployment, run once on demand.

Skipped, with the reason, where PostgreSQL's server binaries or the DuckLake extensions are missing
(.ci/run installs both).
"""

import glob
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from test_lake import lake_unavailable, skip_missing
from test_serve import NKV, PREFECT, clean_env, free_port, get, start, stop, wait_for
from tiny import sample_docs, save_tiny_model_dir, write_batch

def pg_bindir():
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).resolve().parent
    dirs = sorted(glob.glob("/usr/lib/postgresql/*/bin"))
    return Path(dirs[-1]) if dirs else None


def as_postgres_user():
    """initdb refuses root: as root, run PostgreSQL as Debian's ``postgres`` user."""
    if os.geteuid() != 0:
        return []
    if shutil.which("runuser") is None:
        skip_missing("running as root without runuser: cannot start PostgreSQL as another user")
    try:
        import pwd

        pwd.getpwnam("postgres")
    except KeyError:
        skip_missing("running as root and there is no postgres user to run PostgreSQL as")
    return ["runuser", "-u", "postgres", "--"]


class Postgres:
    """A throwaway cluster on 127.0.0.1 with trust auth, in a temporary folder; ``stop`` removes it."""

    def __init__(self, bindir: Path):
        self.bindir, self.user = bindir, as_postgres_user()
        self.dir = Path(tempfile.mkdtemp(prefix="nkv-pg-"))
        self.port = free_port()
        if self.user:
            shutil.chown(self.dir, "postgres")
        self.data = self.dir / "data"

    def run(self, *args, timeout=120):
        res = subprocess.run(self.user + [str(self.bindir / args[0]), *args[1:]], capture_output=True, text=True,
                             timeout=timeout, cwd=self.dir)
        assert res.returncode == 0, f"{args[0]}: {res.stdout}{res.stderr}"
        return res

    def start(self) -> str:
        self.run("initdb", "-D", str(self.data), "-U", "nkv", "--auth=trust", "--no-sync")
        self.run("pg_ctl", "-D", str(self.data), "-l", str(self.dir / "pg.log"), "-w", "-o",
                 f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.dir} -c fsync=off", "start")
        self.run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "nkv", "nkv")
        return f"dbname=nkv host=127.0.0.1 port={self.port} user=nkv"

    def stop(self):
        if (self.data / "postmaster.pid").exists():
            subprocess.run(self.user + [str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "immediate",
                                        "stop"], capture_output=True, timeout=60, cwd=self.dir)
        shutil.rmtree(self.dir, ignore_errors=True)


def children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (Linux /proc)."""
    kids = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = Path(stat).read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        kids.setdefault(int(fields[1]), []).append(int(Path(stat).parent.name))
    out, todo = [], [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


def query(env, db, sql):
    return subprocess.run(NKV + ["query", "--db", db, "--format", "json", sql], env=env, capture_output=True,
                          text=True, timeout=120)


def finish(proc, log: Path, timeout: float) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running after {timeout:.0f} s:\n{log.read_text()[-3000:]}")


@pytest.mark.scaleout
def test_two_workers_fill_one_lake_and_survive_a_killed_worker(tmp_path):
    import json

    bindir = pg_bindir()
    if bindir is None or not (bindir / "initdb").exists():
        skip_missing("PostgreSQL server binaries (initdb, pg_ctl) not found: apt-get install postgresql")
    why = lake_unavailable("ducklake", "postgres_scanner")
    if why:
        skip_missing(why)

    t0 = time.monotonic()
    pg = Postgres(bindir)
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = clean_env(tmp_path, api)
    # Workers poll every second (a store's commit retries show in their logs as a warning at its close).
    env.update(PREFECT_WORKER_QUERY_SECONDS="1", PREFECT_WORKER_PREFETCH_SECONDS="1")
    # 12 layers: a document's layer_memory rows pass DuckLake's inlining limit (10), so they land in Parquet
    model = save_tiny_model_dir(tmp_path / "tiny-model", n_layers=12)
    docs = sample_docs(6, chars=300)
    inp = write_batch(tmp_path / "batch.parquet", docs + [{"doc_id": "no-text", "text": None}])
    data = tmp_path / "lake-data"
    procs, logs = [], []  # watched by wait_for, pairwise

    def forget(proc):
        i = procs.index(proc)
        del procs[i], logs[i]
    try:
        db = "ducklake:postgres:" + pg.start()
        server_log = tmp_path / "server.log"
        server = start(PREFECT + ["server", "start", "--host", "127.0.0.1", "--port", str(port), "--no-ui"], env,
                       server_log)
        procs.append(server), logs.append(server_log)
        wait_for("the Prefect server", lambda: get(f"{api}/health"), 150, procs, logs)
        res = subprocess.run(PREFECT + ["work-pool", "create", "nkv-pool", "--type", "process"], env=env,
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stdout + res.stderr
        workers = []
        for i in range(2):
            log = tmp_path / f"worker{i}.log"
            w = start(PREFECT + ["worker", "start", "--pool", "nkv-pool", "--limit", "1", "--name", f"w{i}"], env, log)
            workers.append((w, log))
            procs.append(w), logs.append(log)
        t_ready = time.monotonic()

        def run_cmd(input, ratio, tokens):
            return NKV + ["run", "--pool", "nkv-pool", "--shards", "3", "--input", input, "--model", str(model),
                          "--db", db, "--data-path", str(data), "--max-new-tokens", tokens, "--retries", "0",
                          "--compression-ratio", ratio]

        run = run_cmd(inp, "0.75", "4")
        parent_log = tmp_path / "parent.log"
        parent = start(run, env, parent_log)
        procs.append(parent), logs.append(parent_log)
        # `nkv query` reads the lake while the workers write into it
        def read_while_running():
            running = parent.poll() is None  # before the read: the batch was still being written during it
            r = query(env, db, "SELECT count(*) AS n FROM outputs")
            return running and r.returncode == 0 and json.loads(r.stdout)[0]["n"] > 0

        assert wait_for("a stored document read while the batch runs", read_while_running, 240, procs, logs)
        assert finish(parent, parent_log, 240) == 0, parent_log.read_text()[-3000:]
        forget(parent)
        t_first = time.monotonic()

        rows = json.loads(query(env, db, "SELECT o.doc_id, count(*) AS n, count(DISTINCT o.run_id) AS runs, "
                                "any_value(r.pid) AS pid FROM outputs o JOIN runs r USING (run_id) "
                                "GROUP BY o.doc_id ORDER BY o.doc_id").stdout)
        assert [r["doc_id"] for r in rows] == [d["doc_id"] for d in docs]
        assert all(r["n"] == 1 and r["runs"] == 1 for r in rows), rows  # summarize: one row per document
        # both workers ran shards: each worker's log names the flow runs it submitted
        shard_runs = json.loads(query(env, db, "SELECT count(*) AS n FROM runs WHERE input LIKE '%shard-%'").stdout)
        assert shard_runs[0]["n"] == 3
        # the bad row is recorded once, in a run over the original input, as a single-machine run records it
        bad = json.loads(query(env, db, "SELECT e.doc_id, e.field, r.input FROM input_errors e JOIN runs r "
                               "USING (run_id)").stdout)
        assert [(b["doc_id"], b["field"], b["input"]) for b in bad] == [("no-text", "text", inp)]
        worked = [log.read_text().count("submitted to infrastructure") for _, log in workers]
        assert all(n >= 1 for n in worked), worked

        # Second batch (new ratio, 3 x 8 documents): kill the worker that runs a shard, with its flow run, once
        # that flow run has stored some of its documents and not all; the parent sees the process gone, marks
        # the flow run crashed and resubmits the shard, which resumes after the stored documents.
        docs2 = sample_docs(24, chars=300)
        inp2 = write_batch(tmp_path / "batch2.parquet", docs2)
        run2 = run_cmd(inp2, "0.5", "32")
        parent2_log = tmp_path / "parent2.log"
        parent2 = start(run2, env, parent2_log)
        procs.append(parent2), logs.append(parent2_log)

        from pipeline.store import Store

        def running_shard():
            with Store(db, read_only=True) as store:
                pids = store.query("SELECT r.pid FROM runs r JOIN outputs o USING (run_id) WHERE r.compression_ratio "
                                   "= 0.5 AND r.status = 'running' GROUP BY r.pid HAVING count(DISTINCT o.doc_id) "
                                   "BETWEEN 1 AND 6").column(0).to_pylist()
            for w, _ in workers:
                if set(pids) & set(children(w.pid)):
                    return w
            return None

        victim = wait_for("a shard running on a worker", running_shard, 240, procs, logs)
        for pid in [victim.pid] + children(victim.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        victim.wait(30)
        forget(victim)
        assert finish(parent2, parent2_log, 180) == 0, parent2_log.read_text()[-3000:]
        forget(parent2)
        assert "marking it crashed" in parent2_log.read_text()

        # Re-submitting the finished batch runs nothing again.
        res = subprocess.run(run2, env=env, capture_output=True, text=True, timeout=240)
        assert res.returncode == 0, res.stderr[-3000:]
        assert "3 shards (3 done before)" in res.stderr
        t_done = time.monotonic()

        rows = json.loads(query(env, db, "SELECT o.doc_id, count(*) AS n FROM outputs o JOIN runs r USING (run_id) "
                                "WHERE r.compression_ratio = 0.5 GROUP BY o.doc_id").stdout)
        assert sorted(r["doc_id"] for r in rows) == sorted(d["doc_id"] for d in docs2)
        assert all(r["n"] == 1 for r in rows), rows  # nothing lost, nothing twice
        statuses = json.loads(query(env, db, "SELECT status, count(*) AS n FROM runs WHERE compression_ratio = 0.5 "
                                    "GROUP BY status ORDER BY status").stdout)
        assert {s["status"] for s in statuses} <= {"completed", "running", "interrupted"}
        # `nkv serve --pool --shards` serves the same fan-out on a schedule; run it now instead of at 2 am
        # (one worker is left, so its two shards run one after the other).
        docs3 = sample_docs(4, chars=300)
        inp3 = write_batch(tmp_path / "batch3.parquet", docs3)
        serve_log = tmp_path / "serve.log"
        served = start(NKV + ["serve", "--pool", "nkv-pool", "--shards", "2", "--name", "nightly", "--input", inp3,
                              "--model", str(model), "--db", db, "--data-path", str(data), "--max-new-tokens", "4",
                              "--retries", "0", "--compression-ratio", "0.9"], env, serve_log)
        procs.append(served), logs.append(serve_log)
        wait_for("the served fan-out", lambda: subprocess.run(
            PREFECT + ["deployment", "inspect", "sharded-batch/nightly"], env=env, capture_output=True,
            timeout=60).returncode == 0, 120, procs, logs)
        res = subprocess.run(PREFECT + ["deployment", "run", "sharded-batch/nightly", "--watch",
                                        "--watch-timeout", "300"], env=env, capture_output=True, text=True, timeout=360)
        assert res.returncode == 0, res.stdout[-2000:] + serve_log.read_text()[-3000:]
        rows = json.loads(query(env, db, "SELECT o.doc_id, count(*) AS n, any_value(r.input) AS input FROM "
                                "outputs o JOIN runs r USING (run_id) WHERE r.compression_ratio = 0.9 "
                                "GROUP BY o.doc_id ORDER BY o.doc_id").stdout)
        assert [(r["doc_id"], r["n"]) for r in rows] == [(d["doc_id"], 1) for d in docs3]
        assert len({r["input"] for r in rows}) == 2  # two shard files, one flow run each
        t_served = time.monotonic()
        retries = sum(int(n) for _, log in workers
                      for n in re.findall(r"(\d+) commits lost a race", log.read_text()))
        print(f"\nscale-out timings: setup {t_ready - t0:.0f} s, first batch {t_first - t_ready:.0f} s, "
              f"kill and resubmit {t_done - t_first:.0f} s, served fan-out {t_served - t_done:.0f} s; commit retries in the worker logs: {retries}")
    finally:
        for p in reversed(procs):
            stop(p)
        pg.stop()


# -- the fan-out's own logic, without a server -----------------------------------------------------------
def test_shards_split_evenly_and_name_the_batch(tmp_path):
    from flows.shards import ShardError, shard_counts, write_shards
    from pipeline.config import RunConfig

    assert shard_counts(7, 3, None) == [3, 2, 2]
    assert shard_counts(2, 5, None) == [1, 1]  # never an empty shard
    assert shard_counts(7, None, 3) == [3, 2, 2]
    for bad in [(None, None), (2, 3)]:
        with pytest.raises(ShardError, match="one of them"):
            shard_counts(7, *bad)
    with pytest.raises(ShardError, match="--shards must be at least 1, got 0"):
        shard_counts(7, 0, None)
    with pytest.raises(ShardError, match="--shard-size must be at least 1, got -2"):
        shard_counts(7, None, -2)
    inp = write_batch(tmp_path / "in.parquet", sample_docs(5, chars=120))
    cfg = RunConfig()
    shards, errors = write_shards(inp, cfg, tmp_path / "shards", "summarize-batch/shards", shards=2)
    assert errors == [] and [len(s.docs) for s in shards] == [3, 2]
    from pipeline.documents import load_documents

    back = [d.doc_id for s in shards for d in load_documents(str(s.path))[0]]
    assert back == [f"doc-{i}" for i in range(5)]
    again, _ = write_shards(inp, cfg, tmp_path / "shards", "summarize-batch/shards", shards=2)
    assert [s.key for s in again] == [s.key for s in shards]  # a re-submission asks for the same keys
    other, _ = write_shards(inp, cfg.model_copy(update={"compression_ratio": 0.5}), tmp_path / "shards",
                            "summarize-batch/shards", shards=2)
    assert other[0].key != shards[0].key and other[0].path != shards[0].path


@pytest.mark.slow  # over 3 s on two busy cores
def test_pool_needs_a_lake(tmp_path):
    res = subprocess.run(NKV + ["run", "--pool", "p", "--shards", "2", "--db", str(tmp_path / "runs.duckdb")],
                         capture_output=True, text=True, timeout=120, env=clean_env(tmp_path))
    assert res.returncode == 2 and "--pool needs a lake store" in res.stderr
    assert not (tmp_path / "runs.duckdb").exists()


def test_a_flow_run_whose_process_is_gone_is_stale(tmp_path):
    """On this host the store's run row tells; elsewhere only stopped heartbeats do, never their absence."""
    from datetime import datetime, timedelta, timezone
    from types import SimpleNamespace

    from flows import shards as sh
    from pipeline.config import RunConfig
    from pipeline.store import Store

    db = Store(tmp_path / "runs.duckdb")
    shard = sh.Shard(0, 1, tmp_path / "shard.parquet", [], "k")
    now = datetime.now(timezone.utc)
    fr = SimpleNamespace(id="x", start_time=now - timedelta(seconds=2))
    beats = {"at": None}
    monkey = pytest.MonkeyPatch()
    monkey.setattr(sh, "last_heartbeat", lambda client, fr: beats["at"])
    try:
        assert sh.stale(None, fr, db, shard, 60) is None  # no run yet, no heartbeat: cannot tell
        run = db.start_run(RunConfig(), str(shard.path))
        assert sh.stale(None, fr, db, shard, 60) is None  # its process (this one) is alive
        db.con.execute("UPDATE runs SET pid = 2 ** 22 + 7 WHERE run_id = ?", [run])  # no such pid
        assert "is gone" in sh.stale(None, fr, db, shard, 60)
        db.finish_run(run, "interrupted")
        assert "interrupted" in sh.stale(None, fr, db, shard, 60)
        old = SimpleNamespace(id="y", start_time=now - timedelta(minutes=10))
        beats["at"] = now - timedelta(minutes=5)
        assert "no heartbeat" in sh.stale(None, old, None, shard, 60)
        beats["at"] = now
        assert sh.stale(None, old, None, shard, 60) is None
    finally:
        monkey.undo()
        db.close()


def test_merged_summary_counts_each_document_once_over_attempts(tmp_path):
    from flows import shards as sh
    from pipeline.config import RunConfig
    from pipeline.results import ERROR
    from pipeline.store import Store
    from test_store import doc

    cfg = RunConfig()
    shard_docs = write_batch(tmp_path / "in.parquet", sample_docs(3, chars=100))
    shard_list, _ = sh.write_shards(shard_docs, cfg, tmp_path / "shards", "d", shards=1)
    (shard,) = shard_list
    d0, d1, d2 = shard.docs
    with Store(tmp_path / "runs.duckdb") as db:
        crashed = db.start_run(cfg, str(shard.path))  # attempt 0: d0 ok, d1 failed, then the process died
        db.write_document(crashed, doc(d0.doc_id, d0.content_sha256))
        db.write_document(crashed, doc(d1.doc_id, d1.content_sha256, status=ERROR, error="oom"))
        retry = db.start_run(cfg, str(shard.path))  # attempt 1 resumes: d1 now ok, d2 failed
        db.write_document(retry, doc(d1.doc_id, d1.content_sha256))
        db.write_document(retry, doc(d2.doc_id, d2.content_sha256, status=ERROR, error="bad"))
        db.write_document(db.start_run(cfg.model_copy(update={"compression_ratio": 0.5}), str(shard.path)),
                          doc(d2.doc_id, d2.content_sha256))  # another configuration does not count
        out = sh.FanOut(shard_list, [])
        sh.merge_summary(db, cfg, shard_list, out)
    assert (out.n_documents, out.n_ok, out.n_failed) == (3, 2, 1)
    assert out.run_ids == [crashed, retry]
    assert {r["run_id"] for r in out.savings} == {crashed, retry}


def test_bad_rows_of_a_fanned_out_batch_are_recorded_once(tmp_path):
    from flows.shards import record_input_errors, write_shards
    from pipeline.config import RunConfig
    from pipeline.store import Store

    cfg = RunConfig()
    inp = write_batch(tmp_path / "in.parquet", sample_docs(2, chars=100) + [{"doc_id": "empty", "text": ""}])
    shard_list, errors = write_shards(inp, cfg, tmp_path / "shards", "d", shards=2)
    assert [d.doc_id for s in shard_list for d in s.docs] == ["doc-0", "doc-1"]
    db = str(tmp_path / "runs.duckdb")
    assert record_input_errors(db, cfg, inp, []) is None
    run_id = record_input_errors(db, cfg, inp, errors)
    assert record_input_errors(db, cfg, inp, errors) is None  # a re-submission records nothing twice
    with Store(db, read_only=True) as store:
        rows = store.query("SELECT r.run_id, r.input, r.status, r.n_errors, e.doc_id, e.field FROM runs r "
                           "JOIN input_errors e USING (run_id)").to_pylist()
    assert rows == [{"run_id": run_id, "input": inp, "status": "completed", "n_errors": 1, "doc_id": "empty",
                     "field": "text"}]


def test_shard_status_and_fan_out_summary_read_as_the_cli_and_the_flow_print_them():
    from flows.shards import FanOut, Shard

    a, b = Shard(0, 2, Path("a.parquet"), [], "k"), Shard(1, 2, Path("b.parquet"), [], "k")
    assert a.status() == "pending"
    a.state, a.attempt = "RUNNING", 1
    assert a.status() == "running, attempt 1"
    b.skipped = True
    assert b.status() == "done before"
    out = FanOut([a, b], [], run_ids=["r1"], n_documents=3, n_ok=2, n_failed=1, wall_s=4.4)
    assert out.summary() == "2 shards (1 done before), 1 runs, 2 of 3 documents done, 1 failed, 0 bad rows, 4 s"
