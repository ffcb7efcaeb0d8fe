"""Scoring checked step by step against a plain float64 numpy reference of the spec (section 1)."""

import math

import mlx.core as mx
import numpy as np
import pytest

from nestedkv import scoring
from nestedkv.selection import select

PRIOR = np.array([0.4, 0.4, 0.2])


# -- reference, written from the spec: loops where the spec speaks per token ------------------
def ref_unit(k):
    return k / np.maximum(np.linalg.norm(k, axis=-1, keepdims=True), 1e-6)


def ref_cos(k_unit, anchor):
    return np.sum(k_unit * ref_unit(anchor), axis=-1)


def ref_minmax(x, axis=2):
    lo, hi = x.min(axis=axis, keepdims=True), x.max(axis=axis, keepdims=True)
    span = hi - lo
    return np.where(span > 1e-6, (x - lo) / np.where(span > 0, span, 1.0), 0.0)


def ref_anchors(k_unit, block=None, window=64):
    N = k_unit.shape[2]
    mu_s = k_unit.mean(axis=2, keepdims=True)
    b = block or int(np.clip(N // 32, 128, 256))
    mu_e = np.empty_like(k_unit)
    for start in range(0, N, b):
        mu_e[:, :, start : start + b] = k_unit[:, :, start : start + b].mean(axis=2, keepdims=True)
    mu_c = np.empty_like(k_unit)
    for i in range(N):
        mu_c[:, :, i] = k_unit[:, :, max(0, i - window + 1) : i + 1].mean(axis=2)
    return mu_s, mu_e, mu_c


def ref_scale_anomalies(keys, block=None):
    k = ref_unit(keys)
    mu_s, mu_e, mu_c = ref_anchors(k, block)
    raw = np.stack([-ref_cos(k, mu_s), -ref_cos(k, mu_e), -ref_cos(k, mu_c)], axis=-1)
    return ref_minmax(raw, axis=2)


def ref_gap(at):
    N = at.shape[2]
    q = max(1, -(-N // 10))  # ceil(0.1 N) without float rounding
    srt = np.sort(at, axis=2)
    return srt[:, :, N - q :].mean(axis=2) - srt[:, :, :q].mean(axis=2)


def ref_weights(gap):
    logits = np.log(PRIOR) + 3.0 * gap
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def ref_nestedkv(keys, block=None):
    at = ref_scale_anomalies(keys, block)
    w = ref_weights(ref_gap(at))
    blend = np.sum(at * w[:, :, None, :], axis=-1)
    s = ref_minmax(at.std(axis=-1), axis=2)  # ddof 0
    s = s - s.mean(axis=2, keepdims=True)
    gate = 1.0 / (1.0 + np.exp(-10.0 * (s - 0.6)))
    return (1 - gate) * blend + gate * at.max(axis=-1)


def random_keys(N, dtype=mx.float32, seed=0, B=2, H=3, D=8):
    # A shared offset makes the anchors meaningful (keys of real models are far from isotropic).
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((B, H, N, D)) + 0.7 * rng.standard_normal((B, H, 1, D))
    k = mx.array(k.astype(np.float32)).astype(dtype)
    return k, np.array(k.astype(mx.float32), dtype=np.float64)


NS = [5, 17, 64, 65, 200, 600]
DTYPES = [(mx.float32, 1e-5), (mx.bfloat16, 1e-5)]


def test_reference_matches_the_spec_worked_example():
    w = ref_weights(np.array([0.8, 0.5, 0.6]))
    np.testing.assert_allclose(w, [0.60, 0.24, 0.16], atol=0.01)
    np.testing.assert_allclose(ref_weights(np.full(3, 0.37)), PRIOR, atol=1e-12)


@pytest.mark.parametrize("N", NS)
def test_anchor_cosines_match_mean_anchors(N):
    keys, ref = random_keys(N)
    k = ref_unit(ref)
    _, mu_e, mu_c = ref_anchors(k)
    k_mx = mx.array(k.astype(np.float32))
    mu_s, _, _ = ref_anchors(k)
    np.testing.assert_allclose(np.array(scoring.stable_cosine(k_mx)), ref_cos(k, mu_s), atol=1e-5)
    np.testing.assert_allclose(np.array(scoring.block_cosine(k_mx, scoring.block_size(N))), ref_cos(k, mu_e), atol=1e-5)
    np.testing.assert_allclose(np.array(scoring.window_cosine(k_mx, 64)), ref_cos(k, mu_c), atol=1e-5)


@pytest.mark.parametrize("N,b", [(5, 128), (4095, 128), (4096, 128), (6000, 187), (8192, 256), (50000, 256)])
def test_block_size_is_clipped(N, b):
    assert scoring.block_size(N) == b


def test_block_anchor_with_short_last_block():
    # N=10, block 4: blocks [0..3], [4..7], [8..9]; the last one averages only 2 keys.
    _, ref = random_keys(10)
    k = ref_unit(ref)
    got = np.array(scoring.block_cosine(mx.array(k.astype(np.float32)), 4))
    np.testing.assert_allclose(got[:, :, 9], ref_cos(k[:, :, 9], k[:, :, 8:10].mean(axis=2)), atol=1e-6)
    np.testing.assert_allclose(got[:, :, 3], ref_cos(k[:, :, 3], k[:, :, 0:4].mean(axis=2)), atol=1e-6)


@pytest.mark.parametrize("dtype,atol", DTYPES)
@pytest.mark.parametrize("N", NS)
def test_scale_anomalies_match_reference(N, dtype, atol):
    keys, ref = random_keys(N, dtype)
    got = scoring.scale_anomalies(keys)
    assert got.dtype == mx.float32 and got.shape == (2, 3, N, 3)
    np.testing.assert_allclose(np.array(got), ref_scale_anomalies(ref), atol=atol)


@pytest.mark.parametrize("N", NS)
def test_tail_gap_match_reference(N):
    at = np.random.default_rng(N).random((2, 3, N, 3))
    got = scoring.tail_gap(mx.array(at.astype(np.float32)))
    np.testing.assert_allclose(np.array(got), ref_gap(at.astype(np.float32)), atol=1e-6)


def test_tail_gap_uses_ceil_of_ten_percent():
    # N=11 -> q=2: top two (10, 9) minus bottom two (0, 1).
    x = mx.array(np.arange(11, dtype=np.float32)[None, None, ::-1, None].copy())
    assert scoring.tail_gap(x).item() == pytest.approx((10 + 9) / 2 - (0 + 1) / 2)


@pytest.mark.parametrize("dtype,atol", DTYPES)
@pytest.mark.parametrize("N", NS)
def test_nestedkv_scores_match_reference(N, dtype, atol):
    keys, ref = random_keys(N, dtype, seed=N)
    got = scoring.nestedkv_scores(keys)
    assert got.dtype == mx.float32 and got.shape == (2, 3, N)
    np.testing.assert_allclose(np.array(got), ref_nestedkv(ref), atol=atol)


def test_gate_routes_surprising_tokens_to_the_winning_scale():
    # Without the gate only the blend is left; the difference must be exactly gate * (max - blend).
    keys, ref = random_keys(600, seed=3)
    at = ref_scale_anomalies(ref)
    blend = np.sum(at * ref_weights(ref_gap(at))[:, :, None, :], axis=-1)
    no_gate = np.array(scoring.nestedkv_scores(keys, use_gate=False))
    np.testing.assert_allclose(no_gate, blend, atol=1e-5)
    full = np.array(scoring.nestedkv_scores(keys))
    assert np.all(full >= no_gate - 1e-5)  # routing only ever moves a score towards the max scale


def _recover_weights(keys, block):
    # With the gate off, scores = at @ w per head: recover w by least squares.
    at = np.array(scoring.scale_anomalies(keys, block=block), dtype=np.float64)
    blend = np.array(scoring.nestedkv_scores(keys, block=block, use_gate=False), dtype=np.float64)
    w = np.empty(at.shape[:2] + (3,))
    for b in range(at.shape[0]):
        for h in range(at.shape[1]):
            w[b, h] = np.linalg.lstsq(at[b, h], blend[b, h], rcond=None)[0]
    return at, w


def test_mixing_weights_equal_prior_when_gaps_are_equal():
    # N=10 -> q=1, so every non-constant scale has gap max-min = 1: equal gaps, weights = prior.
    keys, _ = random_keys(10, seed=5)
    at, w = _recover_weights(keys, block=3)
    np.testing.assert_allclose(ref_gap(at), 1.0, atol=1e-6)
    np.testing.assert_allclose(w, np.broadcast_to(PRIOR, w.shape), atol=1e-4)


def test_mixing_weights_follow_the_gaps():
    keys, _ = random_keys(300, seed=6)
    at, w = _recover_weights(keys, block=None)
    expected = ref_weights(ref_gap(at))
    np.testing.assert_allclose(w, expected, atol=1e-4)
    assert np.abs(expected - PRIOR).max() > 0.01  # the gaps really moved the weights


def test_constant_keys_give_finite_scores():
    keys = mx.ones((1, 2, 300, 8), dtype=mx.bfloat16)
    for fn in (scoring.nestedkv_scores, scoring.keydiff_scores, scoring.knorm_scores):
        s = fn(keys)
        assert s.dtype == mx.float32
        assert bool(mx.all(mx.isfinite(s)).item()), fn.__name__
    # Everything degenerate: all scales zero, so the final score is zero everywhere.
    np.testing.assert_allclose(np.array(scoring.nestedkv_scores(keys)), 0.0, atol=1e-6)


def test_zero_keys_give_finite_scores():
    s = scoring.nestedkv_scores(mx.zeros((1, 1, 50, 4)))
    assert bool(mx.all(mx.isfinite(s)).item())


def test_keydiff_is_the_stable_scale_before_minmax():
    keys, ref = random_keys(200, seed=7)
    k = ref_unit(ref)
    expected = -ref_cos(k, k.mean(axis=2, keepdims=True))
    got = scoring.keydiff_scores(keys)
    np.testing.assert_allclose(np.array(got), expected, atol=1e-5)
    assert float(mx.max(got).item()) <= 1.0 + 1e-6 and float(mx.min(got).item()) >= -1.0 - 1e-6
    np.testing.assert_allclose(
        np.array(scoring._minmax(got)), np.array(scoring.scale_anomalies(keys)[..., 0]), atol=1e-5
    )


def test_knorm_is_negative_norm():
    keys, ref = random_keys(65, mx.bfloat16)
    got = scoring.knorm_scores(keys)
    assert got.dtype == mx.float32
    np.testing.assert_allclose(np.array(got), -np.linalg.norm(ref, axis=-1), rtol=1e-6)


def test_streaming_increases_with_position():
    s = np.array(scoring.streaming_scores(mx.zeros((2, 3, 50, 4))))
    assert s.shape == (2, 3, 50)
    assert np.all(np.diff(s, axis=-1) > 0)


def test_random_is_reproducible_per_seed():
    keys = mx.zeros((1, 2, 100, 4))
    a, b = scoring.random_scores(keys, seed=1), scoring.random_scores(keys, seed=1)
    assert mx.array_equal(a, b).item()
    assert not mx.array_equal(a, scoring.random_scores(keys, seed=2)).item()
    mx.random.seed(123)  # the global RNG must not matter
    assert mx.array_equal(a, scoring.random_scores(keys, seed=1)).item()


SCORERS = [
    scoring.nestedkv_scores,
    scoring.keydiff_scores,
    scoring.knorm_scores,
    scoring.streaming_scores,
    scoring.random_scores,
]


@pytest.mark.parametrize("fn", SCORERS, ids=lambda f: f.__name__)
@pytest.mark.parametrize(
    "bad,exc",
    [
        (mx.zeros((3, 10, 8)), ValueError),
        (mx.zeros((1, 3, 10, 8), dtype=mx.int32), TypeError),
        (np.zeros((1, 3, 10, 8), dtype=np.float32), TypeError),
        ([[[[0.0]]]], TypeError),
    ],
    ids=["rank3", "int", "numpy", "list"],
)
def test_bad_keys_are_rejected(fn, bad, exc):
    with pytest.raises(exc, match="keys"):
        fn(bad)


def test_scales_ablation_rejects_no_scale():
    keys, _ = random_keys(20)
    with pytest.raises(ValueError, match="scales"):
        scoring.nestedkv_scores(keys, scales=(False, False, False))


def test_single_scale_ablation_is_that_scale():
    keys, ref = random_keys(200, seed=9)
    got = scoring.nestedkv_scores(keys, scales=(True, False, False))
    np.testing.assert_allclose(np.array(got), ref_scale_anomalies(ref)[..., 0], atol=1e-5)


def test_ceil_is_exact_for_tail_count():
    # Guard the float product 0.1 * N against rounding up past an exact multiple of ten.
    for n in range(1, 40000):
        assert max(1, math.ceil(scoring.TAIL * n)) == max(1, -(-n // 10)), n


# -- the sort-based implementation before the speed-up (issue 13), kept verbatim as the reference --
def old_unit(x):
    return x / mx.maximum(mx.linalg.norm(x, axis=-1, keepdims=True), scoring.EPS)


def old_cos(dots, anchor_norms):
    return dots / mx.maximum(anchor_norms, scoring.EPS)


def old_minmax(x, axis=2):
    lo = mx.min(x, axis=axis, keepdims=True)
    span = mx.max(x, axis=axis, keepdims=True) - lo
    return mx.where(span > scoring.EPS, (x - lo) / mx.maximum(span, scoring.EPS), 0.0)


def old_stable_cosine(k_unit):
    total = mx.sum(k_unit, axis=2, keepdims=True)
    dots = (k_unit @ total.swapaxes(-1, -2))[..., 0]
    return old_cos(dots, mx.linalg.norm(total, axis=-1))


def old_block_cosine(k_unit, block):
    B, H, N, D = k_unit.shape
    n_blocks = -(-N // block)
    pad = n_blocks * block - N
    padded = mx.pad(k_unit, [(0, 0), (0, 0), (0, pad), (0, 0)]) if pad else k_unit
    blocks = padded.reshape(B, H, n_blocks, block, D)
    sums = mx.sum(blocks, axis=3, keepdims=True)
    dots = (blocks @ sums.swapaxes(-1, -2))[..., 0]
    cos = old_cos(dots, mx.linalg.norm(sums, axis=-1))
    return cos.reshape(B, H, n_blocks * block)[:, :, :N]


def old_window_cosine(k_unit, window):
    N = k_unit.shape[2]
    sums = mx.cumsum(k_unit, axis=2)
    if N > window:
        sums = sums - mx.pad(sums[:, :, : N - window], [(0, 0), (0, 0), (window, 0), (0, 0)])
    return old_cos(mx.sum(k_unit * sums, axis=-1), mx.linalg.norm(sums, axis=-1))


def old_scale_anomalies(keys, window=64, block=None):
    k = old_unit(keys.astype(mx.float32))
    N = k.shape[2]
    raw = -mx.stack(
        [old_stable_cosine(k), old_block_cosine(k, block or scoring.block_size(N)), old_window_cosine(k, window)],
        axis=-1,
    )
    return old_minmax(raw, axis=2)


def old_tail_gap(x, tail=0.10):
    N = x.shape[2]
    q = max(1, math.ceil(tail * N))
    srt = mx.sort(x, axis=2)
    return mx.mean(srt[:, :, N - q :], axis=2) - mx.mean(srt[:, :, :q], axis=2)


def old_nestedkv_scores(keys, *, window=64, block=None, prior=(0.4, 0.4, 0.2), beta=3.0, tail=0.10, tau=0.60,
                        kappa=10.0, use_gate=True, scales=(True, True, True)):
    at = old_scale_anomalies(keys, window=window, block=block)
    if not all(scales):
        at = at[..., [i for i, on in enumerate(scales) if on]]
        prior = tuple(p for p, on in zip(prior, scales) if on)
    gap = old_tail_gap(at, tail)
    logits = mx.log(mx.array(prior, dtype=mx.float32)) + beta * gap
    w = mx.softmax(logits, axis=-1)
    blend = mx.sum(at * w[:, :, None, :], axis=-1)
    if not use_gate or at.shape[-1] == 1:
        return blend
    surprise = old_minmax(mx.sqrt(mx.var(at, axis=-1)), axis=2)
    surprise = surprise - mx.mean(surprise, axis=2, keepdims=True)
    gate = mx.sigmoid(kappa * (surprise - tau))
    return (1.0 - gate) * blend + gate * mx.max(at, axis=-1)


def model_like_keys(shape, dtype, seed):
    # Real keys share a direction per head and drift slowly along the sequence.
    B, H, N, D = shape
    rng = np.random.default_rng(seed)
    k = rng.standard_normal(shape) + 0.7 * rng.standard_normal((B, H, 1, D))
    k += 0.5 * np.cumsum(rng.standard_normal(shape), axis=2) / np.sqrt(np.arange(1, N + 1))[:, None]
    return mx.array(k.astype(np.float32)).astype(dtype)


SPEEDUP_SHAPES = [(2, 3, 5, 8), (1, 2, 64, 16), (2, 3, 65, 16), (1, 4, 700, 32), (1, 2, 4100, 64), (1, 8, 2048, 128)]


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("shape", SPEEDUP_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_selections_identical_to_the_sort_based_version(shape, dtype):
    N = shape[2]
    for seed, make in ((0, random_keys_of), (1, model_like_keys)):
        keys = make(shape, dtype, seed)
        new, old = scoring.nestedkv_scores(keys), old_nestedkv_scores(keys)
        np.testing.assert_allclose(np.array(new), np.array(old), atol=2e-6)
        if mx.default_device() == mx.cpu:  # same fp32 arithmetic: bit-identical (checked on CPU)
            assert mx.array_equal(new, old).item()
        for keep in {max(1, N // 4), max(1, N // 2), max(1, N - 1)}:
            for hb in ("uniform", "adaptive"):
                a, b = select(new, keep, hb), select(old, keep, hb)
                assert mx.array_equal(a.indices, b.indices).item(), (shape, keep, hb, seed)
                assert mx.array_equal(a.counts, b.counts).item()


def random_keys_of(shape, dtype, seed):
    B, H, N, D = shape
    return random_keys(N, dtype, seed, B, H, D)[0]


@pytest.mark.parametrize(
    "kwargs",
    [dict(block=7), dict(block=5000), dict(window=3), dict(window=5000), dict(use_gate=False),
     dict(scales=(True, False, True)), dict(scales=(False, False, True)), dict(tail=0.3)],
    ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()),
)
def test_options_match_the_sort_based_version(kwargs):
    keys = model_like_keys((2, 3, 333, 16), mx.float32, 4)
    new, old = scoring.nestedkv_scores(keys, **kwargs), old_nestedkv_scores(keys, **kwargs)
    np.testing.assert_allclose(np.array(new), np.array(old), atol=2e-6)
    if mx.default_device() == mx.cpu:
        assert mx.array_equal(new, old).item()


def test_parts_match_the_sort_based_version():
    keys = model_like_keys((2, 3, 333, 16), mx.float32, 5)
    np.testing.assert_allclose(np.array(scoring.scale_anomalies(keys)), np.array(old_scale_anomalies(keys)), atol=2e-6)
    at = scoring.scale_anomalies(keys)
    np.testing.assert_allclose(np.array(scoring.tail_gap(at)), np.array(old_tail_gap(at)), atol=1e-6)


@pytest.mark.parametrize(
    "shape,cores,plan",
    [
        ((1, 8, 512, 128), 2, [[(0, 8)]]),  # short: one stream, one piece
        ((1, 8, 2048, 128), 2, [[(0, 4)], [(4, 8)]]),
        ((1, 8, 8192, 128), 1, [[(0, 4), (4, 8)]]),  # 16 MiB pieces
        ((1, 8, 32768, 128), 2, [[(0, 1), (1, 2), (2, 3), (3, 4)], [(4, 5), (5, 6), (6, 7), (7, 8)]]),
        ((1, 3, 8192, 128), 16, [[(0, 1)], [(1, 2)], [(2, 3)]]),  # never more streams than heads
        ((1, 8, 4096, 64), 16, [[(0, 2)], [(2, 4)], [(4, 6)], [(6, 8)]]),  # nor than MAX_STREAMS
        ((4, 2, 65536, 128), 2, [[(0, 1)], [(1, 2)]]),  # a head larger than a piece stays whole
    ],
)
def test_head_plan(shape, cores, plan):
    assert scoring.head_plan(*shape, cores) == plan


@pytest.mark.parametrize(
    "plan",
    [[[(0, 8)]], [[(0, 4)], [(4, 8)]], [[(0, 1), (1, 3)], [(3, 8)]], [[(0, 3), (3, 5), (5, 8)]],
     [[(0, 2)], [(2, 4)], [(4, 6)], [(6, 8)]]],
)
def test_scoring_by_head_ranges_changes_no_value(plan):
    keys = model_like_keys((2, 8, 300, 16), mx.float32, 3)
    whole = scoring.nestedkv_scores(keys)  # N < PARALLEL_MIN_N: one piece on the caller's stream

    def score(k):
        return scoring._nestedkv(k, 64, None, scoring.PRIOR, 3.0, 0.1, 0.6, 10.0, True, (True, True, True))

    split = scoring._by_heads(score, keys, plan)
    assert split.shape == whole.shape
    assert mx.array_equal(split, whole).item()
    keydiff = scoring._by_heads(lambda k: -scoring.stable_cosine(scoring._unit(k)), keys, plan)
    assert mx.array_equal(keydiff, scoring.keydiff_scores(keys)).item()


def test_long_context_scores_inside_another_stream():
    # mlx-lm's generate runs the model (and so a cache's compression) on its own stream.
    keys = model_like_keys((1, 4, scoring.PARALLEL_MIN_N + 10, 16), mx.float32, 7)
    expected = old_nestedkv_scores(keys)
    with mx.stream(mx.new_stream(mx.default_device())):
        got = scoring.nestedkv_scores(keys)
    mx.eval(got)
    np.testing.assert_allclose(np.array(got), np.array(expected), atol=2e-6)
