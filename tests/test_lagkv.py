"""LagKV (key-only): the score against a numpy reference written from the paper's formulas, the window kept,
and its place in the registry (the press contract test covers the rest)."""

import mlx.core as mx
import numpy as np
import pytest

from nestedkv import compress, make_cache
from nestedkv.press import PRESSES, compared_methods, get_press
from nestedkv.press.lagkv import WINDOW_SCORE, LagKVPress, lagkv_scores


def reference(k: np.ndarray, lag: int, sink: int) -> np.ndarray:
    B, H, N, D = k.shape
    out = np.full((B, H, N), WINDOW_SCORE)
    m = (N - sink) // lag
    for p in range(m - 1):
        cur = k[:, :, sink + p * lag : sink + (p + 1) * lag]
        nxt = k[:, :, sink + (p + 1) * lag : sink + (p + 2) * lag]
        lo, hi = nxt.min(axis=2, keepdims=True), nxt.max(axis=2, keepdims=True)
        sd = ((cur - lo) / np.maximum(hi - lo, 1e-6)).std(axis=-1)
        e = np.exp(sd - sd.max(axis=-1, keepdims=True))
        out[:, :, sink + p * lag : sink + (p + 1) * lag] = e / e.sum(axis=-1, keepdims=True)
    return out


@pytest.mark.parametrize("N,lag,sink", [(300, 32, 4), (256, 64, 0), (100, 64, 4), (517, 50, 4)])
def test_scores_match_the_paper_formulas(N, lag, sink):
    k = np.random.default_rng(N).standard_normal((1, 2, N, 16)).astype(np.float32)
    got = np.array(lagkv_scores(mx.array(k), lag, sink))
    np.testing.assert_allclose(got, reference(k, lag, sink), rtol=1e-5, atol=1e-6)


def test_the_window_and_sinks_survive():
    k = mx.array(np.random.default_rng(0).standard_normal((1, 2, 300, 16)).astype(np.float32))
    press = LagKVPress(budget=120, lag=32)
    sel = np.array(press.select(k).indices)[0]
    m = (300 - 4) // 32
    window = set(range(4 + (m - 1) * 32, 300))  # the last full partition and the remainder
    for h in range(2):
        assert set(range(4)) | window <= set(sel[h].tolist())


def test_a_key_that_stands_out_against_its_lag_reference_is_kept():
    rng = np.random.default_rng(1)
    k = (0.01 * rng.standard_normal((1, 1, 4 + 4 * 32, 8))).astype(np.float32)
    k[0, 0, 4 + 5, ::2] = 5.0  # one token of the first partition, far outside the next one's range
    s = np.array(lagkv_scores(mx.array(k), 32, 4))[0, 0]
    assert s[4:36].argmax() == 5


def test_registered_and_opt_in():
    assert PRESSES["lagkv"] is LagKVPress and "lagkv" not in compared_methods()
    with pytest.raises(ValueError, match="lagkv parameter lag"):
        get_press("lagkv", lag=0)


def test_compresses_a_model_cache(tiny_model, tokens):
    model = tiny_model("llama")
    cache = make_cache(model, LagKVPress(compression_ratio=0.5, lag=32))
    model(tokens(300)[None], cache=cache)
    compress(cache)
    assert all(c.stored == 150 for c in cache)
