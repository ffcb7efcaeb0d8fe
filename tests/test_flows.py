"""The Prefect flows on a tiny random model: error rows, retries, resume, one prefill per sweep document,
artifacts, and the CLI going through the flows. One temporary Prefect API for the whole session."""

import pytest

from tiny import TINY_NAME, sample_docs, use_tiny_model, write_batch

from prefect.testing.utilities import prefect_test_harness

from flows.batch import budget_sweep, qa_batch, summarize_batch
from pipeline.config import BatchOptions
from pipeline.runner import Runner
from pipeline.store import Store

pytestmark = pytest.mark.slow  # every test here runs with a Prefect server (the session's harness)

FAST = BatchOptions(max_new_tokens=4, prefill_step_size=128, retries=2, retry_delay_s=0)


@pytest.fixture(scope="session", autouse=True)
def prefect_api():
    # Prefect's own temporary server and database, not the user's profile.
    with prefect_test_harness(server_startup_timeout=180):
        yield


@pytest.fixture
def tiny(monkeypatch):
    """The name TINY_NAME loads one tiny llama with a byte tokenizer; yields the list of loads."""
    with use_tiny_model(monkeypatch) as (_, loads):
        yield loads


@pytest.fixture
def calls(monkeypatch):
    """Counts Runner.start (once per document and attempt) per doc_id; ``calls.fail[doc_id] = [exc, ..., last]``
    raises one per call, then ``last`` on every later call (None: run normally)."""

    class Calls(dict):
        fail: dict = {}

    seen = Calls()
    seen.fail = {}
    real = Runner.start

    def start(self, doc):
        seen[doc.doc_id] = seen.get(doc.doc_id, 0) + 1
        queue = seen.fail.get(doc.doc_id)
        exc = (queue.pop(0) if len(queue) > 1 else queue[0]) if queue else None  # the last one repeats
        if exc is not None:
            raise exc
        return real(self, doc)

    monkeypatch.setattr(Runner, "start", start)
    return seen


def batch_file(tmp_path, n=3, extra=()):
    return write_batch(tmp_path / "batch.parquet", sample_docs(n) + list(extra))


def rows(db, sql, params=None):
    with Store(db, read_only=True) as s:
        return s.query(sql, params).to_pylist()


def test_flow_names_and_parameters():
    assert (summarize_batch.name, qa_batch.name, budget_sweep.name) == ("summarize-batch", "qa-batch", "budget-sweep")
    props = summarize_batch.parameters.properties
    assert {"input", "press", "compression_ratio", "budget", "head_budget", "prefill", "press_params", "model", "db",
            "options"} <= set(props)
    # every generation setting is a deployment parameter (inside options)
    from pipeline.config import GenerationSettings

    assert set(GenerationSettings.model_fields) <= set(BatchOptions().model_dump())


def test_tasks_get_runner_store_and_plan_as_arguments_without_serializing_them(tmp_path, tiny, monkeypatch):
    """The document task receives live objects (model, DuckDB connection): Prefect must pass them through."""
    import pipeline.engine as engine

    seen = []
    real = engine.process_documents

    def spy(runner, store, plan, docs, **kw):
        seen.append((type(runner).__name__, type(store).__name__, type(plan).__name__, store.con is not None))
        return real(runner, store, plan, docs, **kw)

    monkeypatch.setattr(engine, "process_documents", spy)
    s = summarize_batch(input=batch_file(tmp_path, n=2), model=TINY_NAME, db=str(tmp_path / "r.duckdb"), options=FAST)
    assert seen == [("Runner", "Store", "Plan", True)] * 2 and s.n_ok == 2


def test_bad_document_becomes_error_row_and_the_batch_completes(tmp_path, tiny, calls):
    db = str(tmp_path / "runs.duckdb")
    inp = batch_file(tmp_path, extra=[{"doc_id": "bad", "text": "a document the runner chokes on " * 5},
                                      {"doc_id": "empty", "text": ""}])
    calls.fail["bad"] = [ValueError("boom")]  # not transient: no retry
    state = summarize_batch(input=inp, model=TINY_NAME, db=db, compression_ratio=0.5, options=FAST,
                            return_state=True)
    assert state.is_completed()
    s = state.result()
    assert (s.n_ok, s.n_failed, s.n_skipped, len(s.input_errors)) == (3, 1, 0, 1)
    assert calls["bad"] == 1 and tiny == [TINY_NAME]  # model loaded once for all documents
    out = {r["doc_id"]: r for r in rows(db, "SELECT doc_id, status, error, output FROM outputs")}
    assert set(out) == {"doc-0", "doc-1", "doc-2", "bad"}
    assert out["bad"]["status"] == "error" and "ValueError: boom" in out["bad"]["error"]
    assert all(out[f"doc-{i}"]["status"] == "ok" for i in range(3))
    (run,) = rows(db, "SELECT run_id, status, n_documents, n_errors FROM runs")
    assert (run["run_id"], run["status"], run["n_documents"], run["n_errors"]) == (s.run_ids[0], "completed", 4, 2)
    assert rows(db, "SELECT doc_id, field FROM input_errors") == [{"doc_id": "empty", "field": "text"}]
    (m,) = rows(db, "SELECT n_documents, kept_share FROM memory_savings")
    assert m["n_documents"] == 3 and m["kept_share"] == pytest.approx(0.5, abs=0.02)


def test_transient_errors_are_retried_then_stored(tmp_path, tiny, calls):
    db = str(tmp_path / "runs.duckdb")
    inp = batch_file(tmp_path, n=3)
    calls.fail["doc-0"] = [RuntimeError("metal: out of memory"), None]  # fails once, then works
    calls.fail["doc-1"] = [RuntimeError("device lost")]  # fails every attempt
    state = summarize_batch(input=inp, model=TINY_NAME, db=db, options=FAST, return_state=True)
    s = state.result()
    assert state.is_completed()
    assert calls["doc-0"] == 2  # the retry succeeded
    assert calls["doc-1"] == FAST.retries + 1  # every attempt, then an error row
    assert calls["doc-2"] == 1
    status = {r["doc_id"]: (r["status"], r["error"]) for r in rows(db, "SELECT doc_id, status, error FROM outputs")}
    assert status["doc-0"] == ("ok", None)  # the first attempt's error row was replaced, not duplicated
    assert status["doc-1"][0] == "error" and "device lost" in status["doc-1"][1]
    assert rows(db, "SELECT count(*) AS n FROM outputs")[0]["n"] == 3
    assert (s.n_ok, s.n_failed) == (2, 1)


def test_rerun_resumes_without_duplicates_or_model_work(tmp_path, tiny, calls):
    db = str(tmp_path / "runs.duckdb")
    inp = batch_file(tmp_path, n=3)
    calls.fail["doc-1"] = [ValueError("bad once")]
    first = qa_batch(input=inp, model=TINY_NAME, db=db, options=FAST)
    assert (first.n_ok, first.n_failed) == (2, 1)

    calls.clear()
    calls.fail.clear()
    second = qa_batch(input=inp, model=TINY_NAME, db=db, options=FAST)
    assert dict(calls) == {"doc-1": 1}  # only the failed document runs again
    assert (second.n_ok, second.n_skipped) == (1, 2)

    calls.clear()
    tiny.clear()
    third = qa_batch(input=inp, model=TINY_NAME, db=db, options=FAST)
    assert dict(calls) == {} and tiny == []  # finished: no runner call, not even a model load
    assert (third.n_ok, third.n_skipped) == (0, 3)
    # Two questions per document; each document's ok answers exist once across all runs.
    ok = rows(db, "SELECT doc_id, count(*) AS n FROM outputs WHERE status = 'ok' GROUP BY doc_id ORDER BY doc_id")
    assert ok == [{"doc_id": f"doc-{i}", "n": 2} for i in range(3)]
    # a batch with nothing left starts no run
    assert [r["status"] for r in rows(db, "SELECT status FROM runs ORDER BY created_at")] == ["completed"] * 2


def test_sweep_prefills_each_document_once(tmp_path, tiny, prefills):
    db = str(tmp_path / "runs.duckdb")
    inp = batch_file(tmp_path, n=2)
    s = budget_sweep(input=inp, presses=["nestedkv", "keydiff"], compression_ratios=[0.5, 0.75],
                     head_budgets=["uniform", "adaptive"], model=TINY_NAME, db=db, options=FAST)
    assert sorted(prefills) == ["doc-0", "doc-1"]  # one prefill per document for all 9 runs
    # {nestedkv, keydiff} x {uniform, adaptive} x 2 ratios + no_press
    assert len(s.runs) == 9 and (s.n_processed, s.n_results, s.n_failed) == (2, 18, 0)
    saved = rows(db, "SELECT press, compression_ratio, head_budget, n_documents, kept_share FROM memory_savings")
    assert len(saved) == 9 and all(r["n_documents"] == 2 for r in saved)
    for r in saved:
        assert r["kept_share"] == pytest.approx(1 - r["compression_ratio"], abs=0.02)
    compared = rows(db, "SELECT DISTINCT run_id FROM quality_vs_full")
    assert len(compared) == 8  # every compressed run beside its no_press twin

    prefills.clear()
    again = budget_sweep(input=inp, presses=["nestedkv", "keydiff"], compression_ratios=[0.5, 0.75],
                         head_budgets=["uniform", "adaptive"], model=TINY_NAME, db=db, options=FAST)
    assert prefills == [] and again.runs == [] and again.n_processed == 0
    assert rows(db, "SELECT count(*) AS n FROM runs")[0]["n"] == 9


def test_artifacts_report_progress_savings_and_a_summary(tmp_path, tiny):
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    db = str(tmp_path / "runs.duckdb")
    state = summarize_batch(input=batch_file(tmp_path, n=2), model=TINY_NAME, db=db, options=FAST,
                            return_state=True)
    flow_run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        arts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    by_type = {}
    for a in arts:
        by_type.setdefault(a.type, []).append(a)
    assert set(by_type) == {"progress", "table", "markdown"}
    assert by_type["progress"][0].data == 100.0
    keys = {a.key for a in by_type["table"]}
    assert keys == {"summarize-batch-memory-savings", "summarize-batch-layer-savings"}
    report = by_type["markdown"][0].data
    assert state.result().run_ids[0] in report and "2 done, 0 failed" in report


def test_cli_run_and_sweep_go_through_the_flows(tmp_path, tiny):
    from prefect import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from typer.testing import CliRunner

    from flows.cli import app

    db = str(tmp_path / "runs.duckdb")
    inp = batch_file(tmp_path, n=2)
    cli = CliRunner()
    res = cli.invoke(app, ["run", "--input", inp, "--model", TINY_NAME, "--db", db, "--max-new-tokens", "4",
                           "--press-name", "knorm", "--compression_ratio", "0.5"])
    assert res.exit_code == 0, res.output
    assert "2 done, 0 failed" in res.output
    res = cli.invoke(app, ["sweep", "--input", inp, "--model", TINY_NAME, "--db", db, "--max-new-tokens", "4",
                           "--press", "nestedkv,keydiff", "--compression-ratio", "0.5,0.9", "--no-evaluate"])
    assert res.exit_code == 0, res.output
    assert "5 runs, 2 documents prefilled once" in res.output
    assert {r["press"] for r in rows(db, "SELECT DISTINCT press FROM runs")} == {"knorm", "nestedkv", "keydiff",
                                                                              "no_press"}
    with get_client(sync_client=True) as client:
        for name in ("summarize-batch", "budget-sweep"):
            runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[name])))
            assert runs and all(r.state.is_completed() for r in runs), name


def test_cli_errors_are_one_line_before_prefect_starts(tmp_path):
    from typer.testing import CliRunner

    from flows.cli import app

    res = CliRunner().invoke(app, ["run", "--input", str(tmp_path / "missing.parquet")])
    assert res.exit_code == 2 and "no such file" in res.output
    res = CliRunner().invoke(app, ["sweep", "--compression-ratio", "0.5,x"])
    assert res.exit_code == 2 and "comma-separated" in res.output


@pytest.mark.parametrize("raised", ["write failed", "task failed"])
def test_a_flow_run_whose_documents_were_not_all_stored_ends_failed(tmp_path, tiny, monkeypatch, raised):
    """As a served or deployed run ends: the second document's write fails (the disk filled up: a store write
    error; or anything else, so its task fails and its rows are not stored). The flow run is Failed with the
    one line, not Completed; the first document stays stored; a re-run does the rest."""
    from prefect import get_client

    from flows.batch import BatchNotStored
    from pipeline.store import StoreWriteError

    db = str(tmp_path / "runs.duckdb")
    inp = batch_file(tmp_path, n=3)
    real, calls = Store.write_results, [0]

    def write_results(self, items):
        calls[0] += 1
        if calls[0] == 2:
            raise StoreWriteError(f"{db}: write failed: disk full") if raised == "write failed" else ValueError("boom")
        return real(self, items)

    monkeypatch.setattr(Store, "write_results", write_results)
    options = FAST.model_copy(update={"retries": 0})
    state = summarize_batch(input=inp, model=TINY_NAME, db=db, options=options, return_state=True)
    assert state.is_failed()
    with get_client(sync_client=True) as client:  # what the Prefect API (a served run's UI) shows
        assert client.read_flow_run(state.state_details.flow_run_id).state.type.value == "FAILED"
    got = state.result(raise_on_failure=False)
    assert isinstance(got, BatchNotStored) and state.message == str(got) == got.summary.problem()
    words = "write failed: disk full" if raised == "write failed" else "documents doc-1: not stored (ValueError: boom)"
    assert words in state.message and "1 of 3 documents stored (kept), 2 not stored" in state.message
    assert "\n" not in state.message
    assert rows(db, "SELECT DISTINCT doc_id FROM outputs") == [{"doc_id": "doc-0"}]
    assert [r["status"] for r in rows(db, "SELECT status FROM runs")] == ["failed"]

    monkeypatch.setattr(Store, "write_results", real)
    again = summarize_batch(input=inp, model=TINY_NAME, db=db, options=options, return_state=True)
    assert again.is_completed() and (again.result().n_ok, again.result().n_skipped) == (2, 1)
    assert rows(db, "SELECT doc_id FROM outputs ORDER BY doc_id") == [{"doc_id": f"doc-{i}"} for i in range(3)]


def test_a_new_generation_setting_reaches_every_layer_from_its_field_alone():
    """--repetition-context-size is declared once (GenerationSettings): the CLI option, the flow's options,
    the configuration and the runner's penalty follow, and at its default the stored hash is the old one."""
    from flows.cli.spec import build
    from flows.params import ONE
    from pipeline.config import RunConfig

    press = {"press": "nestedkv", "compression_ratio": "0.75", "budget": None, "head_budget": None,
             "prefill": "whole", "press_param": None, "kv_bits": None, "kv_group_size": "64"}
    spec = build(press, {"repetition_context_size": 16}, input="x.parquet")
    assert spec.config().repetition_context_size == 16 and spec.config().penalty() == (1.1, 16)
    assert ONE.arguments(spec)["options"].repetition_context_size == 16
    assert "repetition_context_size" not in RunConfig().canonical_json()  # hashed as before the field existed
    assert RunConfig(repetition_context_size=16).config_hash() != RunConfig().config_hash()
    import typer

    from flows.cli import app

    group = typer.main.get_command(app)
    for cmd in ("run", "sweep", "eval", "serve"):  # the option the CLI generates from the field
        command = group.get_command(typer.Context(group), cmd)
        assert any("--repetition-context-size" in p.opts for p in command.params), cmd


def test_generated_flows_are_importable_where_deployments_look_for_them():
    """A deployment imports <fn.__module__>.<fn.__name__>: the generated functions must name their own module."""
    import importlib

    from flows.sharded import sharded_batch

    for f in (summarize_batch, qa_batch, budget_sweep, sharded_batch):
        assert getattr(importlib.import_module(f.fn.__module__), f.fn.__name__) is f
