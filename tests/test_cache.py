"""The cache contract of design.md, one test (or a few) per line, on tiny random mlx-lm models."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import generate, stream_generate
from mlx_lm.models.cache import KVCache, load_prompt_cache, save_prompt_cache, trim_prompt_cache

import nestedkv.attention as nkv_attention
from nestedkv.layouts import GROWTH
from nestedkv import (
    KeyDiffPress,
    KnormPress,
    NestedKVCache,
    NestedKVPress,
    NoPress,
    StreamingLLMPress,
    clone,
    compress,
    layer_stats,
    make_cache,
    peak_kv_bytes,
    reset_peak,
    stack,
)
from tiny import feed as prefill


def greedy(logits):
    return mx.argmax(logits[:, -1:, :], axis=-1)


def full_keys(model, toks, chunk=512):
    """Per-layer keys of the whole context from mlx-lm's own cache (what compress must score)."""
    ref = [KVCache() for _ in model.layers]
    prefill(model, ref, toks, chunk)
    return [c.state[0][..., : c.offset, :] for c in ref]


def synthetic_cache(press, N, chunk=256, H=2, D=16, seed=0, planted=()):
    """A NestedKVCache fed keys [1,H,N,D] chunk by chunk, bypassing any model."""
    rng = np.random.default_rng(seed)
    bias = rng.standard_normal(D)
    keys = rng.standard_normal((1, H, N, D)) + 2.0 * bias
    for p in planted:
        keys[:, :, p] = -3.0 * bias + 0.1 * rng.standard_normal(D)
    keys = mx.array(keys.astype(np.float32))
    values = mx.array(rng.standard_normal((1, H, N, D)).astype(np.float32))
    c = NestedKVCache(press)
    for i in range(0, N, chunk):
        c.update_and_fetch(keys[..., i : i + chunk, :], values[..., i : i + chunk, :])
    return c, keys, values


# -- (1) offset vs stored rows ----------------------------------------------------------------
def test_offset_counts_positions_while_rows_are_the_budget(tiny_model, tokens):
    model = tiny_model("llama")
    toks = tokens(1000)
    cache = make_cache(model, NestedKVPress(budget=128))
    prefill(model, cache, toks, 256)
    assert all(c.offset == 1000 and c.stored == 1000 for c in cache)
    compress(cache)
    for c in cache:
        assert (c.offset, c.stored, c.size(), c.keys.shape[2], c.context_len) == (1000, 128, 128, 128, 1000)
    # Appended tokens take RoPE positions 1000.. (from offset, not from the row count): layer 0's
    # keys depend only on token and position, so they must equal an uncompressed cache's.
    ref = [KVCache() for _ in model.layers]
    prefill(model, ref, toks, 256)
    q = tokens(7, seed=1)
    model(q[None], cache=cache)
    model(q[None], cache=ref)
    assert cache[0].offset == ref[0].offset == 1007 and cache[0].stored == 135
    got = cache[0].keys[..., 128:135, :]
    want = ref[0].keys[..., 1000:1007, :]
    assert mx.allclose(got, want, atol=1e-6).item()


# -- (2) r = 0 is bit-identical to mlx-lm's KVCache ------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize(
    "press", [NestedKVPress(compression_ratio=0.0), NoPress(), None], ids=["nestedkv_r0", "no_press", "none"]
)
def test_r0_is_bit_identical_to_kvcache(tiny_model, tokens, arch, press):
    model = tiny_model(arch)
    toks = tokens(700)
    ours, ref = make_cache(model, press), [KVCache() for _ in model.layers]
    for i in range(0, 700, 200):  # chunks straddle the 256-row allocation steps
        a = model(toks[None, i : i + 200], cache=ours)
        b = model(toks[None, i : i + 200], cache=ref)
        assert mx.array_equal(a, b).item()
    compress(ours)
    assert all(c.compressed and c.stored == 700 for c in ours)
    for _ in range(10):
        y = greedy(b)
        a, b = model(y, cache=ours), model(y, cache=ref)
        assert mx.array_equal(a, b).item()
    assert [c.offset for c in ours] == [c.offset for c in ref] == [710] * len(ref)


# -- (3) compress scores the whole context ------------------------------------------------------
def test_key_planted_in_last_chunk_is_kept():
    planted = [1030, 1045, 1060, 1075, 1090]
    press = NestedKVPress(budget=64, unrotate=False)  # synthetic keys carry no rotation
    c, keys, _ = synthetic_cache(press, 1100, chunk=256, planted=planted)
    c.compress()
    kept = np.array(press.select(keys).indices)
    assert np.isin(planted, kept[0, 0]).all() and np.isin(planted, kept[0, 1]).all()
    # and the stored rows are those keys, in that order
    want = mx.take_along_axis(keys, mx.array(kept)[..., None], axis=2)
    assert mx.array_equal(c.keys[..., : c.stored, :], want).item()
    assert c.context_len == 1100 and c.offset == 1100


@pytest.mark.slow  # a 3000-token prefill: seconds on two cores
def test_chunked_prefill_3000_in_512_chunks_keeps_256_rows_per_head(tiny_model, tokens):
    model = tiny_model("llama", n_layers=3)
    toks = tokens(3000)
    press = NestedKVPress(budget=256)
    cache = make_cache(model, press)
    prefill(model, cache, toks, 512)
    compress(cache)
    ref_keys = full_keys(model, toks, 512)
    for c, k in zip(cache, ref_keys):
        assert c.offset == 3000 and c.stored == 256 and c.keys.shape == (1, 2, 256, 16)
        assert np.array(c.kept).tolist() == [[256, 256]]
        # exactly the rows NestedKV picks from the keys of ALL 3000 positions
        idx = press.select(k, unrope=c.unrope).indices
        assert mx.array_equal(c.keys, mx.take_along_axis(k, idx[..., None], axis=2)).item()
    assert all(s.tokens_seen == 3000 for s in layer_stats(cache))


# -- (4) sinks survive, survivors ascending -------------------------------------------------------
def test_sinks_and_ascending_order_streaming(tiny_model, tokens):
    model = tiny_model("llama")
    toks = tokens(500)
    cache = make_cache(model, StreamingLLMPress(budget=16))
    prefill(model, cache, toks, 128)
    compress(cache)
    positions = mx.array([0, 1, 2, 3, *range(500 - 12, 500)])
    for c, k in zip(cache, full_keys(model, toks, 128)):
        assert mx.array_equal(c.keys, k[..., positions, :]).item()


def test_sinks_survive_with_the_lowest_scores():
    # Knorm keeps small norms; the sinks get huge norms, yet stay.
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((1, 2, 300, 8)).astype(np.float32)
    keys[:, :, :4] *= 1000.0
    keys = mx.array(keys)
    c = NestedKVCache(KnormPress(budget=20))
    c.update_and_fetch(keys, keys)
    c.compress()
    assert mx.array_equal(c.keys[..., :4, :], keys[..., :4, :]).item()
    # survivors ascending: the kept rows appear in the original keys in increasing positions
    flat = np.array(keys[0, 0])
    pos = [int(np.flatnonzero((flat == row).all(-1))[0]) for row in np.array(c.keys[0, 0])]
    assert pos[:4] == [0, 1, 2, 3] and pos == sorted(pos) and len(set(pos)) == 20


@pytest.mark.parametrize("head_budget", ["uniform", "adaptive"])
def test_nestedkv_rows_are_the_selected_positions_in_order(head_budget):
    press = NestedKVPress(compression_ratio=0.75, head_budget=head_budget, unrotate=False)
    c, keys, values = synthetic_cache(press, 700, chunk=300, H=4)
    c.compress()
    sel = press.select(keys)
    idx = np.array(sel.indices)
    valid = np.ones(idx.shape, bool) if sel.valid is None else np.array(sel.valid)
    pk, pv, _ = c.padded()
    for h in range(4):
        real = idx[0, h][valid[0, h]]
        assert real[:4].tolist() == [0, 1, 2, 3] and np.all(np.diff(real) > 0)
        n = len(real)
        assert np.array_equal(np.array(pk[0, h, :n]), np.array(keys)[0, h, real])
        assert np.array_equal(np.array(pv[0, h, :n]), np.array(values)[0, h, real])
        if head_budget == "adaptive":  # stored without padding: exactly its own rows
            assert c.head_keys[h].shape == c.head_values[h].shape == (1, 1, n, 16)
    assert int(np.array(c.kept).sum()) == 4 * 175


# -- (5) appended tokens, trim/rewind, buffer growth ----------------------------------------------
@pytest.mark.parametrize("head_budget", ["uniform", "adaptive"])
def test_question_and_decode_never_evicted_and_rewind(tiny_model, tokens, head_budget):
    model = tiny_model("llama")
    cache = make_cache(model, NestedKVPress(budget=100, head_budget=head_budget))
    prefill(model, cache, tokens(800), 256)
    compress(cache)
    fresh = clone(cache)
    rows = [c.n_ctx_rows for c in cache]
    ctx = [tuple(x[..., : c.n_ctx_rows, :] for x in c.padded()[:2]) for c in cache]

    logits = model(tokens(20, seed=1)[None], cache=cache)
    for _ in range(5):
        logits = model(greedy(logits), cache=cache)
    mx.eval(logits)
    compress(cache)  # a second call must not touch anything
    for c, r, (k, v) in zip(cache, rows, ctx):
        assert c.stored == r + 25 and c.offset == 825 and c.appended == 25
        pk, pv, _ = c.padded()
        assert mx.array_equal(pk[..., :r, :], k).item() and mx.array_equal(pv[..., :r, :], v).item()

    assert cache[0].trim(10) == 10 and cache[0].stored == rows[0] + 15
    assert cache[0].trim(1000) == 15 and (cache[0].stored, cache[0].offset) == (rows[0], 800)
    assert cache[0].rewind() == 0
    assert trim_prompt_cache(cache[1:], 1000) == 25  # mlx-lm's helper stops at the context too
    assert [c.rewind() for c in cache] == [0] * len(cache)
    assert all(c.offset == 800 and c.appended == 0 for c in cache)

    q2 = tokens(20, seed=2)[None]
    a, b = model(q2, cache=cache), model(q2, cache=fresh)
    assert mx.array_equal(a, b).item()
    for _ in range(3):
        y = greedy(a)
        a, b = model(y, cache=cache), model(y, cache=fresh)
        assert mx.array_equal(a, b).item()


def test_appends_grow_the_buffer_in_steps_of_256_rows():
    c, _, _ = synthetic_cache(NestedKVPress(budget=100, unrotate=False), 1000)
    c.compress()
    assert c.keys.shape[2] == 100
    shapes = [c.keys.shape[2]]
    rng = np.random.default_rng(1)
    for _ in range(600):
        k = mx.array(rng.standard_normal((1, 2, 1, 16)).astype(np.float32))
        c.update_and_fetch(k, k)
        shapes.append(c.keys.shape[2])
    growth = [b - a for a, b in zip(shapes, shapes[1:]) if b != a]
    assert growth == [256, 256, 256] and c.stored == 700
    c.rewind()
    for _ in range(300):  # reuses the space it already has
        c.update_and_fetch(k, k)
    assert c.keys.shape[2] == shapes[-1] and c.stored == 400


# -- (6) dtype kept ----------------------------------------------------------------------------
@pytest.mark.parametrize("head_budget", ["uniform", "adaptive"])
def test_bf16_model_cache_stays_bf16(tiny_model, tokens, head_budget):
    model = tiny_model("llama", dtype=mx.bfloat16)
    press = NestedKVPress(compression_ratio=0.75, head_budget=head_budget)
    cache = make_cache(model, press)
    prefill(model, cache, tokens(400), 128)
    assert press.score(cache[0].keys[..., :400, :]).dtype == mx.float32
    compress(cache)
    logits = model(tokens(3)[None], cache=cache)
    assert bool(mx.all(mx.isfinite(logits)).item())
    for c, s in zip(cache, layer_stats(cache)):
        k, v, _ = c.padded()
        assert k.dtype == v.dtype == mx.bfloat16
        assert s.dtype == "bfloat16" and s.kept_mean == 100


# -- (7) save / load ---------------------------------------------------------------------------
@pytest.mark.parametrize("head_budget", ["uniform", "adaptive"])
def test_save_load_roundtrip_of_a_compressed_cache(tiny_model, tokens, tmp_path, head_budget):
    model = tiny_model("llama")
    cache = make_cache(model, NestedKVPress(budget=60, head_budget=head_budget))
    prefill(model, cache, tokens(600), 256)
    compress(cache)
    model(tokens(9, seed=1)[None], cache=cache)  # a question already appended
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path)
    assert all(type(c) is NestedKVCache for c in loaded)
    for a, b in zip(cache, loaded):
        assert (a.offset, a.stored, a.context_len, a.n_ctx_rows, a.press) == (
            b.offset, b.stored, b.context_len, b.n_ctx_rows, b.press)
        assert mx.array_equal(a.kept, b.kept).item()
        assert a.valid is None and b.valid is None and a.head_rows == b.head_rows
        for x, y in zip(a.padded()[:2], b.padded()[:2]):
            assert mx.array_equal(x, y).item()
    if head_budget == "adaptive":  # stored per head, without padding, and loaded that way
        assert any(c.head_keys is not None for c in loaded)
        assert [c.nbytes for c in loaded] == [s.bytes_kept for s in layer_stats(loaded)]  # rows only, no free space
    y = tokens(1, seed=3)[None]
    assert mx.array_equal(model(y, cache=cache), model(y, cache=loaded)).item()
    for caches in (cache, loaded):
        for c in caches:
            c.rewind()
    q = tokens(5, seed=4)[None]
    assert mx.array_equal(model(q, cache=cache), model(q, cache=loaded)).item()


def test_loaded_adaptive_cache_masks_padding_without_make_cache(tiny_model, tokens, tmp_path):
    model = tiny_model("llama")
    cache = make_cache(model, NestedKVPress(budget=40, head_budget="adaptive"))
    prefill(model, cache, tokens(400), 200)
    compress(cache)
    assert any(c.head_keys is not None for c in cache)
    path = str(tmp_path / "adaptive.safetensors")
    save_prompt_cache(path, cache)
    q = tokens(3, seed=1)[None]
    want = model(q, cache=cache)
    # As in a fresh process that loads the model and the cache but never calls make_cache: not routed yet.
    fresh = tiny_model("llama")
    assert type(fresh.layers[0].self_attn) is not type(model.layers[0].self_attn)
    got = fresh(q, cache=load_prompt_cache(path))
    assert mx.array_equal(got, want).item()


def test_save_load_mid_prefill_then_compress(tiny_model, tokens, tmp_path):
    model = tiny_model("qwen3")
    toks = tokens(700)
    cache = make_cache(model, KeyDiffPress(budget=50))
    prefill(model, cache, toks[:400], 200)
    path = str(tmp_path / "mid.safetensors")
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path)
    for caches in (cache, loaded):
        prefill(model, caches, toks[400:], 200)
        compress(caches)
    for a, b in zip(cache, loaded):
        assert b.press == KeyDiffPress(budget=50)
        assert mx.array_equal(a.keys, b.keys).item() and b.offset == 700


# -- (8) merge -------------------------------------------------------------------------------
def test_merge_raises_a_clear_error():
    with pytest.raises(ValueError, match="cannot be merged.*batch"):
        NestedKVCache.merge([NestedKVCache(), NestedKVCache()])
    with pytest.raises(ValueError, match="kv_bits"):
        NestedKVCache().to_quantized()


# -- (9) layers with different lengths --------------------------------------------------------
def test_layers_with_different_stored_lengths(tiny_model, tokens):
    model = tiny_model("llama", n_layers=3)
    cache = make_cache(model, NestedKVPress(budget=120))
    cache[1].press = KeyDiffPress(budget=40)
    cache[2].press = NoPress()
    prefill(model, cache, tokens(500), 128)
    compress(cache)
    assert [c.stored for c in cache] == [120, 40, 500]
    seq = clone(cache)
    q = tokens(6, seed=1)
    # The "causal" mask must align to the end of each layer's own keys: a 6-token chunk must
    # agree with feeding the same tokens one by one (no mask at all).
    chunked = model(q[None], cache=cache)[:, -1]
    for t in range(6):
        one = model(q[None, t : t + 1], cache=seq)
    assert mx.allclose(chunked, one[:, -1], atol=1e-5).item()
    assert [c.stored for c in cache] == [c.stored for c in seq] == [126, 46, 506]


# -- (10) adaptive: per-head masks and accounting -----------------------------------------------
def _capture_attention(monkeypatch):
    calls = []
    orig = nkv_attention._attend  # what every layout ends in, with its final mask

    def spy(queries, keys, values, cache, scale, mask, sinks=None):
        out = orig(queries, keys, values, cache, scale, mask, sinks)
        calls.append((cache, queries, keys, values, scale, out))
        return out

    monkeypatch.setattr(nkv_attention, "_attend", spy)
    return calls


def _reference_attention(cache, queries, keys, values, scale):
    """Softmax attention per query head over only the rows its KV head really kept."""
    q, k, v = (np.array(x, dtype=np.float64) for x in (queries, keys, values))
    B, Hq, L, _ = q.shape
    H, S = k.shape[1], k.shape[2]
    valid = np.array(cache.valid)
    out = np.zeros(q.shape[:3] + (v.shape[-1],))
    for b in range(B):
        for h in range(Hq):
            g = h // (Hq // H)
            real = np.concatenate([valid[b, g], np.ones(S - valid.shape[2], bool)])
            for i in range(L):
                rows = np.flatnonzero(real[: S - L + i + 1])  # causal, in row space
                logits = k[b, g, rows] @ q[b, h, i] * scale
                p = np.exp(logits - logits.max())
                out[b, h, i] = (p / p.sum()) @ v[b, g, rows]
    return out


def test_adaptive_attention_equals_reference_over_kept_rows(tiny_model, tokens, monkeypatch):
    model = tiny_model("llama")
    cache = make_cache(model, NestedKVPress(budget=40, head_budget="adaptive"))
    prefill(model, cache, tokens(400), 128)
    compress(cache)
    ragged = [c for c in cache if c.head_keys is not None]
    assert ragged, "the random model should give heads different counts"
    padded = stack([cache])  # the padded-and-masked layout of the same rows
    assert all(p.valid is not None for p in padded)
    calls = _capture_attention(monkeypatch)
    q = tokens(3, seed=1)[None]
    want = model(q, cache=padded)  # a question: causal mask
    y = greedy(want)
    want_step = model(y, cache=padded)  # a decode step: no mask
    checked = 0
    for c, q_, k, v, scale, out in calls:
        if c is None or c.valid is None:
            continue
        assert not np.array(c.valid).all()
        ref = _reference_attention(c, q_, k, v, scale)
        np.testing.assert_allclose(np.array(out), ref, atol=1e-5)
        checked += 1
    assert checked == 2 * len(padded)
    # Per-head (unpadded) attention gives the padded path's outputs.
    got = model(q, cache=cache)
    got_step = model(y, cache=cache)
    assert float(mx.max(mx.abs(got - want)).item()) <= 1e-5
    assert float(mx.max(mx.abs(got_step - want_step)).item()) <= 1e-5


def test_adaptive_padded_rows_get_zero_weight(tiny_model, tokens):
    model = tiny_model("qwen2")
    cache = make_cache(model, NestedKVPress(compression_ratio=0.9, head_budget="adaptive"))
    prefill(model, cache, tokens(500), 256)
    compress(cache)
    clean, poisoned = stack([cache]), stack([cache])
    n_padded = 0
    for c in poisoned:
        n_padded += int((~c.valid).sum().item())
        keep = c.valid[..., None]
        c.keys = mx.where(keep, c.keys, 30.0).astype(c.keys.dtype)
        c.values = mx.where(keep, c.values, 1e4).astype(c.values.dtype)
    assert n_padded > 0
    q = tokens(4, seed=1)[None]
    a, b, r = model(q, cache=clean), model(q, cache=poisoned), model(q, cache=cache)
    assert mx.allclose(a, b, atol=1e-6).item() and mx.allclose(a, r, atol=1e-5).item()
    y = greedy(a)
    a, b, r = model(y, cache=clean), model(y, cache=poisoned), model(y, cache=cache)
    assert mx.allclose(a, b, atol=1e-6).item() and mx.allclose(a, r, atol=1e-5).item()


def test_memory_accounting(tiny_model, tokens):
    model = tiny_model("llama")
    toks = tokens(600)
    row = 2 * 16 * 4 * 2  # heads * head_dim * fp32 bytes * (keys + values)
    for head_budget in ("uniform", "adaptive"):
        cache = make_cache(model, NestedKVPress(compression_ratio=0.75, head_budget=head_budget))
        prefill(model, cache, toks, 256)
        before = layer_stats(cache)
        assert all(s.bytes_kept == s.bytes_full == 600 * row for s in before)
        compress(cache)
        stats = layer_stats(cache)
        for s in stats:
            assert (s.layer, s.n_kv_heads, s.head_dim, s.tokens_seen) == (s.layer, 2, 16, 600)
            assert s.bytes_full == 600 * row and s.bytes_kept == 150 * row
            assert s.kept_mean == 150 and s.kept_fraction == pytest.approx(0.25)
        if head_budget == "uniform":
            assert all(s.kept_min == s.kept_max == 150 for s in stats)
            assert all(abs(s.bytes_resident - s.bytes_kept) <= 0.05 * s.bytes_kept for s in stats)
        else:
            assert any(s.kept_min < s.kept_max for s in stats)
            # no padding: each head holds exactly its own rows
            assert all(s.bytes_resident == s.bytes_kept for s in stats)
            for c in cache:
                assert [k.shape[2] for k in c.head_keys] == np.array(c.kept)[0].tolist()
        model(tokens(10, seed=1)[None], cache=cache)
        after = layer_stats(cache)
        assert all(s.bytes_kept == 160 * row and s.bytes_full == 610 * row for s in after)
        # appends grow every head by one step: KVCache's 256 rows, or a per-head region's 64 (attention reads the
        # free rows of every region, masked): 150 + the step rows per head on average
        step = 256 if head_budget == "uniform" else GROWTH
        assert all(s.bytes_resident == (150 + step) * row for s in after)


# -- mlx-lm integration, clone, errors, architectures -------------------------------------------
class ByteTokenizer:
    """Just enough of a Hugging Face tokenizer for mlx-lm's TokenizerWrapper."""

    eos_token_id = None
    bos_token = None
    chat_template = None

    def get_vocab(self):
        return {f"<{i}>": i for i in range(256)}

    def encode(self, text, add_special_tokens=True):
        return list(text.encode("utf-8"))

    def decode(self, ids, **kwargs):
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, **kwargs):
        raise NotImplementedError


@pytest.mark.parametrize("how", ["generate", "stream_generate"])
def test_inside_mlx_lm_generate(tiny_model, tokens, how):
    model = tiny_model("llama")
    cache = make_cache(model, NestedKVPress(budget=64))
    prompt = tokens(600)
    kwargs = dict(max_tokens=8, prompt_cache=cache, prefill_step_size=128)
    if how == "generate":
        generate(model, ByteTokenizer(), prompt.tolist(), **kwargs)
    else:
        assert list(stream_generate(model, ByteTokenizer(), prompt, **kwargs))
    for c in cache:
        assert c.compressed and c.context_len == 599  # the last prompt token is the first 1-token step
        assert c.n_ctx_rows == 64 and np.array(c.kept).tolist() == [[64, 64]]
        assert c.appended == c.offset - 599 >= 8


def test_clone_gives_independent_copies(tiny_model, tokens):
    model = tiny_model("llama")
    cache = make_cache(model, NestedKVPress(budget=50))
    prefill(model, cache, tokens(400), 128)
    snap = [(c.keys[..., :400, :], c.stored) for c in cache]
    nk, kd = clone(cache, NestedKVPress(budget=50)), clone(cache, KeyDiffPress(budget=50))
    compress(nk)
    compress(kd)
    model(tokens(5)[None], cache=kd)
    for c, (k, stored) in zip(cache, snap):
        assert not c.compressed and c.stored == stored == 400 and c.offset == 400
        assert mx.array_equal(c.keys[..., :400, :], k).item()
    assert all(c.stored == 50 for c in nk) and all(c.stored == 55 for c in kd)
    assert any(not mx.array_equal(a.keys, b.keys[..., :50, :]).item() for a, b in zip(nk, kd))
    # writing into the original leaves a clone alone
    before = [c.keys[..., :50, :] for c in nk]
    prefill(model, cache, tokens(100, seed=1), 100)
    assert all(mx.array_equal(c.keys[..., :50, :], k).item() for c, k in zip(nk, before))
    with pytest.raises(ValueError, match="uncompressed"):
        clone(nk, KeyDiffPress(budget=10))


def test_compress_on_empty_cache_raises(tiny_model):
    with pytest.raises(ValueError, match="empty"):
        NestedKVCache(NestedKVPress(budget=8)).compress()
    with pytest.raises(ValueError, match="empty"):
        compress(make_cache(tiny_model("llama"), NestedKVPress(budget=8)))


def test_bad_arguments(tiny_model):
    model = tiny_model("llama")
    with pytest.raises(TypeError, match="press"):
        make_cache(model, "nestedkv")
    with pytest.raises(TypeError, match="make_cache"):
        compress([KVCache()])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("head_budget", ["uniform", "adaptive"])
def test_gqa_scores_kv_heads_on_every_arch(tiny_model, tokens, arch, head_budget):
    model = tiny_model(arch)
    assert model.args.num_attention_heads == 4 and model.args.num_key_value_heads == 2
    cache = make_cache(model, NestedKVPress(budget=32, head_budget=head_budget))
    logits = prefill(model, cache, tokens(300), 128)
    compress(cache)
    for c in cache:
        assert c.padded()[0].shape[:2] == (1, 2) and c.kept.shape == (1, 2)
        assert int(c.kept.sum().item()) == 64
        counts = np.array(c.kept)[0].tolist()
        if len(set(counts)) == 1:  # uniform, or an adaptive split that came out even: one dense block
            assert c.keys.shape == (1, 2, 32, 16)
        else:
            assert [k.shape[2] for k in c.head_keys] == counts
    for _ in range(3):
        logits = model(greedy(logits), cache=cache)
    assert bool(mx.all(mx.isfinite(logits)).item()) and cache[0].offset == 303


# -- peak K/V bytes ------------------------------------------------------------------------------
def test_peak_kv_bytes_per_layer_and_reset(tiny_model, tokens):
    model = tiny_model("llama")
    row = 2 * 16 * 4 * 2  # bytes of one row over both KV heads, keys + values, fp32
    cache = make_cache(model, NestedKVPress(budget=100))
    assert peak_kv_bytes(cache) == [0, 0]
    prefill(model, cache, tokens(1000), 256)
    assert peak_kv_bytes(cache) == [1024 * row] * 2  # four 256-row growth steps
    compress(cache)
    assert [c.nbytes for c in cache] == [100 * row] * 2 and peak_kv_bytes(cache) == [1024 * row] * 2
    reset_peak(cache)
    assert peak_kv_bytes(cache) == [100 * row] * 2
    model(tokens(10, seed=1)[None], cache=cache)
    assert peak_kv_bytes(cache) == [356 * row] * 2
    for c in cache:
        c.rewind()
    reset_peak(cache)
    assert peak_kv_bytes(cache) == [356 * row] * 2  # the buffer stays allocated for the next question
    cache[0].reset_peak()
    assert cache[0].peak_nbytes == cache[0].nbytes == 356 * row
