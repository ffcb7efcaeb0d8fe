"""Scores + budget -> the positions each KV head keeps.

Ties are broken towards the lower position (lower head first in the adaptive pool), without
relying on a stable sort, so results are the same on every device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import mlx.core as mx

N_SINK = 4  # leading "attention sink" positions that are always kept
SAFEGUARD = 0.20  # adaptive mode: share of its kept count each head reserves before competing
HEAD_BUDGETS = ("uniform", "adaptive")

HeadBudget = Literal["uniform", "adaptive"]


@dataclass(frozen=True)
class Selection:
    """Kept positions per head, ascending. ``valid`` is None when every head keeps the same count;
    otherwise shorter heads are padded and ``valid`` marks their real rows."""

    indices: mx.array  # [B, H, K] int32
    counts: mx.array  # [B, H] int32
    valid: Optional[mx.array] = None  # [B, H, K] bool


def check_ratio(compression_ratio: float) -> None:
    if not isinstance(compression_ratio, (int, float)) or isinstance(compression_ratio, bool):
        raise TypeError(f"compression_ratio must be a number in [0, 1), got {compression_ratio!r}")
    if not 0.0 <= compression_ratio < 1.0:
        raise ValueError(
            f"compression_ratio must be in [0, 1) (the fraction of KV entries removed), got {compression_ratio}"
        )


def check_budget(budget: Optional[int]) -> None:
    if budget is None:
        return
    if not isinstance(budget, int) or isinstance(budget, bool):
        raise TypeError(f"budget must be a positive int (tokens kept per head) or None, got {budget!r}")
    if budget < 1:
        raise ValueError(f"budget must be >= 1 (tokens kept per head), got {budget}")


def check_head_budget(head_budget: str) -> None:
    if head_budget not in HEAD_BUDGETS:
        raise ValueError(f"head_budget must be one of {', '.join(HEAD_BUDGETS)}; got {head_budget!r}")


def n_keep(n: int, compression_ratio: float = 0.0, budget: Optional[int] = None, n_sink: int = N_SINK):
    """Rows kept per head for a context of ``n`` tokens, or None when it is already within budget.

    kvpress rounding: ``max(1, int(n * (1 - r)))``; an absolute ``budget`` wins over the ratio.
    A budget below ``n_sink`` is raised to ``n_sink``: the sinks are always kept.
    """
    keep = budget if budget is not None else max(1, int(n * (1.0 - compression_ratio)))
    keep = max(keep, min(n_sink, n))
    return None if keep >= n else keep


def pin_sinks(scores: mx.array, n_sink: int = N_SINK) -> mx.array:
    """Sinks get +inf; NaN (never expected) becomes -inf so it can never be kept by accident."""
    scores = mx.where(mx.isnan(scores), -mx.inf, scores)
    if n_sink <= 0:
        return scores
    pos = mx.arange(scores.shape[-1])
    return mx.where(pos < n_sink, mx.inf, scores)


def topk_mask(scores: mx.array, k: int) -> mx.array:
    """Boolean mask of exactly ``k`` top entries along the last axis; ties go to lower indices."""
    m = scores.shape[-1]
    thresh = mx.sort(scores, axis=-1)[..., m - k : m - k + 1]
    above = scores > thresh
    room = k - mx.sum(above, axis=-1, keepdims=True)
    tied = scores == thresh
    return above | (tied & (mx.cumsum(tied.astype(mx.int32), axis=-1) <= room))


def ascending_positions(mask: mx.array, k: int) -> tuple[mx.array, mx.array]:
    n = mask.shape[-1]
    pos = mx.arange(n, dtype=mx.int32)
    # Kept positions sort first (ascending); dropped ones are pushed past n.
    order = mx.sort(mx.where(mask, pos, pos + n), axis=-1)[..., :k]
    valid = order < n
    return mx.where(valid, order, order - n), valid


def select(
    scores: mx.array,
    keep: int,
    head_budget: HeadBudget = "uniform",
    *,
    n_sink: int = N_SINK,
    safeguard: float = SAFEGUARD,
    cap: Optional[int] = None,
) -> Selection:
    """Keep ``keep`` rows per head (uniform) or ``H * keep`` per layer shared by heads (adaptive).

    Adaptive follows the paper's head-wise competition (same rule as kvpress AdaKV): each head
    first reserves its top ``int(safeguard * keep)`` rows, then all remaining (head, position)
    pairs of the layer compete for the rest of the layer budget. ``cap``: no head keeps more rows than
    this (its best ones), e.g. so that every head's rows fit the model's positions.
    """
    if scores.ndim != 3:
        raise ValueError(f"scores must have shape [B, H, N], got {tuple(scores.shape)}")
    check_head_budget(head_budget)
    B, H, N = scores.shape
    if not 1 <= keep <= N:
        raise ValueError(f"keep must be in [1, N={N}], got {keep}")
    pinned = pin_sinks(scores.astype(mx.float32), n_sink)
    if head_budget == "uniform":
        idx, _ = ascending_positions(topk_mask(pinned, keep), keep)
        return Selection(idx, mx.full((B, H), keep, dtype=mx.int32))
    n_safe = int(keep * safeguard)
    if n_safe > 0:
        pinned = mx.where(topk_mask(pinned, n_safe), mx.inf, pinned)
    mask = topk_mask(pinned.reshape(B, H * N), H * keep).reshape(B, H, N)
    if cap is not None and cap < N:  # a head's kept rows are its best: the cap keeps the best of those
        mask = mask & topk_mask(pinned, max(cap, keep))
    counts = mx.sum(mask, axis=-1).astype(mx.int32)
    k_max = int(mx.max(counts).item())
    idx, valid = ascending_positions(mask, k_max)
    if bool(mx.all(valid).item()):
        return Selection(idx, counts)
    return Selection(idx, counts, valid)
