"""LagKV (Liang et al., arXiv:2504.04704), key-only: a token matters when its key stands out against the
range of the keys that follow it.

After the sinks, the context is cut into partitions of ``lag`` tokens. Each partition is min-max normalized
per channel by the range of the NEXT partition (its lag reference), each token's score is the standard
deviation of its normalized key across channels, and a softmax over the partition makes the scores of
partitions comparable. The last full partition and the remainder have no reference: like the paper's
sliding window they score above every other token, so they go last.

Differences from the paper: keys only (the paper adds the same score computed on the values; our presses
score cached keys); one global top-k over the partitions (the paper keeps a top-k per partition), so head
budgets (uniform or adaptive) compose as for any press; applied at compression (and to the stored rows in
a streaming prefill), not again in decode. Post-RoPE keys by default, as in the paper.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx

from nestedkv import scoring
from nestedkv.press.base import INT32_MAX, BasePress, check, int_in

LAG = 128  # the paper's partition size for its main results
WINDOW_SCORE = 2.0  # above any softmax share (<= 1): sinks and the unreferenced window are kept first


def lagkv_scores(keys: mx.array, lag: int = LAG, n_sink: int = 0) -> mx.array:
    """Scores ``[B, H, N]`` of keys ``[B, H, N, D]``; higher means keep."""
    scoring.check_keys(keys)
    B, H, N, D = keys.shape
    m = max(0, N - n_sink) // lag  # full partitions after the sinks
    if m < 2:  # no partition has a reference
        return mx.full((B, H, N), WINDOW_SCORE, dtype=mx.float32)
    part = keys[:, :, n_sink : n_sink + m * lag].astype(mx.float32).reshape(B, H, m, lag, D)
    ref = part[:, :, 1:]
    lo, hi = mx.min(ref, axis=3, keepdims=True), mx.max(ref, axis=3, keepdims=True)
    norm = (part[:, :, :-1] - lo) / mx.maximum(hi - lo, scoring.EPS)
    s = mx.softmax(mx.sqrt(mx.var(norm, axis=-1)), axis=-1).reshape(B, H, (m - 1) * lag)
    scored_end = n_sink + (m - 1) * lag
    return mx.concatenate([mx.full((B, H, n_sink), WINDOW_SCORE, dtype=mx.float32), s,
                           mx.full((B, H, N - scored_end), WINDOW_SCORE, dtype=mx.float32)], axis=2)


@dataclass(frozen=True)
class LagKVPress(BasePress):
    name: ClassVar[str] = "lagkv"

    lag: int = LAG

    def __post_init__(self):
        super().__post_init__()
        check(int_in(self.lag, 1, INT32_MAX), "lag", f"an int in 1..{INT32_MAX}", self.lag, press=self.name)

    def score(self, keys):
        return lagkv_scores(keys, self.lag, self.n_sink)
