"""Budget rounding, uniform and adaptive (head-competition) selection, and argument checking."""

import mlx.core as mx
import numpy as np
import pytest

from nestedkv import KeyDiffPress, NestedKVPress, NoPress, get_press
from nestedkv.selection import n_keep, select


def kept_mask(sel, N):
    """Selection -> boolean [B, H, N] of kept positions (padding excluded)."""
    idx = np.array(sel.indices)
    valid = np.ones(idx.shape, bool) if sel.valid is None else np.array(sel.valid)
    mask = np.zeros(idx.shape[:2] + (N,), bool)
    for b in range(idx.shape[0]):
        for h in range(idx.shape[1]):
            mask[b, h, idx[b, h][valid[b, h]]] = True
    return mask


def rand_scores(B, H, N, seed=0):
    return np.random.default_rng(seed).standard_normal((B, H, N)).astype(np.float32)


# -- n_keep ----------------------------------------------------------------------------------
@pytest.mark.parametrize("N", [1, 3, 4, 5, 10, 17, 100, 333, 1000, 4097])
@pytest.mark.parametrize("r", [0.0, 0.1, 0.25, 0.5, 0.7, 0.75, 0.9, 0.95, 0.99])
def test_n_keep_follows_kvpress_rounding(N, r):
    keep = max(1, int(N * (1 - r)))  # kvpress ScorerPress
    keep = max(keep, min(4, N))  # sinks always kept
    assert n_keep(N, r) == (None if keep >= N else keep)


def test_n_keep_examples():
    assert n_keep(1000, 0.75) == 250
    assert n_keep(100, 0.7) == 30  # int(30.000000000000004)
    assert n_keep(1000, 0.0) is None  # nothing to evict
    assert n_keep(1000, 0.5, budget=100) == 100  # the absolute budget wins over the ratio
    assert n_keep(1000, 0.99, budget=100) == 100
    assert n_keep(50, budget=64) is None  # already within budget
    assert n_keep(64, budget=64) is None
    assert n_keep(1000, budget=2) == 4  # raised to the sinks
    assert n_keep(1000, 0.999) == 4
    assert n_keep(3, budget=1) is None  # fewer tokens than sinks: nothing to evict


def test_press_n_keep_and_no_press():
    assert NestedKVPress(compression_ratio=0.75).n_keep(1000) == 250
    assert KeyDiffPress(budget=10).n_keep(1000) == 10
    assert NoPress(compression_ratio=0.9).n_keep(1000) is None
    assert NestedKVPress(compression_ratio=0.75).select(mx.zeros((1, 2, 3, 4))) is None


# -- uniform ---------------------------------------------------------------------------------
def test_uniform_keeps_exactly_k_per_head_in_ascending_order():
    s = rand_scores(2, 3, 200)
    sel = select(mx.array(s), 30)
    idx = np.array(sel.indices)
    assert idx.shape == (2, 3, 30) and sel.valid is None
    assert np.array(sel.counts).tolist() == [[30] * 3] * 2
    assert np.all(np.diff(idx, axis=-1) > 0)
    for b in range(2):
        for h in range(3):
            # sinks + the top 26 of the rest
            rest = 4 + np.argsort(-s[b, h, 4:], kind="stable")[:26]
            assert idx[b, h].tolist() == sorted([0, 1, 2, 3, *rest.tolist()])


def test_sinks_kept_even_with_the_lowest_scores():
    s = rand_scores(1, 2, 100)
    s[..., :4] = -1e9
    idx = np.array(select(mx.array(s), 10).indices)
    assert np.all(idx[..., :4] == [0, 1, 2, 3])
    s_no = np.array(select(mx.array(s), 10, n_sink=0).indices)
    assert not np.isin([0, 1, 2, 3], s_no).any()  # the test can tell


def test_budget_below_sinks_keeps_sinks():
    press = NestedKVPress(budget=2, unrotate=False)  # raw keys, no model rope
    keys = mx.random.normal((1, 2, 50, 8), key=mx.random.key(0))
    sel = press.select(keys)
    assert np.array(sel.indices).tolist() == [[[0, 1, 2, 3]] * 2]


def test_all_equal_scores_keep_the_first_k():
    sel = select(mx.zeros((2, 3, 100)), 17, n_sink=0)
    assert np.all(np.array(sel.indices) == np.arange(17))
    # Adaptive pool ties go to the lower head, then the lower position; each head keeps a prefix.
    sel = select(mx.zeros((1, 2, 100)), 17, head_budget="adaptive", n_sink=0)
    assert np.array(sel.counts).tolist() == [[34 - 3, 3]]
    assert kept_mask(sel, 100)[0, 0].tolist() == [True] * 31 + [False] * 69
    assert kept_mask(sel, 100)[0, 1].tolist() == [True] * 3 + [False] * 97


def test_ties_break_towards_lower_positions():
    s = np.zeros((1, 1, 12), np.float32)
    s[0, 0, [2, 5, 7, 9, 11]] = 1.0  # five tied winners for three slots
    s[0, 0, 10] = 2.0
    idx = np.array(select(mx.array(s), 3, n_sink=0).indices)[0, 0]
    assert idx.tolist() == [2, 5, 10]


def test_nan_scores_are_never_preferred():
    s = np.arange(20, dtype=np.float32)[None, None].copy()
    s[0, 0, 19] = np.nan
    idx = np.array(select(mx.array(s), 3, n_sink=0).indices)[0, 0]
    assert idx.tolist() == [16, 17, 18]


def test_selection_is_deterministic():
    s = mx.array(np.round(rand_scores(2, 4, 500), 1))  # many ties
    a, b = select(s, 50, "adaptive"), select(s, 50, "adaptive")
    assert mx.array_equal(a.indices, b.indices).item()


# -- adaptive --------------------------------------------------------------------------------
def ref_adakv(scores, r=None, keep=None, n_sink=0, alpha=0.2):
    """kvpress AdaKVPress in numpy (+ optional sinks pinned first), returns kept mask [B,H,N]."""
    s = scores.astype(np.float64).copy()
    B, H, N = s.shape
    n_kept = keep if keep is not None else int(N * (1 - r))
    s[..., :n_sink] = np.inf
    n_safe = int(n_kept * alpha)
    big = np.finfo(np.float64).max
    for b in range(B):
        for h in range(H):
            top = np.argsort(-s[b, h], kind="stable")[:n_safe]
            s[b, h, top] = np.maximum(s[b, h, top], big)
    n_pruned = H * (N - n_kept)
    mask = np.ones((B, H * N), bool)
    flat = s.reshape(B, H * N)
    for b in range(B):
        mask[b, np.argsort(flat[b], kind="stable")[:n_pruned]] = False
    return mask.reshape(B, H, N)


@pytest.mark.parametrize("N,r", [(100, 0.5), (257, 0.75), (1000, 0.9), (64, 0.25)])
@pytest.mark.parametrize("n_sink", [0, 4])
def test_adaptive_matches_kvpress_adakv(N, r, n_sink):
    s = rand_scores(2, 4, N, seed=N)
    keep = n_keep(N, r, n_sink=n_sink)
    sel = select(mx.array(s), keep, "adaptive", n_sink=n_sink)
    np.testing.assert_array_equal(kept_mask(sel, N), ref_adakv(s, keep=keep, n_sink=n_sink))


def test_adaptive_layer_total_floor_and_padding():
    s = rand_scores(2, 4, 300, seed=1)
    s[:, 0] += 1.5  # skew: head 0 is much more "important"
    s[:, 3] -= 1.5
    k = 60
    sel = select(mx.array(s), k, "adaptive")
    counts = np.array(sel.counts)
    assert counts.sum(axis=1).tolist() == [4 * k, 4 * k]
    assert len(set(counts[0].tolist())) > 1 and counts[0, 0] > k > counts[0, 3]
    mask = kept_mask(sel, 300)
    assert (mask.sum(-1) == counts).all()
    n_safe = int(0.2 * k)
    pinned = s.copy()
    pinned[..., :4] = np.inf
    for b in range(2):
        for h in range(4):
            top = np.argsort(-pinned[b, h], kind="stable")[:n_safe]
            assert mask[b, h, top].all()  # each head's own floor
            assert mask[b, h, :4].all()  # sinks
            real = np.array(sel.indices)[b, h][np.array(sel.valid)[b, h]]
            assert np.all(np.diff(real) > 0)  # ascending
            assert np.array(sel.valid)[b, h, : counts[b, h]].all()  # real rows first, padding after
    assert sel.indices.shape[-1] == counts.max()


def test_adaptive_floor_binds_for_a_starved_head():
    s = rand_scores(1, 2, 200, seed=2)
    s[:, 1] -= 100.0  # head 1 loses every competition
    k = 50
    counts = np.array(select(mx.array(s), k, "adaptive").counts)[0]
    assert counts.tolist() == [2 * k - int(0.2 * k), int(0.2 * k)]


def test_adaptive_equal_heads_keep_equal_counts():
    s = np.tile(rand_scores(1, 1, 100), (1, 3, 1))
    sel = select(mx.array(s), 20, "adaptive")
    assert np.array(sel.counts).tolist() == [[20, 20, 20]] and sel.valid is None


# -- argument checking -----------------------------------------------------------------------
def test_bad_head_budget():
    with pytest.raises(ValueError, match="head_budget.*uniform.*adaptive"):
        NestedKVPress(head_budget="global")
    with pytest.raises(ValueError, match="head_budget.*uniform.*adaptive"):
        select(mx.zeros((1, 1, 10)), 5, head_budget="per_head")


@pytest.mark.parametrize("r", [1.0, 1.5, -0.1])
def test_bad_ratio(r):
    with pytest.raises(ValueError, match=r"compression_ratio.*\[0, 1\)"):
        NestedKVPress(compression_ratio=r)


def test_ratio_of_wrong_type():
    with pytest.raises(TypeError, match="compression_ratio"):
        KeyDiffPress(compression_ratio="0.5")


@pytest.mark.parametrize("budget,exc", [(0, ValueError), (-5, ValueError), (2.5, TypeError), (True, TypeError)])
def test_bad_budget(budget, exc):
    with pytest.raises(exc, match="budget.*(>= 1|positive int)"):
        NestedKVPress(budget=budget)


def test_unknown_press_name():
    with pytest.raises(ValueError, match="unknown press 'h2o'.*nestedkv.*keydiff.*no_press"):
        get_press("h2o")


def test_get_press_rejects_unknown_params_and_builds_known():
    with pytest.raises(TypeError, match="window"):
        get_press("keydiff", window=32)
    p = get_press("nestedkv", compression_ratio=0.5, head_budget="adaptive")
    assert isinstance(p, NestedKVPress) and p.compression_ratio == 0.5
    assert type(p).from_json(p.to_json()) == p


def test_select_checks_shapes_and_keep():
    with pytest.raises(ValueError, match="scores"):
        select(mx.zeros((4, 10)), 2)
    with pytest.raises(ValueError, match="keep"):
        select(mx.zeros((1, 1, 10)), 11)
    with pytest.raises(ValueError, match="keep"):
        select(mx.zeros((1, 1, 10)), 0)


@pytest.mark.parametrize("name, params", [
    ("nestedkv", {"tau": float("nan")}), ("nestedkv", {"beta": float("inf")}), ("nestedkv", {"kappa": float("-inf")}),
    ("nestedkv", {"prior": (0.4, float("nan"), 0.2)}), ("nestedkv", {"window": 2**31}), ("nestedkv", {"block": 2**31}),
    ("nestedkv", {"window": True}), ("keydiff", {"n_sink": 2**31}), ("keydiff", {"safeguard": float("nan")}),
    ("random", {"seed": -1}), ("random", {"seed": "abc"}), ("random", {"seed": 2**64}), ("random", {"seed": 1.5}),
])
def test_press_parameters_must_be_finite_and_fit_their_arrays(name, params):
    key = next(iter(params))
    with pytest.raises(ValueError, match=key):
        get_press(name, **params)


def test_press_parameters_at_their_limits_are_accepted():
    assert get_press("nestedkv", window=2**31 - 1, block=2**31 - 1, tau=-1e300).window == 2**31 - 1
    assert get_press("random", seed=2**64 - 1).seed == 2**64 - 1
