"""Key-only importance scores: keys ``[B, H, N, D]`` (any float dtype) -> scores ``[B, H, N]`` in fp32.

Higher scores mean "keep". All functions are pure and score every head at once. Sinks are not
pinned here: selection pins them after scoring, so a huge constant never distorts the min-max,
quantile and surprise statistics (spec pitfall 6).
"""

from __future__ import annotations

import math

import mlx.core as mx

from nestedkv import _cpu
from nestedkv._cpu import CHUNK_BYTES
from nestedkv._platform import cpu_cores

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

PARALLEL_MIN_N = 1024  # shorter contexts are scored on one stream (per-op overhead dominates)


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


def _block_dots(k_unit: mx.array, block: int) -> mx.array:
    # Whole blocks only (N a multiple of block): one matvec per block.
    B, H, N, D = k_unit.shape
    blocks = k_unit.reshape(B, H, N // block, block, D)
    sums = mx.sum(blocks, axis=3, keepdims=True)  # zero padding leaves the sums exact
    dots = (blocks @ sums.swapaxes(-1, -2))[..., 0]  # [B,H,nb,block]
    return _cos(dots, mx.linalg.norm(sums, axis=-1)).reshape(B, H, N)


def block_cosine(k_unit: mx.array, block: int) -> mx.array:
    """cos(k_i, mean of the unit keys in i's contiguous block); the last block may be shorter."""
    N = k_unit.shape[2]
    whole = (N // block) * block
    if whole == N:
        return _block_dots(k_unit, block)
    # Only the short last block is zero-padded (not a padded copy of all keys); at full block
    # length its matvec has the same shape, and so the same rounding, as the others.
    last = mx.pad(k_unit[:, :, whole:], [(0, 0), (0, 0), (0, whole + block - N), (0, 0)])
    last = _block_dots(last, block)[:, :, : N - whole]
    if whole == 0:
        return last
    return mx.concatenate([_block_dots(k_unit[:, :, :whole], block), last], axis=2)


def window_cosine(k_unit: mx.array, window: int) -> mx.array:
    """cos(k_i, mean of the unit keys in the trailing window that includes i itself)."""
    N = k_unit.shape[2]
    sums = mx.cumsum(k_unit, axis=2)
    # Window sum = prefix sum minus the prefix sum `window` rows earlier (none for the first rows),
    # without padding a shifted copy. The arithmetic is exactly the earlier version's, so scores
    # stay bit-identical: another fp32 order shifts them enough at 32k tokens to change selections.
    parts = [(k_unit[:, :, :window], sums[:, :, :window] * 1.0)]  # a contiguous copy, reduced as before
    if N > window:
        parts.append((k_unit[:, :, window:], sums[:, :, window:] - sums[:, :, : N - window]))
    cos = [_cos(mx.sum(k * s, axis=-1), mx.linalg.norm(s, axis=-1)) for k, s in parts]
    return cos[0] if len(cos) == 1 else mx.concatenate(cos, axis=2)


def _scale_rows(keys: mx.array, window: int, block: int | None) -> mx.array:
    # Min-max-normalized anomalies with the scale axis before N: [B, H, 3, N], so every
    # per-scale statistic below reduces along contiguous memory.
    check_keys(keys)
    k = _unit(keys.astype(mx.float32))
    N = k.shape[2]
    raw = -mx.stack(
        [stable_cosine(k), block_cosine(k, block or block_size(N)), window_cosine(k, window)], axis=2
    )
    return _minmax(raw, axis=-1)


def scale_anomalies(keys: mx.array, window: int = WINDOW, block: int | None = None) -> mx.array:
    """Min-max-normalized anomalies on the stable, episodic and current scales: ``[B, H, N, 3]``."""
    return _scale_rows(keys, window, block).swapaxes(2, 3)


def _tail_count(n: int, tail: float) -> int:
    return max(1, math.ceil(tail * n))


def _tail_gap_last(x: mx.array, tail: float) -> mx.array:
    # A partial selection (partition) instead of sorting all N: only the two tails are needed. They
    # are sorted and averaged as the earlier full-sort version did, so the gaps stay bit-identical.
    n = x.shape[-1]
    q = _tail_count(n, tail)
    top = mx.sort(mx.partition(x, n - q, axis=-1)[..., n - q :], axis=-1)
    bottom = mx.sort(mx.partition(x, q - 1, axis=-1)[..., :q], axis=-1)

    def mean(v: mx.array) -> mx.array:
        return mx.mean(mx.contiguous(v.swapaxes(-1, -2)), axis=-2)

    return mean(top) - mean(bottom)


def tail_gap(x: mx.array, tail: float = TAIL) -> mx.array:
    """Mean of the top ``tail`` share minus mean of the bottom share along axis 2."""
    return _tail_gap_last(mx.moveaxis(x, 2, -1), tail)


def head_plan(B: int, H: int, N: int, D: int, cores: int) -> list[list[tuple[int, int]]]:
    """How the CPU scores ``[B, H, N, D]`` keys: per stream, the head ranges it scores in turn.

    Streams (``_cpu.streams_for``): long contexts are spread over the cores, heads apart. Head
    ranges: each range's fp32 intermediates stay within ``_cpu.CHUNK_BYTES``.
    """
    streams = _cpu.streams_for(H, cores) if N >= PARALLEL_MIN_N else 1
    per_range = max(1, CHUNK_BYTES // (B * N * D * 4))
    bounds = [round(i * H / streams) for i in range(streams + 1)]
    return [
        [(lo, min(lo + per_range, bounds[i + 1])) for lo in range(bounds[i], bounds[i + 1], per_range)]
        for i in range(streams)
    ]


def _by_heads(fn, keys: mx.array, plan: list[list[tuple[int, int]]] | None = None) -> mx.array:
    """``fn(keys)`` for a per-head scorer, computed by head ranges on the CPU (see ``head_plan``);
    every statistic is per head, so this changes no value. Elsewhere (Metal, CUDA) in one piece."""
    if plan is None:
        if not _cpu.on_cpu():
            return fn(keys)
        plan = head_plan(*keys.shape, cpu_cores())
    if len(plan) == 1:
        parts = [fn(keys[:, lo:hi]) for lo, hi in plan[0]]
    else:
        # Waves: the w-th range of every stream, evaluated before the next wave is built. Left to one
        # graph, mlx interleaves the ranges' steps and keeps every range's intermediates alive at once
        # (at 32k tokens, 8 heads: 205 ms instead of 132).
        per_stream: list[list[mx.array]] = [[] for _ in plan]
        waves = max(map(len, plan))
        for w in range(waves):
            for i, ranges in enumerate(plan):
                if w < len(ranges):
                    lo, hi = ranges[w]
                    with mx.stream(_cpu.stream(i)):
                        per_stream[i].append(fn(keys[:, lo:hi]))
            if waves > 1:
                mx.eval([out[w] for out in per_stream if w < len(out)])
        parts = [p for out in per_stream for p in out]
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1)


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
    check_keys(keys)
    if not any(scales):
        raise ValueError("scales must enable at least one of (stable, episodic, current)")

    def score(k: mx.array) -> mx.array:
        return _nestedkv(k, window, block, prior, beta, tail, tau, kappa, use_gate, scales)

    return _by_heads(score, keys)


def _nestedkv(keys, window, block, prior, beta, tail, tau, kappa, use_gate, scales) -> mx.array:
    at = _scale_rows(keys, window, block)  # [B,H,S,N]
    if not all(scales):
        at = at[:, :, [i for i, on in enumerate(scales) if on]]
        prior = tuple(p for p, on in zip(prior, scales) if on)
    gap = _tail_gap_last(at, tail)  # [B,H,S]
    logits = mx.log(mx.array(prior, dtype=mx.float32)) + beta * gap
    w = mx.softmax(logits, axis=-1)
    blend = mx.sum(at * w[..., None], axis=2)
    if not use_gate or at.shape[2] == 1:
        return blend
    surprise = _minmax(mx.sqrt(mx.var(at, axis=2)), axis=2)
    surprise = surprise - mx.mean(surprise, axis=2, keepdims=True)
    gate = mx.sigmoid(kappa * (surprise - tau))
    return (1.0 - gate) * blend + gate * mx.max(at, axis=2)


def keydiff_scores(keys: mx.array) -> mx.array:
    """KeyDiff: negative cosine to the mean unit key (NestedKV's stable scale alone)."""
    check_keys(keys)
    return _by_heads(lambda k: -stable_cosine(_unit(k.astype(mx.float32))), keys)


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
