"""Presses that score keys with the model (KVzip's reconstruction, Expected Attention): kept rows, real
savings, both head budgets, quantized KV, a cloned (prefill-cache) context, their refusals, and that their
scores are not a key-only press's."""

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

import nestedkv
from nestedkv import compress, layer_stats, make_cache
from nestedkv.press import PRESSES, get_press
from nestedkv.press.kvzip import KVzipPress

MODEL_PRESSES = [name for name, p in PRESSES.items() if p.needs_model]
N = 200
QUESTIONS = [[11, 12, 13, 14, 15], [16, 17, 18]]  # what a question-aware press reads; the others ignore them


def _prefilled(model, toks, press=None):
    cache = make_cache(model, press)
    for i in range(0, len(toks), 64):
        model(toks[None, i : i + 64], cache=cache)
    return cache


@pytest.mark.parametrize("name", MODEL_PRESSES)
@pytest.mark.parametrize("head_budget", ["uniform", "adaptive"])
def test_keeps_the_budget_with_real_savings(tiny_model, tokens, name, head_budget):
    model, toks = tiny_model("llama"), tokens(N)
    press = get_press(name, compression_ratio=0.75, head_budget=head_budget)
    cache = _prefilled(model, toks, press)
    compress(cache, model=model, tokens=toks.tolist(), prompt=[1, 2, 3], questions=QUESTIONS)
    keep = press.n_keep(N)
    across_layers = name == "kvzip" and head_budget == "adaptive"  # one threshold over every layer and head
    kept = [np.array(c.kept) for c in cache]
    heads = kept[0].shape[1]
    if across_layers:  # the same rows in all, each layer's share rounded to whole rows per head
        assert abs(sum(int(k.sum()) for k in kept) - len(cache) * heads * keep) <= len(cache) * heads / 2
    for counts, m in zip(kept, layer_stats(cache)):
        if not across_layers:
            assert int(counts.sum()) == heads * keep
        assert m.bytes_resident < m.bytes_full / 2  # rows really dropped, adaptive stored unpadded
        if head_budget == "uniform":
            assert (counts == keep).all()
    out = model(tokens(3, seed=1)[None], cache=cache)  # answers from the compressed cache
    assert np.isfinite(np.array(out)).all()


@pytest.mark.parametrize("name", MODEL_PRESSES)
def test_quantized_kv_and_a_cloned_context(tiny_model, tokens, name):
    from tests.tiny import make_tiny_model

    model, toks = make_tiny_model("llama", hidden=128, n_heads=4, n_kv_heads=2), tokens(N)  # head_dim 32
    full = _prefilled(model, toks)  # what the prefill cache holds: uncompressed, no press
    press = get_press(name, compression_ratio=0.5)
    plain = nestedkv.clone(full, press, model=model)
    quant = nestedkv.clone(full, get_press(name, compression_ratio=0.5, kv_bits=8, kv_group_size=32), model=model)
    for c in (plain, quant):
        compress(c, model=model, tokens=toks.tolist(), questions=QUESTIONS)
    assert all(c.quantized for c in quant) and not any(c.quantized for c in plain)
    for a, b in zip(plain, quant):  # scored on the real keys before quantizing: the same rows
        assert np.array_equal(np.array(a.kept), np.array(b.kept))
    assert sum(m.bytes_resident for m in layer_stats(quant)) < sum(m.bytes_resident for m in layer_stats(plain))


@pytest.mark.parametrize("name", MODEL_PRESSES)
def test_scores_are_not_a_key_only_press(tiny_model, tokens, name):
    model, toks = tiny_model("llama"), tokens(N)
    full = _prefilled(model, toks)
    press = get_press(name, compression_ratio=0.75)
    scores = nestedkv.clone(full, press, model=model)
    scores = nestedkv.model_scores(scores, model, toks.tolist(), [5, 6], QUESTIONS)
    for c, s in zip(full, scores):
        assert s.shape == (1, c.keys.shape[1], N) and np.isfinite(np.array(s)).all()
        for other in ("knorm", "keydiff"):
            key_only = get_press(other, compression_ratio=0.75, unrotate=False)
            ours = set(np.array(press.select_model_scores(s).indices)[0, 0].tolist())
            theirs = set(np.array(key_only.select(c.keys[..., :N, :]).indices)[0, 0].tolist())
            assert ours != theirs


def test_kvzip_adaptive_moves_budget_to_the_layers_whose_scores_stand_out():
    press = KVzipPress(compression_ratio=0.5, head_budget="adaptive")
    flat = mx.broadcast_to(0.01 + 0.0001 * mx.arange(40), (1, 2, 40))  # reconstructs nothing: diffuse
    peaked = mx.broadcast_to(mx.concatenate([mx.full((30,), 0.9), mx.full((10,), 0.001)]), (1, 2, 40))
    assert press.n_keep(40) == 20
    assert press.layer_keeps([flat, peaked]) == [10, 30]  # the 80 rows above one threshold, 60 of them peaked
    assert KVzipPress(compression_ratio=0.5).layer_keeps([flat, peaked]) == [None, None]  # uniform


def test_kvzip_scores_are_the_most_attention_a_reconstruction_query_gives(tiny_model, tokens):
    model, toks = tiny_model("llama", n_layers=1), tokens(64)
    full = _prefilled(model, toks)
    one = KVzipPress(compression_ratio=0.5, chunk=64).model_scores(model, full, toks.tolist(), [])
    halves = KVzipPress(compression_ratio=0.5, chunk=32).model_scores(model, full, toks.tolist(), [])
    s1, s2 = np.array(one[0]), np.array(halves[0])
    assert ((s1 > 0) & (s1 <= 1)).all() and ((s2 > 0) & (s2 <= 1)).all()  # attention probabilities
    assert not np.allclose(s1, s2)  # the chunking changes which rows the queries see


@pytest.mark.parametrize("name", MODEL_PRESSES)
def test_refusals_are_one_line(tiny_model, tokens, name):
    model, toks = tiny_model("llama"), tokens(N)
    if PRESSES[name].needs_questions:  # steered streaming, uniform budgets only
        with pytest.raises(ValueError, match="head_budget='uniform' only"):
            get_press(name, prefill="streaming", head_budget="adaptive")
    else:
        with pytest.raises(ValueError, match="cannot evict while prefilling"):
            get_press(name, prefill="streaming")
    cache = _prefilled(model, toks, get_press(name, compression_ratio=0.5))
    with pytest.raises(ValueError, match="scores keys with the model"):
        compress(cache)
    with pytest.raises(ValueError, match="tokens given for a cache"):
        compress(cache, model=model, tokens=toks.tolist()[:-1], questions=QUESTIONS)
    if get_press(name).needs_questions:
        with pytest.raises(ValueError, match="lets the document's questions pick the rows"):
            compress(cache, model=model, tokens=toks.tolist(), questions=[[]])


def test_compression_seconds_include_the_reconstruction(tiny_model, tokens):
    from pipeline.results import DocumentResult
    from pipeline.runner import Runner  # noqa: F401  (the pipeline's compression path)
    from pipeline.runner.window import PreparedDocument

    model, toks = tiny_model("llama"), tokens(N)

    class Fake:  # what Runner.compress reads: the model and the repeat instruction
        pass

    runner = Fake()
    runner.model, runner.repeat_prompt = model, lambda: [1, 2]
    seen = {}
    real = KVzipPress.model_scores

    def spy(self, *a):
        seen["called"] = True
        return real(self, *a)

    res = DocumentResult("d", "x", 1, None)
    cache = _prefilled(model, toks, get_press("kvzip", compression_ratio=0.5))
    KVzipPress.model_scores = spy
    try:
        Runner.compress(runner, cache, res, PreparedDocument(toks.tolist(), []))
    finally:
        KVzipPress.model_scores = real
    assert seen.get("called") and res.compress_s > 0 and all(c.compressed for c in cache)


@pytest.mark.parametrize("blocks", [False, True], ids=["one-call", "numpy-row-blocks"])
def test_peak_context_weights_are_the_causal_softmax_maxima(blocks, monkeypatch):
    from nestedkv import attention as nkv_attention
    from nestedkv import probe as nkv_probe
    from nestedkv.probe import peak_context_weights

    rng = np.random.default_rng(0)
    B, Hq, H, L, n, D = 1, 4, 2, 40, 12, 16
    q = rng.standard_normal((B, Hq, L, D)).astype(np.float32)
    k = rng.standard_normal((B, H, n + L, D)).astype(np.float32)
    monkeypatch.setattr(nkv_attention, "PARALLEL_MIN_SCORES", 0 if blocks else 2**62)
    calls, real = [], nkv_attention.numpy_softmax
    monkeypatch.setattr(nkv_probe, "numpy_softmax", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    got = np.array(peak_context_weights(mx.array(q), mx.array(k), 0.25, n))
    assert bool(calls) == blocks
    s = np.einsum("bhgld,bhsd->bhgls", q.reshape(B, H, Hq // H, L, D), k) * 0.25
    s = np.where(np.arange(n + L)[None] - n <= np.arange(L)[:, None], s, -np.inf)  # causal, aligned to the end
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    assert got.shape == (B, H, n)
    np.testing.assert_allclose(got, w[..., :n].max(axis=(2, 3)), rtol=1e-5, atol=1e-6)


def test_feeding_the_last_rows_again_recomputes_them(tiny_model, tokens):
    from nestedkv.probe import probe

    model, toks = tiny_model("llama"), tokens(N)
    full = _prefilled(model, toks)
    seen = {}

    def observe(layer, queries, keys, values, scale):
        seen[layer] = keys

    for _ in probe(model, full, [toks.tolist()[N - 40:]], observe, "test", rows=N - 40):
        pass
    for layer, c in enumerate(full):  # the fed rows' keys are the cached ones: the prefill's own queries too
        np.testing.assert_allclose(np.array(seen[layer]), np.array(c.keys[..., :N, :]), atol=1e-4)


@pytest.mark.parametrize("spec", [{"dims": 16, "traditional": False, "base": 10000.0, "scale": 1.0},
                                  {"dims": 8, "traditional": True, "base": 500.0, "scale": 0.5}])
def test_the_mean_rotation_is_the_rope_averaged_over_positions(spec):
    from nestedkv.rope import from_description, mean_rotation

    x = mx.array(np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32))
    rope = from_description(spec, sign=1.0)
    want = sum(rope(x[None, :, None, :], p) for p in range(40, 47))[0, :, 0, :] / 7
    np.testing.assert_allclose(np.array(x @ mean_rotation(spec, 40, 7, 16)), np.array(want), atol=1e-5)
    back = from_description(spec)(rope(x[None, :, None, :], 9), 9)  # sign=-1 undoes sign=1
    np.testing.assert_allclose(np.array(back[0, :, 0, :]), np.array(x), atol=1e-5)


def test_expected_attention_reads_queries_without_their_rope_turning():
    # One query direction seen at many positions: rotated, it looks like a spread that the covariance would
    # reward in keys with large high-frequency parts; rotated back, it has no spread at all.
    from nestedkv.press.expected_attention import expected_attention_scores
    from nestedkv.rope import from_description, mean_rotation

    spec = {"dims": 16, "traditional": False, "base": 10000.0, "scale": 1.0}
    rope = from_description(spec, sign=1.0)
    rng = np.random.default_rng(2)
    q0 = mx.array(np.tile(rng.standard_normal((1, 1, 1, 16)).astype(np.float32), (1, 1, 32, 1)))
    queries = rope(q0, 100)  # positions 100..131
    keys = rope(mx.array(rng.standard_normal((1, 1, 50, 16)).astype(np.float32)), 0)
    values = mx.ones((1, 1, 50, 16))
    m = mean_rotation(spec, 132, 8, 16)
    got = expected_attention_scores(from_description(spec)(queries, 100), keys, values, 0.25, True, m)
    mean_only = expected_attention_scores(from_description(spec)(queries, 100), keys, values, 0.25, False, m)
    np.testing.assert_allclose(np.array(got), np.array(mean_only), atol=1e-4)  # no spread: no covariance term
    rotated = expected_attention_scores(queries, keys, values, 0.25, True)
    assert not np.allclose(np.array(rotated), np.array(mean_only), atol=1e-2)



@pytest.mark.parametrize("name", MODEL_PRESSES)
def test_a_sweep_scores_a_document_once_for_all_its_budgets(monkeypatch, name):
    """Configurations that differ only in ratio and head budget share one scoring pass per document; each
    answers as it does alone and records the pass's seconds as its own compression cost."""
    from pipeline.config import EngineOptions, RunConfig
    from pipeline.documents import Document
    from pipeline.engine import compute
    from pipeline.runner import Runner
    from tiny import ByteTokenizer, make_tiny_model, sample_docs

    cls = type(get_press(name))
    calls = []
    real = cls.model_scores
    clock = [0.0]  # the runner's clock moves only while a press scores: 100 s a pass

    def scoring(self, *a, **k):
        calls.append(1)
        clock[0] += 100.0
        return real(self, *a, **k)

    monkeypatch.setattr(cls, "model_scores", scoring)
    monkeypatch.setattr("pipeline.runner.time", SimpleNamespace(perf_counter=lambda: clock[0]))  # its clock only
    configs = [RunConfig(task="qa", model="tiny", press=name, max_new_tokens=4, compression_ratio=r, head_budget=h)
               for r in (0.5, 0.75) for h in ("uniform", "adaptive")]
    runner = Runner(make_tiny_model(), ByteTokenizer(), configs[0])
    doc = Document(**sample_docs(1, 300)[0])
    together = compute(runner, doc, configs, options=EngineOptions())
    assert len(calls) == 1 and all(o.result.status == "ok" for o in together)
    assert [o.result.compress_s for o in together] == [100.0] * 4  # each records the shared pass as its own
    for cfg, got in zip(configs, together):
        calls.clear()
        alone = compute(runner, doc, [cfg], options=EngineOptions())[0]
        assert len(calls) == 1
        assert [q.output for q in alone.result.questions] == [q.output for q in got.result.questions]
        assert [m.kept_mean for m in alone.result.layers] == [m.kept_mean for m in got.result.layers]


class ChatBytes:
    """Bytes as tokens, with a chat template that marks the user's and the assistant's turns."""

    chat_template = "marks"

    def encode(self, text, add_special_tokens=False):
        return list(text.encode("utf-8"))

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return f"<u>{messages[0]['content']}</u><a>"


def test_kvzip_repeats_each_chunk_in_the_assistants_turn(tiny_model, tokens, monkeypatch):
    from nestedkv.press import kvzip as kvzip_module
    from pipeline.prompts import REPEAT_FIRST, REPEAT_RESUME, repeat_instruction

    model, toks = tiny_model("llama"), tokens(N)
    fed = []
    real = kvzip_module.probe
    monkeypatch.setattr(kvzip_module, "probe",
                        lambda m, c, feeds, *a, **kw: fed.extend(feeds) or real(m, c, feeds, *a, **kw))
    instruction = repeat_instruction(ChatBytes())
    assert bytes(instruction.suffix) == b"</u><a>"
    compress(_prefilled(model, toks, get_press("kvzip", compression_ratio=0.5, chunk=64, overlap=8)),
             model=model, tokens=toks.tolist(), prompt=instruction)
    ids = toks.tolist()
    assert len(fed) == 4  # 200 context tokens in chunks of 64
    assert fed[0] == [*REPEAT_FIRST.encode(), *b"</u><a>", *ids[:64]]
    assert fed[1] == [*REPEAT_RESUME.encode(), *ids[56:64], *b"</u><a>", *ids[64:128]]
    assert fed[3][-8:] == ids[-8:] and len(fed[3]) == len(REPEAT_RESUME) + 8 + 7 + 200 - 192


def test_a_plain_token_list_is_the_instruction_before_every_chunk():
    from nestedkv.probe import Instruction

    plain = Instruction.of([5, 6])
    assert plain.feed([1, 2], [3, 4], True) == [5, 6, 3, 4]
    assert plain.feed([1, 2], [3, 4], False) == [5, 6, 1, 2, 3, 4]
    assert Instruction.of(plain) is plain


def test_the_nestedkv_prior_is_the_mean_of_both_ranks(tiny_model, tokens):
    from nestedkv.press.kvzip import KVzipNestedPress, _ranks

    model, toks = tiny_model("llama"), tokens(N)
    cache = _prefilled(model, toks, get_press("kvzip_nestedkv", compression_ratio=0.5))
    both = nestedkv.model_scores(cache, model, toks.tolist(), [1, 2])
    alone = nestedkv.model_scores(_prefilled(model, toks, get_press("kvzip", compression_ratio=0.5)), model,
                                  toks.tolist(), [1, 2])
    nested = get_press("nestedkv")
    for c, b, z in zip(cache, both, alone):
        n = nested.score(c.unrope(c.keys[..., :N, :], 0))
        np.testing.assert_allclose(np.array(b), np.array((_ranks(z) + _ranks(n)) / 2), atol=1e-6)
    assert np.array(_ranks(mx.array([[[0.3, -1.0, 2.0]]])))[0, 0].tolist() == [0.5, 0.0, 1.0]
    assert KVzipNestedPress(compression_ratio=0.5, head_budget="adaptive").layer_keeps(both) == [None] * len(both)


@pytest.mark.parametrize("task", ["qa", "summarize"])
def test_snapkv_reads_the_documents_questions_through_the_runner(monkeypatch, task):
    """``nkv run --press snapkv``: the runner hands the press every question's suffix (a summary's
    instruction), so the rows kept follow what is asked."""
    from pipeline.config import RunConfig
    from pipeline.documents import Document
    from pipeline.runner import Runner
    from nestedkv.press.snapkv import SnapKVPress
    from tiny import ByteTokenizer, make_tiny_model, sample_docs

    seen = []
    real = SnapKVPress.model_scores

    def spy(self, model, cache, tokens, prompt, questions=()):
        seen.append(questions)
        return real(self, model, cache, tokens, prompt, questions=questions)

    monkeypatch.setattr(SnapKVPress, "model_scores", spy)
    runner = Runner(make_tiny_model(), ByteTokenizer(),
                    RunConfig(task=task, model="tiny", press="snapkv", max_new_tokens=3, compression_ratio=0.5))
    doc = sample_docs(1, 300)[0]
    asked = ["Who came to the house?", "Where is the key?"]
    res = runner.run(Document(**{**doc, "questions": asked if task == "qa" else None}))
    assert res.status == "ok" and res.layers[0].kept_mean < res.n_tokens
    _, prepared = runner.start(Document(**{**doc, "questions": asked if task == "qa" else None}))
    assert seen == [[ids for _, ids, _ in prepared.questions]] and len(seen[0]) == (2 if task == "qa" else 1)


def test_snapkv_keeps_what_its_questions_attend_to(tiny_model, tokens):
    """Two windows that repeat different stretches of the context keep different rows."""
    model, toks = tiny_model("llama"), tokens(N)
    full = _prefilled(model, toks)
    press = get_press("snapkv", compression_ratio=0.75)
    chosen = []
    for q in ([toks.tolist()[40:60]], [toks.tolist()[150:170]]):
        scores = nestedkv.model_scores(nestedkv.clone(full, press, model=model), model, toks.tolist(), (), q)
        chosen.append([set(np.array(press.select_model_scores(s).indices)[0, 0].tolist()) for s in scores])
    assert chosen[0] != chosen[1]
