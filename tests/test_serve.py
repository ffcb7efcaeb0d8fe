"""``nkv serve`` against a real ``prefect server start`` on loopback, and its one-line refusal without one."""

import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tiny import sample_docs, save_tiny_model_dir, write_batch

NKV = [sys.executable, "-m", "flows.cli"]
PREFECT = [sys.executable, "-m", "prefect"]
HINT = "PREFECT_API_URL=http://127.0.0.1:4200/api"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(tmp_path, api_url=None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               DO_NOT_TRACK="1", NKV_CACHE_DIR=str(tmp_path / "models"))
    if api_url:
        env["PREFECT_API_URL"] = api_url
    return env


def start(cmd, env, log_path):
    # Own process group: the server and the serve runner start children that must go too.
    log = open(log_path, "wb")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def stop(proc) -> None:
    if proc is None or proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGINT, 10), (signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def wait_for(what, check, timeout, procs=(), logs=()):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        for p, log in zip(procs, logs):
            if p.poll() is not None:
                pytest.fail(f"{what}: process exited with {p.returncode}:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    tails = "\n".join(log.read_text()[-2000:] for log in logs)
    pytest.fail(f"timed out after {timeout}s waiting for {what}\n{tails}")


def get(url):
    try:
        r = httpx.get(url, timeout=2)
        return r if r.status_code == 200 else None
    except httpx.HTTPError:
        return None


@pytest.mark.slow  # nkv in a subprocess
@pytest.mark.parametrize("api_url", [None, "closed-port"])
def test_serve_without_a_server_says_how_to_start_one(tmp_path, api_url):
    if api_url == "closed-port":
        api_url = f"http://127.0.0.1:{free_port()}/api"
    res = subprocess.run(NKV + ["serve", "--cron", "0 2 * * *"], env=clean_env(tmp_path, api_url),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    assert "prefect server start" in lines[0] and HINT in lines[0]


def store_refusing_writes(path) -> str:
    """A store whose outputs table no longer takes a document's rows: every document write fails."""
    import duckdb

    from pipeline.store import Store

    Store(path).close()
    con = duckdb.connect(str(path))
    con.execute("ALTER TABLE outputs ALTER COLUMN doc_id SET DATA TYPE INTEGER")
    con.close()
    return str(path)


@pytest.mark.server
def test_served_deployment_runs_with_a_new_ratio(tmp_path):
    """A served deployment, triggered with a new ratio, completes; triggered with a store whose writes fail,
    its flow run ends Failed with the one line (documents not stored), never Completed."""
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = clean_env(tmp_path, api)
    env["PREFECT_RUNNER_POLL_FREQUENCY"] = "1"  # pick the triggered run up at once
    model = save_tiny_model_dir(tmp_path / "tiny-model")
    inp = write_batch(tmp_path / "batch.parquet", sample_docs(2, chars=300))
    db = tmp_path / "runs.duckdb"
    server_log, serve_log = tmp_path / "server.log", tmp_path / "serve.log"
    server = serve = None
    try:
        server = start(PREFECT + ["server", "start", "--host", "127.0.0.1", "--port", str(port), "--no-ui"], env,
                       server_log)
        wait_for("the Prefect server", lambda: get(f"{api}/health"), 150, [server], [server_log])

        serve = start(NKV + ["serve", "--cron", "0 2 * * *", "--name", "nightly", "--input", inp, "--model",
                             str(model), "--db", str(db), "--max-new-tokens", "4", "--retries", "0"], env, serve_log)
        wait_for("the deployment", lambda: get(f"{api}/deployments/name/summarize-batch/nightly"), 90,
                 [server, serve], [server_log, serve_log])

        def trigger(param: str) -> str:
            res = subprocess.run(PREFECT + ["deployment", "run", "summarize-batch/nightly", "--param", param],
                                 env=env, capture_output=True, text=True, timeout=120)
            assert res.returncode == 0, res.stdout + res.stderr
            return re.search(r"UUID:\s*([0-9a-f-]{36})", res.stdout).group(1)

        def final(flow_run_id: str) -> dict:
            def finished():
                r = get(f"{api}/flow_runs/{flow_run_id}")
                state = r and r.json()["state"]
                return state if state and state["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") else None
            return wait_for("the flow run", finished, 150, [server, serve], [server_log, serve_log])

        state = final(trigger("compression_ratio=0.5"))
        assert state["type"] == "COMPLETED", serve_log.read_text()[-3000:]
        broken = store_refusing_writes(tmp_path / "broken.duckdb")
        state = final(trigger(f"db={broken}"))
        assert state["type"] == "FAILED", serve_log.read_text()[-3000:]
        assert "write failed" in state["message"] and "0 of 2 documents stored" in state["message"], state
    finally:
        stop(serve)
        stop(server)

    from pipeline.store import Store

    with Store(db, read_only=True) as store:
        (run,) = store.query("SELECT press, compression_ratio, status, n_documents FROM runs").to_pylist()
        assert run == {"press": "nestedkv", "compression_ratio": 0.5, "status": "completed", "n_documents": 2}
        assert store.query("SELECT count(*) AS n FROM outputs WHERE status = 'ok'").to_pylist() == [{"n": 2}]
        (saved,) = store.query("SELECT kept_share FROM memory_savings").to_pylist()
        assert saved["kept_share"] == pytest.approx(0.5, abs=0.02)
