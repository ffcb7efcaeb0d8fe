"""Finch-class reading: ``snapkv`` streaming with uniform budgets, the questions scoring the rows the cache holds
after every chunk (``nestedkv.steer``) and the next eviction keeping the best."""

import mlx.core as mx
import numpy as np

import nestedkv
from nestedkv import compress, make_cache
from nestedkv.press import get_press
from tests.test_model_presses import N, QUESTIONS, _prefilled


def _streamed(model, toks, press, chunk, questions=QUESTIONS, each=None):
    """A steered streaming prefill, the questions read after every chunk but the last; ``each(i, cache)``
    after each chunk (before its reading)."""
    cache = make_cache(model, press, context_len=len(toks))
    for i, start in enumerate(range(0, len(toks), chunk)):
        model(toks[None, start : start + chunk], cache=cache)
        mx.eval([c.state for c in cache])
        if each is not None:
            each(i, cache)
        if start + chunk < len(toks):
            nestedkv.steer(cache, model, questions)
    return cache


def test_snapkv_streaming_in_one_chunk_keeps_what_the_whole_prefill_keeps(tiny_model, tokens):
    """One chunk holding the whole context: the questions read it once, as after a whole prefill."""
    model, toks = tiny_model("llama"), tokens(N)
    press = get_press("snapkv", compression_ratio=0.75, head_budget="uniform")
    whole = _prefilled(model, toks, press)
    compress(whole, model=model, tokens=toks.tolist(), questions=QUESTIONS)
    streamed = _streamed(model, toks, get_press("snapkv", compression_ratio=0.75, head_budget="uniform",
                                                prefill="streaming"), N)
    compress(streamed, model=model, questions=QUESTIONS)
    step = mx.array([[5]])
    np.testing.assert_allclose(np.array(model(step, cache=streamed)), np.array(model(step, cache=whole)),
                               atol=1e-5, rtol=1e-5)


def test_snapkv_steers_each_chunks_eviction(tiny_model, tokens):
    """Past its budget a steered stream keeps, of the rows it held, those the questions' last reading ranked
    best, and holds no more than the budget and one chunk."""
    model, toks = tiny_model("llama"), tokens(N)
    press = get_press("snapkv", compression_ratio=0.75, head_budget="uniform", prefill="streaming")
    keep, chunk, read = press.n_keep(N), 32, {}
    spy = nestedkv.steer

    def each(i, cache):
        assert all(c.stored <= keep + chunk for c in cache)
        if i == 2:  # the 64 rows of chunks 0-1 were over the budget: the reading after chunk 1 chose
            for c, s in zip(cache, read[1]):
                pos = np.array(c.stream.rows["pos"])[0]
                for h in range(pos.shape[0]):
                    want = sorted(np.array(press.select_scores(s, keep).indices)[0, h].tolist())
                    assert sorted(p for p in pos[h].tolist() if p < 2 * chunk) == want
        read[i] = None

    def steer_and_keep(cache, m, questions):
        read[max(read)] = spy(cache, m, questions)
        return read[max(read)]

    import unittest.mock as mock
    with mock.patch.object(nestedkv, "steer", steer_and_keep):
        cache = _streamed(model, toks, press, chunk, each=each)
    compress(cache, model=model, questions=QUESTIONS)
    assert all(int(c.kept[0, h].item()) == keep for c in cache for h in range(c.kept.shape[1]))
    assert nestedkv.layer_stats(cache)[0].bytes_resident <= nestedkv.layer_stats(cache)[0].bytes_full * 0.3


def test_snapkv_steered_stream_quantizes_what_it_keeps(tokens):
    """``--kv-bits`` with a steered stream: rows stream unquantized, the kept ones are quantized at the end."""
    from tests.tiny import make_tiny_model

    model, toks = make_tiny_model("llama", hidden=128, n_heads=4, n_kv_heads=2), tokens(N)  # head_dim 32
    press = get_press("snapkv", compression_ratio=0.75, head_budget="uniform", prefill="streaming", kv_bits=8,
                      kv_group_size=32)
    cache = _streamed(model, toks, press, 48)
    compress(cache, model=model, questions=QUESTIONS)
    assert all(c.quantized and int(mx.max(c.kept).item()) == press.n_keep(N) for c in cache)
    assert mx.all(mx.isfinite(model(mx.array([[5]]), cache=cache))).item()
