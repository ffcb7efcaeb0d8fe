"""Adaptive (per-head) budgets at decode: Metal's path gathers each KV head's region into one attention call; the
CPU's attends each head's rows in place and appends by slice updates; the benchmark that times them."""

import mlx.core as mx
import numpy as np
import pytest

import nestedkv.attention as nkv_attention
from nestedkv import NestedKVPress, clone, compress, make_cache


def test_adaptive_decode_gathers_each_heads_rows_over_many_steps(tiny_model, tokens, monkeypatch):
    """A decode step on Metal's path gathers each KV head's region to the longest (one attention call): over 70
    steps, past a region's growth, its logits stay those of one call per KV head."""
    from nestedkv import _platform

    monkeypatch.setitem(_platform._state, "fast_path", False)
    model = tiny_model("llama", n_layers=2)
    cache = make_cache(model, NestedKVPress(compression_ratio=0.75, head_budget="adaptive"))
    model(tokens(300)[None], cache=cache)
    compress(cache)
    assert len(set(cache[0].layout.head_cap)) > 1  # regions of different lengths: padding to gather
    looped, one_call = clone(cache), nkv_attention.ONE_CALL_SCORES
    for i in range(70):
        step = tokens(1, seed=100 + i)[None]
        one = model(step, cache=cache)
        monkeypatch.setattr(nkv_attention, "ONE_CALL_SCORES", 0)  # one call per KV head
        per_head = model(step, cache=looped)
        monkeypatch.setattr(nkv_attention, "ONE_CALL_SCORES", one_call)
        np.testing.assert_allclose(np.array(one), np.array(per_head), atol=1e-5, rtol=1e-5)


real_setitem = mx.array.__setitem__


def test_adaptive_decode_on_the_cpu_attends_each_heads_rows_in_place(tiny_model, tokens, monkeypatch):
    """On the CPU fast path a decode step appends by slice updates and attends each KV head's rows where they
    lie (one call per KV head, no gather, no scatter); over 70 steps, past a region's growth, its logits stay
    those of Metal's path (one gathered call, one scatter)."""
    from nestedkv import _platform

    model = tiny_model("llama", n_layers=2)
    cache = make_cache(model, NestedKVPress(compression_ratio=0.75, head_budget="adaptive"))
    model(tokens(300)[None], cache=cache)
    compress(cache)
    gathered = clone(cache)
    calls, real = [], nkv_attention._attend
    monkeypatch.setattr(nkv_attention, "_attend", lambda *a, **k: (calls.append(a[1].shape[1]), real(*a, **k))[1])
    heads = cache[0].layout.batch_heads[1]
    for i in range(70):
        step = tokens(1, seed=100 + i)[None]
        monkeypatch.setitem(_platform._state, "fast_path", True)
        if i == 0:
            with monkeypatch.context() as m:
                m.setattr(mx, "take", lambda *a, **k: pytest.fail("a CPU decode step gathered rows"))
                m.setattr(mx.array, "__setitem__", lambda self, idx, v: pytest.fail("a CPU decode step scattered")
                          if any(isinstance(x, mx.array) for x in (idx if isinstance(idx, tuple) else (idx,)))
                          else real_setitem(self, idx, v))
                in_place = model(step, cache=cache)
                mx.eval(in_place)
            assert calls == [1] * (heads * len(model.layers))  # each call one KV head's rows
        else:
            in_place = model(step, cache=cache)
        monkeypatch.setitem(_platform._state, "fast_path", False)
        calls.clear()
        np.testing.assert_allclose(np.array(in_place), np.array(model(step, cache=gathered)), atol=1e-5, rtol=1e-5)
        assert len(calls) == len(model.layers)
        calls.clear()


def test_bench_kernels_decodes_the_configurations_in_turn(tmp_path, monkeypatch):
    """``nkv bench kernels`` decodes its configurations in alternating blocks (so drift moves them alike): each
    gets the steps asked, a speed, and its adaptive budgets' calls are counted on Metal's path (one a layer)."""
    from bench import kernels as bench
    from tiny import save_tiny_model_dir

    monkeypatch.setattr(bench, "DECODE_BLOCK", 4)
    turns, real = [], bench.mx.argmax
    monkeypatch.setattr(bench.mx, "argmax", lambda x, **k: (turns.append(x.shape), real(x, **k))[1])
    out = bench.bench_model(save_tiny_model_dir(tmp_path / "m"), 200, 10, chunk=64, random_tokens=True)
    configs = out["configs"]
    assert len(turns) == 1 + len(configs) * (1 + 10)  # the prefill's token, each warm-up step, 10 steps each
    assert all(r["decode_tokens_per_s"] > 0 for r in configs.values())
    assert configs["r=0.75 adaptive"]["attention_calls_per_layer_token"] == 1
    assert configs["r=0.75 adaptive"]["kept_over_full"]["mean"] == pytest.approx(0.25, abs=0.01)
