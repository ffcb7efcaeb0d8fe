"""The batch engine on a tiny random model: one prefill per document for many configurations, results per
configuration, evaluation rows against the no_press run, resume, retries by predicate, the batched
decode giving the same answers, and press parameters reaching the configuration hash."""

import json

import nestedkv

import pytest
from tiny import TINY_NAME, ByteTokenizer, sample_docs, tiny_model, use_tiny_model, write_batch

import pipeline.engine as engine
from pipeline.config import RunConfig
from pipeline.documents import Document
from pipeline.engine import EngineOptions, check_configs, compute, make_configs
from pipeline.evaluate import METRIC_HOOKS
from pipeline.metrics import HOOKED_METRICS
from pipeline.results import ERROR, OK
from pipeline.runner import Runner
from pipeline.store import Store

BASE = RunConfig(task="qa", model=TINY_NAME, press="no_press", compression_ratio=0.0, max_new_tokens=6,
                 prefill_step_size=128)
EVALUATE = EngineOptions(evaluate=True)
BATCHED = EngineOptions(evaluate=True, batch_decode=True)


@pytest.fixture
def runner():
    return Runner(tiny_model(), ByteTokenizer(), BASE, max_context=4096)


def docs(n=2, chars=500):
    return [Document(**d) for d in sample_docs(n, chars)]


def configs(**kw):
    return make_configs(BASE, ["no_press", "nestedkv", "keydiff", "streaming_llm"], [0.5, 0.9], **kw)


def results(items):
    return {o.config: o.result for o in items}


def test_nestedkv_defaults_to_adaptive_head_budgets_and_baselines_to_uniform():
    assert RunConfig(press="nestedkv").head_budget == "adaptive"
    assert RunConfig(press="keydiff").head_budget == "uniform"
    assert RunConfig(press="nestedkv", head_budget="uniform").head_budget == "uniform"
    assert [c.head_budget for c in make_configs(BASE, ["nestedkv", "keydiff"], [0.5])] == ["adaptive", "uniform"]


def test_make_configs_is_every_combination_with_one_reference():
    cfgs = make_configs(BASE, ["no_press", "nestedkv", "keydiff"], [0.5, 0.9], head_budgets=["uniform", "adaptive"])
    assert cfgs[0] == BASE.reference()
    got = [(c.press, c.compression_ratio, c.head_budget) for c in cfgs[1:]]
    assert got == [
        ("nestedkv", 0.5, "uniform"), ("nestedkv", 0.5, "adaptive"), ("nestedkv", 0.9, "uniform"),
        ("nestedkv", 0.9, "adaptive"), ("keydiff", 0.5, "uniform"), ("keydiff", 0.5, "adaptive"),
        ("keydiff", 0.9, "uniform"), ("keydiff", 0.9, "adaptive"),
    ]
    assert len(make_configs(BASE, ["no_press", "knorm"], [0.5, 0.5])) == 2  # deduplicated
    budgets = make_configs(BASE, ["knorm"], [0.5], budgets=[64, 128])
    assert [(c.budget, c.compression_ratio) for c in budgets] == [(64, 0.0), (128, 0.0)]
    with pytest.raises(ValueError, match="compression_ratio"):
        make_configs(BASE, ["nestedkv"], [1.5])
    with pytest.raises(ValueError, match="ratio or budget"):
        make_configs(BASE, ["nestedkv"], [])


def test_configs_must_share_everything_but_the_press(runner):
    other = BASE.model_copy(update={"max_new_tokens": 99, "press": "keydiff"})
    with pytest.raises(ValueError, match="max_new_tokens"):
        check_configs([BASE, other])
    with pytest.raises(ValueError, match="max_new_tokens"):
        compute(runner, docs(1)[0], [BASE, other])


def test_one_prefill_per_document_for_many_configurations(runner, prefills):
    cfgs = configs()
    for doc in docs(2):
        items = compute(runner, doc, cfgs[1:], reference=cfgs[0])
        assert [o.config for o in items] == cfgs  # the reference runs first
        assert all(o.result.status == OK and len(o.result.questions) == 2 for o in items)
        # every result shares the one prefill's timing; each has its own compression
        assert len({o.result.prefill_s for o in items}) == 1
        kept = {(o.config.press, o.config.compression_ratio): o.result.layers[0].kept_mean for o in items}
        assert kept[("nestedkv", 0.9)] < kept[("nestedkv", 0.5)] < kept[("no_press", 0.0)]
    assert len(prefills) == 2


def test_streaming_configurations_prefill_on_their_own(runner, prefills):
    cfgs = make_configs(BASE, ["nestedkv", "keydiff"], [0.75], prefills=["whole", "streaming"])
    items = compute(runner, docs(1, chars=900)[0], cfgs)
    assert len(prefills) == 1 + 2  # the whole-context configurations share one, each streaming one has its own
    for o in items:
        assert o.result.status == OK, o.result.error
        n = o.result.n_tokens
        assert o.result.layers[0].kept_mean == int(n * 0.25)  # heads may differ (adaptive), their mean may not
    stream = [o.result for o in items if o.config.prefill == "streaming"]
    whole = [o.result for o in items if o.config.prefill == "whole"]
    # the point of streaming: a lower KV peak while prefilling than holding the whole context
    assert max(r.peak_kv_prefill_bytes for r in stream) < min(r.peak_kv_prefill_bytes for r in whole)


def test_zero_ratio_configuration_agrees_exactly_with_the_reference(runner):
    same = BASE.model_copy(update={"press": "nestedkv"})  # r = 0: nothing evicted
    items = compute(runner, docs(1)[0], [same], reference=BASE, options=EVALUATE)
    ref, res = items[0].result, items[1].result
    assert [q.output for q in res.questions] == [q.output for q in ref.questions]
    ref_scores, scores = items[0].scores, items[1].scores
    assert all(set(s) == {"correct", "gold_nll"} for s in ref_scores)  # the reference is scored against gold only
    for s, r in zip(scores, ref_scores):
        assert s["agree_exact"] == 1.0 and s["rouge_l"] == 1.0 and s["top1_agreement"] == 1.0
        assert s["delta_nll"] == pytest.approx(0.0, abs=1e-6)
        assert s["gold_nll"] == pytest.approx(r["gold_nll"], abs=1e-6) and s["gold_nll"] > 0
        assert s["delta_gold_nll"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.slow  # 3-6 s on two busy cores
def test_evaluate_scores_every_compressed_configuration(runner):
    items = compute(runner, docs(1)[0], configs(), reference=BASE, options=EVALUATE)
    for item in items[1:]:
        assert len(item.scores) == 2
        for s in item.scores:
            assert set(s) == {"correct", "agree_exact", "rouge_l", "delta_nll", "top1_agreement", "gold_nll",
                              "delta_gold_nll"}
    far = {(o.config.press, o.config.compression_ratio): o.scores for o in items}
    # every eviction moves the answer's likelihood off the full cache's (a random model ranks 50% and 90%
    # eviction in no particular order, so no order is asserted)
    assert all(s["delta_nll"] != 0.0 for (press, _), ss in far.items() if press != "no_press" for s in ss)
    for s, full in zip(far[("keydiff", 0.9)], items[0].scores):  # against the full cache's NLL of the same gold
        assert s["gold_nll"] - s["delta_gold_nll"] == pytest.approx(full["gold_nll"], abs=1e-9)
        assert s["delta_gold_nll"] != 0.0


def test_gold_kept_metric_hook(runner):
    doc = docs(1)[0]
    opts = EngineOptions(evaluate=True, metrics=("gold_kept",))
    items = compute(runner, doc, configs(), reference=BASE, options=opts)
    kept = {(o.config.press, o.config.compression_ratio): [s.get("gold_kept") for s in o.scores] for o in items}
    assert all(v == 1.0 for v in kept[("no_press", 0.0)] if v is not None)
    assert any(v is not None for v in kept[("no_press", 0.0)])  # the gold answers occur in the context
    with pytest.raises(ValueError, match="unknown metrics"):
        EngineOptions(metrics=("nope",))


def test_every_metric_the_settings_accept_has_its_hook():
    # The settings check names (pipeline.metrics), the engine calls hooks (pipeline.evaluate): one per name.
    assert tuple(METRIC_HOOKS) == HOOKED_METRICS
    assert EngineOptions(metrics=HOOKED_METRICS).metrics == HOOKED_METRICS


def test_batched_decode_gives_the_same_answers_and_scores(runner, prefills):
    doc = docs(1, chars=700)[0]
    one = compute(runner, doc, configs(), reference=BASE, options=EVALUATE)
    many = compute(runner, doc, configs(), reference=BASE, options=BATCHED)
    assert len(prefills) == 2  # one per call
    for a, b in zip(one, many):
        assert a.config == b.config and b.result.status == OK
        assert [q.output for q in a.result.questions] == [q.output for q in b.result.questions]
        assert [q.n_generated for q in a.result.questions] == [q.n_generated for q in b.result.questions]
        assert [m.kept_mean for m in a.result.layers] == [m.kept_mean for m in b.result.layers]
        for sa, sb in zip(a.scores, b.scores):
            assert sa.keys() == sb.keys()
            for k in sa:
                assert sb[k] == pytest.approx(sa[k], abs=1e-4)


def test_a_failing_configuration_does_not_lose_the_others(runner, monkeypatch):
    real = nestedkv.clone

    def flaky(cache, press=None, **kw):
        if press is not None and press.name == "keydiff":
            raise RuntimeError("boom")
        return real(cache, press, **kw)

    monkeypatch.setattr(nestedkv, "clone", flaky)
    for opts in (EVALUATE, BATCHED):
        items = compute(runner, docs(1)[0], configs(), reference=BASE, options=opts)
        status = {(o.config.press, o.config.compression_ratio): o.result for o in items}
        assert status[("keydiff", 0.5)].status == ERROR and status[("nestedkv", 0.5)].status == OK
        assert "boom" in status[("keydiff", 0.5)].error
        assert isinstance(status[("keydiff", 0.5)].exception, RuntimeError)


def test_document_without_questions_becomes_an_error_for_every_configuration(runner, prefills):
    doc = Document(doc_id="noq", text="some text " * 20)
    items = compute(runner, doc, configs()[:3])
    assert all(o.result.status == ERROR and "questions" in o.result.error for o in items)
    assert prefills == []


@pytest.mark.slow  # 3-6 s on two busy cores
@pytest.mark.parametrize("batch_decode", [False, True])
def test_run_stores_runs_and_evaluations_and_resumes(tmp_path, monkeypatch, prefills, batch_decode):
    opts = EngineOptions(evaluate=True, batch_decode=batch_decode)
    with use_tiny_model(monkeypatch):
        batch = write_batch(tmp_path / "in.parquet", sample_docs(2, 400))
        db = tmp_path / "eval.duckdb"
        cfgs = make_configs(BASE, ["nestedkv", "keydiff"], [0.5, 0.9], head_budgets=["uniform", "adaptive"])
        summary = engine.run(batch, cfgs, db, opts)
        n_runs = len(cfgs) + 1  # and the reference
        assert len(prefills) == 2 and summary.n_processed == 2 and summary.n_failed == 0
        assert len(summary.runs) == n_runs and summary.n_results == 2 * n_runs
        assert len(summary.savings) == n_runs  # the summary carries the savings of its own runs
        with Store(db, read_only=True) as s:
            q = lambda sql: s.query(sql).to_pylist()  # noqa: E731
            runs = {r["run_id"]: r for r in q("SELECT * FROM runs")}
            assert len(runs) == n_runs and all(r["status"] == "completed" for r in runs.values())
            ref = [r for r in runs.values() if r["press"] == "no_press"]
            assert len(ref) == 1
            ref_id = ref[0]["run_id"]
            assert q("SELECT count(*) AS n FROM outputs")[0]["n"] == n_runs * 2 * 2
            ev = q("SELECT e.*, r.press FROM evaluations e JOIN runs r USING (run_id)")
            for e in ev:
                if e["metric"] in ("correct", "gold_nll"):
                    assert e["reference_run_id"] is None
                else:
                    assert e["reference_run_id"] == ref_id and e["press"] != "no_press"
            per_metric = {}
            for e in ev:
                per_metric[(e["press"], e["metric"])] = per_metric.get((e["press"], e["metric"]), 0) + 1
            assert per_metric[("no_press", "correct")] == 4
            assert per_metric[("nestedkv", "delta_nll")] == 4 * 4  # 4 configs x 2 docs x 2 questions
            assert per_metric[("no_press", "gold_nll")] == 4 and per_metric[("nestedkv", "delta_gold_nll")] == 4 * 4
            view = q("SELECT * FROM quality_vs_full")
            assert {v["reference_run_id"] for v in view} == {ref_id}
            acc = [v for v in view if v["metric"] == "correct"]
            assert len(acc) == len(cfgs) and all(v["n"] == 4 for v in acc)

        # resume: everything done, nothing prefilled, no run started
        prefills.clear()
        again = engine.run(batch, cfgs, db, opts)
        assert prefills == [] and again.runs == [] and again.n_processed == 0 and again.n_skipped == 2

        # a new ratio: one prefill per document, only the new configuration (reference recomputed, not stored)
        more = cfgs + [BASE.model_copy(update={"press": "knorm", "compression_ratio": 0.75})]
        third = engine.run(batch, more, db, opts)
        assert len(prefills) == 2 and [c.press for c, _ in third.runs] == ["knorm"]
        with Store(db, read_only=True) as s:
            refs = s.query("SELECT DISTINCT e.reference_run_id AS r FROM evaluations e JOIN runs r USING (run_id) "
                           "WHERE r.press = 'knorm' AND e.metric = 'rouge_l'").to_pylist()
            assert refs == [{"r": ref_id}]  # scored against the stored reference run
            assert s.query("SELECT count(*) AS n FROM runs WHERE press = 'no_press'").to_pylist()[0]["n"] == 1


def test_a_run_has_no_reference_and_writes_each_document_once(tmp_path, monkeypatch):
    with use_tiny_model(monkeypatch):
        batch = write_batch(tmp_path / "in.parquet", sample_docs(2, 400))
        db = tmp_path / "runs.duckdb"
        cfg = BASE.model_copy(update={"press": "keydiff", "compression_ratio": 0.5})
        summary = engine.run(batch, [cfg], db)
        assert [c.model_copy(update={"model_key": None}) for c, _ in summary.runs] == [cfg] and summary.n_ok == 2
        with Store(db, read_only=True) as s:
            assert s.query("SELECT DISTINCT press FROM runs").to_pylist() == [{"press": "keydiff"}]
            assert s.query("SELECT count(*) AS n FROM evaluations").to_pylist() == [{"n": 0}]


def test_retry_predicate_sees_the_exception_after_the_error_rows_are_stored(tmp_path, monkeypatch):
    with use_tiny_model(monkeypatch) as (pair, _):
        batch = write_batch(tmp_path / "in.parquet", sample_docs(1, 300))
        cfg = BASE.model_copy(update={"press": "keydiff", "compression_ratio": 0.5})
        runner = Runner(*pair, cfg, max_context=4096)
        monkeypatch.setattr(Runner, "prefill", lambda *a, **k: (_ for _ in ()).throw(MemoryError("device")))
        seen = []
        with Store(tmp_path / "r.duckdb") as store:
            plan = engine.open_plan(store, batch, [cfg])
            doc = plan.docs[0]
            with pytest.raises(MemoryError):
                engine.process_document(runner, store, plan, doc, retry_if=lambda e: seen.append(e) or True)
            rows = store.query("SELECT status, error FROM outputs").to_pylist()
            assert [r["status"] for r in rows] == ["error"] and "MemoryError: device" in rows[0]["error"]
            out = engine.process_document(runner, store, plan, doc, retry_if=lambda e: False)
            assert out[0].result.status == ERROR
            assert store.query("SELECT count(*) AS n FROM outputs").to_pylist() == [{"n": 1}]  # replaced
        assert isinstance(seen[0], MemoryError)


def test_a_press_parameter_changes_the_hash_and_is_stored(tmp_path, monkeypatch):
    a = BASE.model_copy(update={"press": "nestedkv", "compression_ratio": 0.5})
    b = RunConfig.model_validate({**a.model_dump(), "press_params": {"tau": 0.5}})
    assert a.config_hash() != b.config_hash()
    assert RunConfig.model_validate({**a.model_dump(), "press_params": {"tau": 0.6}}) != b
    assert '"tau":0.6' in a.canonical_json()  # the method's defaults are hashed too
    with pytest.raises(ValueError, match="does not take"):
        RunConfig.model_validate({**a.model_dump(), "press_params": {"nope": 1}})
    with pytest.raises(ValueError):
        RunConfig.model_validate({**a.model_dump(), "press_params": {"tau": "high"}})
    with use_tiny_model(monkeypatch):
        batch = write_batch(tmp_path / "in.parquet", sample_docs(1, 300))
        db = tmp_path / "runs.duckdb"
        engine.run(batch, [a], db)
        assert engine.run(batch, [a], db).n_processed == 0  # resumed
        again = engine.run(batch, [b], db)
        assert again.n_processed == 1  # the changed parameter recomputes
        with Store(db, read_only=True) as s:
            stored = s.query("SELECT config_json FROM runs WHERE run_id = ?", [again.run_ids[0]]).to_pylist()
        # unrotate on by default is written out, as runs that set it before it was the default wrote it
        assert '"press_params":{"tau":0.5,"unrotate":true}' in stored[0]["config_json"]


def test_batched_decode_applies_the_repetition_penalty_like_one_at_a_time(prefills):
    """Summaries carry a repetition penalty by default: the batched path must apply it per entry, exactly."""
    base = RunConfig(task="summarize", model=TINY_NAME, press="no_press", compression_ratio=0.0, max_new_tokens=8,
                     prefill_step_size=128, repetition_penalty=1.5)
    r = Runner(tiny_model(), ByteTokenizer(), base, max_context=4096)
    cfgs = make_configs(base, ["keydiff", "nestedkv"], [0.5])
    doc = docs(1, chars=600)[0]
    one = compute(r, doc, cfgs)
    many = compute(r, doc, cfgs, options=EngineOptions(batch_decode=True))
    outputs = lambda items: [q.output for o in items for q in o.result.questions]  # noqa: E731
    assert outputs(one) == outputs(many)
    # and the penalty did change the answers (else this test could not fail)
    plain = Runner(tiny_model(), ByteTokenizer(), base.model_copy(update={"repetition_penalty": 1.0}), max_context=4096)
    greedy = compute(plain, doc, [c.model_copy(update={"repetition_penalty": 1.0}) for c in cfgs])
    assert outputs(one) != outputs(greedy)


@pytest.mark.slow  # 3-6 s on two busy cores
@pytest.mark.parametrize("task", ["qa", "summarize"])
def test_documents_decoded_together_answer_as_one_at_a_time(tmp_path, monkeypatch, task):
    """--batch-size: documents of different lengths and questions decode as one batch, same answers,
    one transaction per document, and resume as usual."""
    base = BASE.model_copy(update={"task": task, "repetition_penalty": 1.3 if task == "summarize" else None})
    texts = [dict(d, text=d["text"][: 250 + 90 * i]) for i, d in enumerate(sample_docs(4, 700))]
    texts[2]["questions"], texts[2]["answers"] = ["Who reads?"], ["a tiny model"]  # fewer questions
    with use_tiny_model(monkeypatch):
        batch = write_batch(tmp_path / "in.parquet", texts)
        cfgs = make_configs(base, ["keydiff", "nestedkv"], [0.5], head_budgets=["uniform", "adaptive"])
        engine.run(batch, cfgs, tmp_path / "one.duckdb")
        together = engine.run(batch, cfgs, tmp_path / "many.duckdb", EngineOptions(batch_size=3))
        assert together.n_ok == 4 * len(cfgs) and together.n_failed == 0
        q = ("SELECT r.press, r.head_budget, o.doc_id, o.question_idx, o.output, o.n_generated FROM outputs o "
             "JOIN runs r USING (run_id) ORDER BY ALL")
        with Store(tmp_path / "one.duckdb", read_only=True) as a, Store(tmp_path / "many.duckdb", read_only=True) as b:
            assert a.query(q).to_pylist() == b.query(q).to_pylist()
        again = engine.run(batch, cfgs, tmp_path / "many.duckdb", EngineOptions(batch_size=3))
        assert again.n_processed == 0
    with pytest.raises(ValueError, match="batch_size"):
        EngineOptions(batch_size=0)


# What MLX raises when an allocation fails: Metal past its largest buffer, Metal out of memory, the CPU's malloc.
MLX_OOM = [
    "[metal::malloc] Attempting to allocate 42949672960 bytes which is greater than the maximum allowed buffer "
    "size of 28991029248 bytes.",
    "[METAL] Command buffer execution failed: Insufficient Memory (00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)",
    "[malloc] Unable to allocate 17179869184 bytes.",
    "[metal] out of memory",
]


@pytest.mark.parametrize("message", MLX_OOM, ids=["metal-buffer", "metal-insufficient", "cpu-malloc", "out-of-memory"])
def test_out_of_memory_in_the_whole_prefill_falls_back_to_streaming_when_allowed(runner, monkeypatch, message):
    real = Runner.prefill

    def no_room_for_all(self, prepared, res, press=None, on_prefill=None):
        if isinstance(press, nestedkv.NoPress):
            raise RuntimeError(message)
        return real(self, prepared, res, press=press, on_prefill=on_prefill)

    monkeypatch.setattr(Runner, "prefill", no_room_for_all)
    cfgs = make_configs(BASE, ["nestedkv", "keydiff"], [0.75])
    doc = docs(1, chars=900)[0]
    with pytest.raises(RuntimeError):
        compute(runner, doc, cfgs)  # not allowed: the error stands
    items = compute(runner, doc, cfgs, options=EngineOptions(on_oom="streaming"))
    for o in items:
        assert o.result.status == OK and "prefilled streaming" in o.result.error
        assert o.result.layers[0].kept_mean == int(o.result.n_tokens * 0.25)
    with pytest.raises(ValueError, match="on_oom"):
        EngineOptions(on_oom="maybe")


@pytest.mark.parametrize("options", [EVALUATE, BATCHED], ids=["one-at-a-time", "batched"])
def test_a_question_too_long_for_the_window_loses_only_itself(options):
    """Its row says too_long naming the document and question, it has no scores; the other question of the
    same document is answered and scored under every configuration."""
    from pipeline.evaluate import evaluation_rows
    from pipeline.results import TOO_LONG

    d = Document(doc_id="long-q", text=sample_docs(1, 300)[0]["text"],
                 questions=["Who reads bytes?", "Why " + "and how " * 60 + "?"], answers=["a tiny model", "x"])
    runner = Runner(tiny_model(), ByteTokenizer(), BASE)
    prepared = runner.prepare(d)
    runner.max_context = len(prepared.context_ids) + len(prepared.questions[0][1]) + BASE.max_new_tokens + 20
    items = compute(runner, d, make_configs(BASE, ["nestedkv"], [0.5]), reference=BASE, options=options)
    for o in items:
        first, second = o.result.questions
        assert o.result.status == OK and first.status == OK and first.output
        assert second.status == TOO_LONG and "document 'long-q' question 1" in second.error
        assert o.scores[1] == {} and o.scores[0]
        rows = evaluation_rows("run", o.result, o.scores, "ref-run")
        assert rows and {r["question_idx"] for r in rows} == {0}


def test_weights_changed_in_place_are_new_work_and_the_same_weights_resume(tmp_path, monkeypatch):
    """Resume keys a run by the model's revision (its files' hashes), dtype and device, not its path: a model
    folder whose weights were rewritten is not "already done" (it was), the same weights are."""
    from pipeline import models
    from tiny import save_tiny_model_dir

    model = save_tiny_model_dir(tmp_path / "model", seed=0)
    batch = write_batch(tmp_path / "in.parquet", sample_docs(1, 300))
    cfg = BASE.model_copy(update={"model": str(model), "press": "keydiff", "compression_ratio": 0.5})
    db = tmp_path / "runs.duckdb"
    assert engine.run(batch, [cfg], db).n_processed == 1
    models.clear_loaded()
    assert engine.run(batch, [cfg], db).n_processed == 0  # the same weights: done
    save_tiny_model_dir(tmp_path / "model", seed=1)  # other weights, same folder
    models.clear_loaded()
    summary = engine.run(batch, [cfg], db)
    assert summary.n_processed == 1 and summary.n_ok == 1
    keys = {json.loads(c.model_key)["revision"] for c, _ in summary.runs}
    assert len(keys) == 1 and next(iter(keys)).startswith("sha256:")
    assert engine.run(batch, [cfg.model_copy(update={"dtype": "bfloat16"})], db).n_processed == 1  # another dtype
