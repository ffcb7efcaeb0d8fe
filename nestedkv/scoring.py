"""Key-only importance scores: keys ``[B, H, N, D]`` (any float dtype) -> scores ``[B, H, N]`` in fp32.

Higher scores mean "keep". All functions are pure and score every head at once. Sinks are not
pinned here: selection pins them after scoring, so a huge constant never distorts the min-max,
quantile and surprise statistics (spec pitfall 6).
"""

from __future__ import annotations

import math

import mlx.core as mx

EPS = 1e-6

# NestedKV defaults (arXiv:2605.26678, Appendix A).
BLOCK_DIVISOR = 32  # episodic block b = clip(N // 32, 128, 256)
BLOCK_MIN = 128
BLOCK_MAX = 256
WINDOW = 64  # trailing window for the current anchor, token itself included
PRIOR = (0.4, 0.4, 0.2)  # prior mixing weights (stable, episodic, current)
BETA = 3.0  # multiplies the discriminative gap inside the mixing softmax
TAIL = 0.10  # top/bottom share for the discriminative gap
TAU = 0.60  # surprise-gate threshold on min-max-normalized, mean-centred surprise
KAPPA = 10.0  # surprise-gate sharpness


def check_keys(keys: mx.array) -> None:
    if not isinstance(keys, mx.array):
        raise TypeError(f"keys must be an mlx array of shape [B, H, N, D], got {type(keys).__name__}")
    if keys.ndim != 4:
        raise ValueError(f"keys must have rank 4 [B, H, N, D], got shape {tuple(keys.shape)}")
    if not mx.issubdtype(keys.dtype, mx.floating):
        raise TypeError(f"keys must be a floating dtype, got {keys.dtype}")
    if keys.shape[2] < 1 or keys.shape[3] < 1:
        raise ValueError(f"keys must have N >= 1 and D >= 1, got shape {tuple(keys.shape)}")


def _unit(x: mx.array) -> mx.array:
    return x / mx.maximum(mx.linalg.norm(x, axis=-1, keepdims=True), EPS)


def _cos(dots: mx.array, anchor_norms: mx.array) -> mx.array:
    # True cosine: anchors are sums of unit vectors whose norm varies per token (spec pitfall 1).
    # A cosine does not change when the anchor is scaled, so block and window SUMS stand in for
    # their means and nothing is ever divided by a count.
    return dots / mx.maximum(anchor_norms, EPS)


def _minmax(x: mx.array, axis: int = 2) -> mx.array:
    lo = mx.min(x, axis=axis, keepdims=True)
    span = mx.max(x, axis=axis, keepdims=True) - lo
    # A constant vector carries no ranking information: zeros, never NaN.
    return mx.where(span > EPS, (x - lo) / mx.maximum(span, EPS), 0.0)


def block_size(n: int) -> int:
    return min(max(n // BLOCK_DIVISOR, BLOCK_MIN), BLOCK_MAX)


def stable_cosine(k_unit: mx.array) -> mx.array:
    """cos(k_i, mean of all unit keys): ``[B, H, N]``."""
    total = mx.sum(k_unit, axis=2, keepdims=True)  # [B,H,1,D]
    dots = (k_unit @ total.swapaxes(-1, -2))[..., 0]
    return _cos(dots, mx.linalg.norm(total, axis=-1))


def block_cosine(k_unit: mx.array, block: int) -> mx.array:
    """cos(k_i, mean of the unit keys in i's contiguous block); the last block may be shorter."""
    B, H, N, D = k_unit.shape
    n_blocks = -(-N // block)
    pad = n_blocks * block - N
    padded = mx.pad(k_unit, [(0, 0), (0, 0), (0, pad), (0, 0)]) if pad else k_unit
    blocks = padded.reshape(B, H, n_blocks, block, D)
    sums = mx.sum(blocks, axis=3, keepdims=True)  # zero padding leaves the sums exact
    dots = (blocks @ sums.swapaxes(-1, -2))[..., 0]  # [B,H,nb,block]
    cos = _cos(dots, mx.linalg.norm(sums, axis=-1))
    return cos.reshape(B, H, n_blocks * block)[:, :, :N]


def window_cosine(k_unit: mx.array, window: int) -> mx.array:
    """cos(k_i, mean of the unit keys in the trailing window that includes i itself)."""
    N = k_unit.shape[2]
    sums = mx.cumsum(k_unit, axis=2)
    if N > window:
        sums = sums - mx.pad(sums[:, :, : N - window], [(0, 0), (0, 0), (window, 0), (0, 0)])
    return _cos(mx.sum(k_unit * sums, axis=-1), mx.linalg.norm(sums, axis=-1))


def scale_anomalies(keys: mx.array, window: int = WINDOW, block: int | None = None) -> mx.array:
    """Min-max-normalized anomalies on the stable, episodic and current scales: ``[B, H, N, 3]``."""
    check_keys(keys)
    k = _unit(keys.astype(mx.float32))
    N = k.shape[2]
    raw = -mx.stack(
        [stable_cosine(k), block_cosine(k, block or block_size(N)), window_cosine(k, window)], axis=-1
    )
    return _minmax(raw, axis=2)


def tail_gap(x: mx.array, tail: float = TAIL) -> mx.array:
    """Mean of the top ``tail`` share minus mean of the bottom share along axis 2."""
    N = x.shape[2]
    q = max(1, math.ceil(tail * N))
    srt = mx.sort(x, axis=2)
    return mx.mean(srt[:, :, N - q :], axis=2) - mx.mean(srt[:, :, :q], axis=2)


def nestedkv_scores(
    keys: mx.array,
    *,
    window: int = WINDOW,
    block: int | None = None,
    prior: tuple[float, float, float] = PRIOR,
    beta: float = BETA,
    tail: float = TAIL,
    tau: float = TAU,
    kappa: float = KAPPA,
    use_gate: bool = True,
    scales: tuple[bool, bool, bool] = (True, True, True),
) -> mx.array:
    """NestedKV importance: three-scale cosine anomaly, head-adaptive mixing, surprise-gated routing.

    ``block`` overrides the episodic block size (default ``clip(N // 32, 128, 256)``).
    ``use_gate=False`` and ``scales`` exist for ablations only; the defaults are the paper's method.
    """
    at = scale_anomalies(keys, window=window, block=block)  # [B,H,N,3]
    if not all(scales):
        if not any(scales):
            raise ValueError("scales must enable at least one of (stable, episodic, current)")
        at = at[..., [i for i, on in enumerate(scales) if on]]
        prior = tuple(p for p, on in zip(prior, scales) if on)
    gap = tail_gap(at, tail)  # [B,H,S]
    logits = mx.log(mx.array(prior, dtype=mx.float32)) + beta * gap
    w = mx.softmax(logits, axis=-1)
    blend = mx.sum(at * w[:, :, None, :], axis=-1)
    if not use_gate or at.shape[-1] == 1:
        return blend
    surprise = _minmax(mx.sqrt(mx.var(at, axis=-1)), axis=2)
    surprise = surprise - mx.mean(surprise, axis=2, keepdims=True)
    gate = mx.sigmoid(kappa * (surprise - tau))
    return (1.0 - gate) * blend + gate * mx.max(at, axis=-1)


def keydiff_scores(keys: mx.array) -> mx.array:
    """KeyDiff: negative cosine to the mean unit key (NestedKV's stable scale alone)."""
    check_keys(keys)
    return -stable_cosine(_unit(keys.astype(mx.float32)))


def knorm_scores(keys: mx.array) -> mx.array:
    """Knorm: keys with a small norm are the important ones."""
    check_keys(keys)
    return -mx.linalg.norm(keys.astype(mx.float32), axis=-1)


def streaming_scores(keys: mx.array) -> mx.array:
    """StreamingLLM: the most recent tokens win (sinks are pinned by selection)."""
    check_keys(keys)
    B, H, N, _ = keys.shape
    return mx.broadcast_to(mx.arange(N, dtype=mx.float32), (B, H, N))


def random_scores(keys: mx.array, seed: int = 0) -> mx.array:
    """Uniform random scores from a fixed seed: the reproducible floor every method must beat."""
    check_keys(keys)
    B, H, N, _ = keys.shape
    return mx.random.uniform(shape=(B, H, N), key=mx.random.key(seed))
