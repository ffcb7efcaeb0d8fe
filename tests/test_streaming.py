"""prefill="streaming": eviction during the chunked prefill with a bounded number of stored rows."""

import dataclasses

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, load_prompt_cache, save_prompt_cache

from nestedkv import (
    KeyDiffPress,
    KnormPress,
    NestedKVCache,
    NestedKVPress,
    NoPress,
    RandomPress,
    StreamingLLMPress,
    compress,
    layer_stats,
    make_cache,
    peak_kv_bytes,
)
from nestedkv.press import BasePress
from nestedkv.scoring import block_size
from nestedkv.streaming import StreamState
from tiny import feed


def streaming(press):
    return dataclasses.replace(press, prefill="streaming")


def test_prefill_setting_is_validated_and_saved():
    p = NestedKVPress(budget=64, prefill="streaming")
    assert BasePress.from_json(p.to_json()) == p and '"prefill": "streaming"' in p.to_json()
    assert NestedKVPress().prefill == "whole"
    with pytest.raises(ValueError, match="prefill must be one of whole, streaming"):
        KeyDiffPress(prefill="chunked")


@pytest.mark.parametrize("press", [NestedKVPress(compression_ratio=0.0, prefill="streaming"),
                                   NoPress(prefill="streaming")], ids=["nestedkv_r0", "no_press"])
def test_r0_streaming_is_bit_identical_to_kvcache(tiny_model, tokens, press):
    model = tiny_model("qwen3")
    toks = tokens(700)
    ours, ref = make_cache(model, press, context_len=700), [KVCache() for _ in model.layers]
    for i in range(0, 700, 200):
        a = model(toks[None, i : i + 200], cache=ours)
        b = model(toks[None, i : i + 200], cache=ref)
        assert mx.array_equal(a, b).item()
    compress(ours)
    for _ in range(5):
        y = mx.argmax(b[:, -1:, :], axis=-1)
        a, b = model(y, cache=ours), model(y, cache=ref)
        assert mx.array_equal(a, b).item()
    assert all(c.stored == c.offset == 705 for c in ours)


@pytest.mark.parametrize("make", [NestedKVPress, KeyDiffPress, KnormPress, StreamingLLMPress, RandomPress])
def test_3000_tokens_budget_256_chunk_512_never_holds_more_than_budget_plus_chunk(tiny_model, tokens, make):
    model = tiny_model("llama", n_layers=2)
    toks = tokens(3000)
    cache = make_cache(model, make(budget=256, prefill="streaming"), context_len=3000)

    def check(seen):
        for c in cache:
            assert c.offset == seen  # true positions, whatever was evicted
            assert c.stored <= 256 + 512 and c.keys.shape[2] <= 256 + 512  # rows and resident buffer
            assert c.nbytes <= (256 + 512) * 2 * 16 * 4 * 2

    feed(model, cache, toks, 512, check)
    assert [c.stored for c in cache] == [256 + (3000 - 2560)] * 2  # evicted before the last chunk
    assert peak_kv_bytes(cache) == [768 * 2 * 16 * 4 * 2] * 2
    compress(cache)
    for c, s in zip(cache, layer_stats(cache)):
        assert (c.stored, c.offset, c.context_len) == (256, 3000, 3000)
        assert np.array(c.kept).tolist() == [[256, 256]] and s.tokens_seen == 3000
    # decode continues at the true position
    logits = model(tokens(3, seed=1)[None], cache=cache)
    assert cache[0].offset == 3003 and cache[0].stored == 259 and bool(mx.all(mx.isfinite(logits)).item())


def test_sinks_survive_and_rows_ascend_after_streaming(tiny_model, tokens):
    model = tiny_model("llama")
    toks = tokens(900)
    cache = make_cache(model, StreamingLLMPress(budget=20, prefill="streaming"), context_len=900)
    feed(model, cache, toks, 128)
    compress(cache)
    ref = [KVCache() for _ in model.layers]
    feed(model, ref, toks, 128)
    positions = mx.array([0, 1, 2, 3, *range(900 - 16, 900)])
    for c, r in zip(cache, ref):
        # layer 0's keys depend only on token and position: evictions elsewhere cannot change them
        if c is cache[0]:
            assert mx.array_equal(c.keys, r.keys[..., positions, :]).item()
        assert c.stored == 20


@pytest.mark.parametrize("head_budget", ["uniform", "adaptive"])
@pytest.mark.parametrize("make", [NestedKVPress, KeyDiffPress, KnormPress, RandomPress])
def test_one_chunk_larger_than_the_document_equals_whole_compression(tiny_model, tokens, make, head_budget):
    model = tiny_model("qwen2")
    toks = tokens(600)
    press = make(compression_ratio=0.75, head_budget=head_budget)
    whole, stream = make_cache(model, press), make_cache(model, streaming(press), context_len=600)
    a = feed(model, whole, toks, 1024)
    b = feed(model, stream, toks, 1024)
    assert mx.array_equal(a, b).item()  # nothing evicted while prefilling: the same outputs
    compress(whole)
    compress(stream)
    for w, s in zip(whole, stream):
        assert mx.array_equal(w.kept, s.kept).item() and w.offset == s.offset == 600
        for x, y in zip(w.padded()[:2], s.padded()[:2]):
            assert mx.array_equal(x, y).item()
    y = mx.argmax(a[:, -1:, :], axis=-1)
    assert mx.array_equal(model(y, cache=whole), model(y, cache=stream)).item()


def test_ratio_budget_needs_the_document_length(tiny_model, tokens):
    model = tiny_model("llama")
    cache = make_cache(model, KeyDiffPress(compression_ratio=0.5, prefill="streaming"))
    with pytest.raises(ValueError, match="context_len=N"):
        model(tokens(64)[None], cache=cache)
    with pytest.raises(ValueError, match="context_len"):
        make_cache(model, KeyDiffPress(compression_ratio=0.5, prefill="streaming"), context_len=0)
    cache = make_cache(model, KeyDiffPress(compression_ratio=0.5, prefill="streaming"), context_len=100)
    model(tokens(64)[None], cache=cache)
    with pytest.raises(ValueError, match="context_len=100 was planned but 128"):
        model(tokens(64)[None], cache=cache)


def test_ratio_budget_is_a_share_of_the_planned_length(tiny_model, tokens):
    model = tiny_model("llama")
    cache = make_cache(model, NestedKVPress(compression_ratio=0.75, prefill="streaming"), context_len=1000)
    stored = []
    feed(model, cache, tokens(1000), 256, lambda seen: stored.append(cache[0].stored))
    assert stored == [256, 250 + 256, 250 + 256, 250 + 232]  # 1 - r of the whole 1000, from the first eviction
    compress(cache)
    assert all(c.stored == 250 and c.offset == 1000 for c in cache)


def test_adaptive_streaming_bound_and_unpadded_result(tiny_model, tokens):
    model = tiny_model("llama")
    H, keep, chunk = 2, 250, 256
    cache = make_cache(model, NestedKVPress(compression_ratio=0.75, head_budget="adaptive", prefill="streaming"),
                       context_len=1000)

    def check(seen):
        for c in cache:
            real = c.stored * H if c.kept is None else int(c.kept.sum().item()) + (c.stored - c.n_ctx_rows) * H
            assert real <= H * (keep + chunk)  # the layer's real rows: budget + chunk per head on average
            assert c.nbytes <= H * (keep + chunk) * 16 * 4 * 2  # and what is allocated: ragged heads unpadded
            if seen > chunk:  # per-head between evictions (dense when the heads happen to keep equal counts)
                assert c.flat_keys is not None or len(set(np.array(c.kept)[0].tolist())) == 1
                layouts.append(c.flat_keys is not None)

    layouts = []
    feed(model, cache, tokens(1000), chunk, check)
    assert any(layouts)
    compress(cache)
    for c, s in zip(cache, layer_stats(cache)):
        assert int(c.kept.sum().item()) == H * keep
        assert [k.shape[2] for k in c.head_keys] == np.array(c.kept)[0].tolist()  # unpadded, per head
        assert s.bytes_resident == s.bytes_kept and s.kept_min < s.kept_max


def _numpy_anchors(keys, seen, window, block):
    """Reference: the running global sum, and the block/window cosine of every position < seen."""
    k = np.array(keys, dtype=np.float64)[..., :seen, :]
    u = k / np.maximum(np.linalg.norm(k, axis=-1, keepdims=True), 1e-6)
    g = u.sum(axis=2)
    cos_e = np.zeros(u.shape[:3])
    cos_c = np.zeros(u.shape[:3])
    for i in range(seen):
        start = (i // block) * block
        bsum = u[:, :, start : min(start + block, seen)].sum(axis=2)  # the block so far (complete or not)
        wsum = u[:, :, max(0, i - window + 1) : i + 1].sum(axis=2)
        cos_e[..., i] = (u[:, :, i] * bsum).sum(-1) / np.linalg.norm(bsum, axis=-1)
        cos_c[..., i] = (u[:, :, i] * wsum).sum(-1) / np.linalg.norm(wsum, axis=-1)
    return g, cos_e, cos_c


def test_streaming_nestedkv_anchors_equal_a_numpy_reference():
    rng = np.random.default_rng(0)
    N, H, D = 1500, 2, 16
    keys = mx.array((rng.standard_normal((1, H, N, D)) + 1.5 * rng.standard_normal(D)).astype(np.float32))
    press = NestedKVPress(budget=100, prefill="streaming", unrotate=False)  # raw keys, no rope
    c = NestedKVCache(press, context_len=N)
    for start in (0, 300, 700, 1000):  # uneven chunks, straddling blocks of 128
        stop = {0: 300, 300: 700, 700: 1000, 1000: 1200}[start]
        c.update_and_fetch(keys[..., start:stop, :], keys[..., start:stop, :])
        s = c.stream
        g, cos_e, cos_c = _numpy_anchors(keys, stop, 64, block_size(N))
        np.testing.assert_allclose(np.array(s.scorer.g_sum)[:, :, 0], g, rtol=1e-5, atol=1e-4)
        pos = np.array(s.rows["pos"])
        assert pos.shape[2] == c.stored and (np.diff(pos, axis=2) > 0).all()
        for h in range(H):
            p = pos[0, h]
            np.testing.assert_allclose(np.array(s.rows["cos_e"])[0, h], cos_e[0, h, p], atol=1e-5)
            np.testing.assert_allclose(np.array(s.rows["cos_c"])[0, h], cos_c[0, h, p], atol=1e-5)
        # the stored rows are the keys at those positions
        want = np.array(keys)[0][np.arange(H)[:, None], pos[0]]
        np.testing.assert_array_equal(np.array(c.keys[0, :, : c.stored]), want)
    assert c.stream.evicted and c.offset == 1200


def test_streaming_scores_equal_whole_scores_when_nothing_was_evicted():
    rng = np.random.default_rng(1)
    keys = mx.array((rng.standard_normal((1, 3, 700, 16)) + rng.standard_normal(16)).astype(np.float32))
    press = NestedKVPress(compression_ratio=0.5, unrotate=False)
    s = StreamState(press, 700)
    for i in range(0, 700, 160):
        s.append(s.observe(keys[..., i : i + 160, :]))
    want = press.score(keys)
    np.testing.assert_allclose(np.array(s.scores(keys, None)), np.array(want), atol=1e-5)
    # padded rows change nothing for the real rows
    pad = mx.concatenate([keys, mx.zeros((1, 3, 40, 16))], axis=2)
    for k in list(s.rows):
        s.rows[k] = mx.concatenate([s.rows[k], mx.zeros((1, 3, 40), s.rows[k].dtype)], axis=2)
    valid = mx.arange(740)[None, None, :] < 700
    got = s.scores(pad, mx.broadcast_to(valid, (1, 3, 740)))
    np.testing.assert_allclose(np.array(got[..., :700]), np.array(want), atol=1e-5)
    assert bool(mx.all(got[..., 700:] == -mx.inf).item())


@pytest.mark.parametrize("head_budget", ["uniform", "adaptive"])
def test_save_load_in_the_middle_of_a_streaming_prefill(tiny_model, tokens, tmp_path, head_budget):
    model = tiny_model("llama")
    toks = tokens(1200)
    press = NestedKVPress(budget=100, prefill="streaming", head_budget=head_budget)
    cache = make_cache(model, press, context_len=1200)
    feed(model, cache, toks[:600], 200)
    assert all(c.stream.evicted for c in cache)
    path = str(tmp_path / "mid.safetensors")
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path)  # with the model's rope: unrotated scoring goes on
    for caches in (cache, loaded):
        feed(model, caches, toks[600:], 200)
        compress(caches)
    for a, b in zip(cache, loaded):
        assert b.press == press and b.planned_len == 1200 and b.offset == 1200
        assert mx.array_equal(a.kept, b.kept).item()
        for x, y in zip(a.padded()[:2], b.padded()[:2]):
            assert mx.array_equal(x, y).item()
    q = tokens(3, seed=5)[None]
    assert mx.array_equal(model(q, cache=cache), model(q, cache=loaded)).item()


def test_streaming_inside_mlx_lm_generate(tiny_model, tokens):
    from mlx_lm import generate

    from test_cache import ByteTokenizer

    model = tiny_model("llama")
    prompt = tokens(900)
    press = NestedKVPress(compression_ratio=0.75, head_budget="adaptive", prefill="streaming")
    cache = make_cache(model, press, context_len=900)
    generate(model, ByteTokenizer(), prompt.tolist(), max_tokens=6, prompt_cache=cache, prefill_step_size=128)
    for c in cache:
        # the last prompt token is generate's first single-token step: it triggers the final compression
        assert c.compressed and c.context_len == 899 and int(c.kept.sum().item()) == 2 * 225
        assert c.appended == c.offset - 899 >= 6
