"""Budget sweeps on a tiny random model: one prefill per document, results per configuration, evaluation
rows against the no_press run, resume, and the batched decode giving the same answers."""

import nestedkv  # noqa: F401  (loads OpenBLAS before mlx)

import pytest
from tiny import TINY_NAME, ByteTokenizer, sample_docs, tiny_model, use_tiny_model, write_batch

import pipeline.sweep as sweep
from pipeline.config import RunConfig
from pipeline.documents import Document
from pipeline.results import ERROR, OK
from pipeline.runner import Runner
from pipeline.store import Store
from pipeline.sweep import check_configs, run_sweep, sweep_configs, sweep_document

BASE = RunConfig(task="qa", model=TINY_NAME, press="no_press", compression_ratio=0.0, max_new_tokens=6,
                 prefill_step_size=128)


@pytest.fixture
def runner():
    return Runner(tiny_model(), ByteTokenizer(), BASE, max_context=4096)


@pytest.fixture
def prefills(monkeypatch):
    """Counts Runner.prefill calls (the only place a context is prefilled)."""
    calls = []
    real = Runner.prefill

    def counting(self, prepared, res, press=None, on_prefill=None):
        calls.append(len(prepared.context_ids))
        return real(self, prepared, res, press=press, on_prefill=on_prefill)

    monkeypatch.setattr(Runner, "prefill", counting)
    return calls


def docs(n=2, chars=500):
    return [Document(**d) for d in sample_docs(n, chars)]


def configs(**kw):
    return sweep_configs(BASE, ["nestedkv", "keydiff", "streaming_llm"], [0.5, 0.9], ["uniform", "adaptive"], **kw)


def test_sweep_configs_multiply_head_budgets_for_nestedkv_only():
    cfgs = configs()
    assert cfgs[0] == BASE.reference()
    got = [(c.press, c.head_budget, c.compression_ratio) for c in cfgs[1:]]
    assert got == [
        ("nestedkv", "uniform", 0.5), ("nestedkv", "uniform", 0.9),
        ("nestedkv", "adaptive", 0.5), ("nestedkv", "adaptive", 0.9),
        ("keydiff", "uniform", 0.5), ("keydiff", "uniform", 0.9),
        ("streaming_llm", "uniform", 0.5), ("streaming_llm", "uniform", 0.9),
    ]
    assert len(configs(head_budget_presses=None)) == 1 + 12
    assert len(sweep_configs(BASE, ["no_press", "knorm"], [0.5, 0.5])) == 2  # deduplicated
    with pytest.raises(ValueError):
        sweep_configs(BASE, ["nestedkv"], [1.5])


def test_configs_must_share_everything_but_the_press(runner):
    other = BASE.model_copy(update={"max_new_tokens": 99, "press": "keydiff"})
    with pytest.raises(ValueError, match="max_new_tokens"):
        check_configs(BASE, [other])
    with pytest.raises(ValueError, match="max_new_tokens"):
        sweep_document(runner, docs(1)[0], [other])


def test_one_prefill_per_document_for_many_configurations(runner, prefills):
    cfgs = configs()
    seen = []
    for doc in docs(2):
        items = sweep_document(runner, doc, cfgs[1:], on_prefilled=lambda shell: seen.append(shell.doc_id))
        # the reference was added (at the end, so results line up with the configurations passed)
        assert [c for c, _ in items] == cfgs[1:] + [cfgs[0]]
        assert all(res.status == OK and len(res.questions) == 2 for _, res in items)
        # every result shares the one prefill's timing; each has its own compression
        assert len({res.prefill_s for _, res in items}) == 1
        kept = {(c.press, c.compression_ratio, c.head_budget): res.layers[0].kept_mean for c, res in items}
        assert kept[("nestedkv", 0.9, "uniform")] < kept[("nestedkv", 0.5, "uniform")] < kept[("no_press", 0.0, "uniform")]
    assert len(prefills) == 2 and seen == ["doc-0", "doc-1"]


def test_reference_is_not_duplicated_and_order_follows_configs(runner, prefills):
    cfgs = configs()
    order = [cfgs[3], cfgs[0], cfgs[1]]
    items = sweep_document(runner, docs(1)[0], order)
    assert [c for c, _ in items] == order
    assert len(prefills) == 1


def test_zero_ratio_configuration_agrees_exactly_with_the_reference(runner):
    same = BASE.model_copy(update={"press": "nestedkv"})  # r = 0: nothing evicted
    items = sweep_document(runner, docs(1)[0], [BASE, same], evaluate=True)
    (_, ref), (_, res) = items
    assert [q.output for q in res.questions] == [q.output for q in ref.questions]
    ref_scores, scores = items[0].scores, items[1].scores
    assert all(set(s) == {"correct"} for s in ref_scores)  # the reference is scored against gold only
    for s in scores:
        assert s["agree_exact"] == 1.0 and s["rouge_l"] == 1.0 and s["top1_agreement"] == 1.0
        assert s["delta_nll"] == pytest.approx(0.0, abs=1e-6)


def test_evaluate_scores_every_compressed_configuration(runner):
    items = sweep_document(runner, docs(1)[0], configs(), evaluate=True)
    for item in items[1:]:
        assert len(item.scores) == 2
        for s in item.scores:
            assert set(s) == {"correct", "agree_exact", "rouge_l", "delta_nll", "top1_agreement"}
    far = {(c.press, c.compression_ratio): it.scores for it in items for c in [it.config]}
    # evicting 90% of the context moves the model further from the full cache than evicting 50%
    mean = lambda ss: sum(s["delta_nll"] for s in ss) / len(ss)  # noqa: E731
    assert mean(far[("keydiff", 0.9)]) > mean(far[("keydiff", 0.5)])


def test_batched_decode_gives_the_same_answers_and_scores(runner, prefills):
    doc = docs(1, chars=700)[0]
    one = sweep_document(runner, doc, configs(), evaluate=True)
    many = sweep_document(runner, doc, configs(), evaluate=True, batch_decode=True)
    assert len(prefills) == 2  # one per call
    for a, b in zip(one, many):
        assert a.config == b.config and b.result.status == OK
        assert [q.output for q in a.result.questions] == [q.output for q in b.result.questions]
        assert [q.n_generated for q in a.result.questions] == [q.n_generated for q in b.result.questions]
        assert a.result.layers == b.result.layers
        for sa, sb in zip(a.scores, b.scores):
            assert sa.keys() == sb.keys()
            for k in sa:
                assert sb[k] == pytest.approx(sa[k], abs=1e-4)


def test_a_failing_configuration_does_not_lose_the_others(runner, monkeypatch):
    real = sweep._compressed_copy

    def flaky(runner, full, cfg):
        if cfg.press == "keydiff":
            raise RuntimeError("boom")
        return real(runner, full, cfg)

    monkeypatch.setattr(sweep, "_compressed_copy", flaky)
    for batch in (False, True):
        items = sweep_document(runner, docs(1)[0], configs(), evaluate=True, batch_decode=batch)
        status = {(c.press, c.compression_ratio, c.head_budget): r.status for c, r in items}
        assert status[("keydiff", 0.5, "uniform")] == ERROR and status[("nestedkv", 0.5, "uniform")] == OK
        assert "boom" in dict(items)[configs()[5]].error


def test_document_without_questions_becomes_an_error_for_every_configuration(runner, prefills):
    doc = Document(doc_id="noq", text="some text " * 20)
    items = sweep_document(runner, doc, configs()[:3])
    assert all(r.status == ERROR and "questions" in r.error for _, r in items)
    assert prefills == []


@pytest.mark.parametrize("batch_decode", [False, True])
def test_run_sweep_stores_runs_and_evaluations_and_resumes(tmp_path, monkeypatch, prefills, batch_decode):
    with use_tiny_model(monkeypatch):
        batch = write_batch(tmp_path / "in.parquet", sample_docs(2, 400))
        db = tmp_path / "eval.duckdb"
        cfgs = sweep_configs(BASE, ["nestedkv", "keydiff"], [0.5, 0.9], ["uniform", "adaptive"])
        summary = run_sweep(batch, cfgs, db, evaluate=True, batch_decode=batch_decode)
        assert len(prefills) == 2 and summary.n_swept == 2 and summary.n_failed == 0
        assert len(summary.runs) == len(cfgs) and summary.n_results == 2 * len(cfgs)
        with Store(db, read_only=True) as s:
            q = lambda sql: s.query(sql).to_pylist()  # noqa: E731
            runs = {r["run_id"]: r for r in q("SELECT * FROM runs")}
            assert len(runs) == len(cfgs) and all(r["status"] == "completed" for r in runs.values())
            ref = [r for r in runs.values() if r["press"] == "no_press"]
            assert len(ref) == 1
            ref_id = ref[0]["run_id"]
            assert q("SELECT count(*) AS n FROM outputs")[0]["n"] == len(cfgs) * 2 * 2
            ev = q("SELECT e.*, r.press FROM evaluations e JOIN runs r USING (run_id)")
            for e in ev:
                if e["metric"] == "correct":
                    assert e["reference_run_id"] is None
                else:
                    assert e["reference_run_id"] == ref_id and e["press"] != "no_press"
            per_metric = {}
            for e in ev:
                per_metric.setdefault((e["press"], e["metric"]), 0)
                per_metric[(e["press"], e["metric"])] += 1
            assert per_metric[("no_press", "correct")] == 4
            assert per_metric[("nestedkv", "delta_nll")] == 4 * 4  # 4 configs x 2 docs x 2 questions
            view = q("SELECT * FROM quality_vs_full")
            assert {v["reference_run_id"] for v in view} == {ref_id}
            assert {v["metric"] for v in view} == {"correct", "agree_exact", "rouge_l", "delta_nll", "top1_agreement"}
            acc = [v for v in view if v["metric"] == "correct"]
            assert len(acc) == len(cfgs) - 1 and all(v["n"] == 4 for v in acc)

        # resume: everything done, nothing prefilled, no run started
        prefills.clear()
        again = run_sweep(batch, cfgs, db, evaluate=True, batch_decode=batch_decode)
        assert prefills == [] and again.runs == [] and again.n_swept == 0

        # a new ratio: one prefill per document, only the new configuration (reference recomputed, not stored)
        more = cfgs + [BASE.model_copy(update={"press": "knorm", "compression_ratio": 0.75})]
        third = run_sweep(batch, more, db, evaluate=True, batch_decode=batch_decode)
        assert len(prefills) == 2 and [c.press for c, _ in third.runs] == ["knorm"]
        with Store(db, read_only=True) as s:
            refs = s.query("SELECT DISTINCT e.reference_run_id AS r FROM evaluations e JOIN runs r USING (run_id) "
                           "WHERE r.press = 'knorm' AND e.metric = 'rouge_l'").to_pylist()
            assert refs == [{"r": ref_id}]  # scored against the stored reference run
            assert s.query("SELECT count(*) AS n FROM runs WHERE press = 'no_press'").to_pylist()[0]["n"] == 1


def test_batched_decode_is_skipped_when_the_runner_penalizes_repetition(prefills):
    """Summaries carry a repetition penalty by default; the batched greedy loop has none, so it must not run."""
    base = RunConfig(task="summarize", model=TINY_NAME, press="no_press", compression_ratio=0.0, max_new_tokens=8,
                     prefill_step_size=128, repetition_penalty=1.5)
    r = Runner(tiny_model(), ByteTokenizer(), base, max_context=4096)
    cfgs = sweep_configs(base, ["keydiff", "nestedkv"], [0.5])
    doc = docs(1, chars=600)[0]
    one = sweep_document(r, doc, cfgs)
    many = sweep_document(r, doc, cfgs, batch_decode=True)
    assert [q.output for _, res in one for q in res.questions] == [q.output for _, res in many for q in res.questions]
    # and the penalty did change the answers (else this test could not fail)
    plain = Runner(tiny_model(), ByteTokenizer(), base.model_copy(update={"repetition_penalty": 1.0}), max_context=4096)
    greedy = sweep_document(plain, doc, [c.model_copy(update={"repetition_penalty": 1.0}) for c in cfgs])
    assert [q.output for _, res in one for q in res.questions] != [q.output for _, res in greedy for q in res.questions]
