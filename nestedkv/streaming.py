"""Scoring state for ``prefill="streaming"``: what a layer must remember to score its stored rows while the
context is still arriving (spec, "Streaming variant").

NestedKV keeps, per layer:
- the global anchor as the running sum of the unit keys of EVERY token seen (evicted ones included);
- per stored row, its block cosine and window cosine, computed from the original sequence: the window one
  when the token arrives (the last ``window - 1`` unit keys are carried across chunks), the block one against
  the unit keys of its block seen so far (provisional while the block is incomplete, final once it completes;
  the last block of a document is complete at its end, as in whole-context scoring);
- per stored row, its original position.
Min-max normalization, the tail gaps (head-adaptive weights) and the surprise gate are recomputed over the
stored rows at each eviction: the approximate part. KeyDiff keeps the running anchor too; other presses score
the stored keys with their own ``score`` (knorm, streaming_llm and random need no history).

A press with ``unrotate`` sees every key rotated back by its own position (``nestedkv.rope``): each chunk
as it arrives (the anchors and cosines above), and the stored rows, by their original positions, at each
eviction; a stream that never evicts still scores as the whole context does.

Under adaptive budgets heads keep different counts: the cache hands its rows over padded per head (for the
time of one eviction), ``valid`` [B, H, R] marks the real ones, and every statistic below ignores the others.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np

from nestedkv import scoring
from nestedkv.rope import at_positions, required

_FEATURES = ("pos", "cos_e", "cos_c")
EPS = scoring.EPS


# The same building blocks as whole-context scoring, so a stream that never evicts scores identically.
_unit, _cos = scoring._unit, scoring._cos
block_cosine, window_cosine = scoring.block_cosine, scoring.window_cosine


class StreamState:
    """Per-layer running statistics of a streaming prefill; rows are aligned with the cache's stored rows."""

    def __init__(self, press, context_len: Optional[int]):
        self._bind(press)
        if self.nested and press.block is None and context_len is None:
            raise ValueError(
                "streaming NestedKV needs the document's token count for its block size: "
                "make_cache(model, press, context_len=N) (or set the press's block)"
            )
        self.block = (press.block or scoring.block_size(context_len)) if self.nested else 0
        self.seen = 0  # positions observed
        self.evicted = False
        self.g_sum: Optional[mx.array] = None  # [B,H,1,D] fp32 running sum of unit keys
        self.carry: Optional[mx.array] = None  # [B,H,<window,D] last unit keys (window anchor)
        self.block_keys: Optional[mx.array] = None  # [B,H,<block,D] unit keys of the open block
        self.block_start = 0  # position of the open block's first token
        self.rows: dict[str, Optional[mx.array]] = {k: None for k in _FEATURES}  # each [B,H,R]

    def _bind(self, press) -> None:
        self.press = press
        self.nested = press.name == "nestedkv"
        self.anchored = press.name in ("nestedkv", "keydiff")
        self.window = press.window if self.nested else 0

    # -- feeding ---------------------------------------------------------------------------------
    def observe(self, keys: mx.array, unrope=None) -> dict:
        """Update the running statistics with a new chunk ``[B,H,n,D]``; return the new rows' features (append
        them with ``append`` once the old rows are evicted). Pending block cosines of stored rows are refreshed.
        ``unrope``: the model's inverse rope, for a press that scores unrotated keys."""
        B, H, n, _ = keys.shape
        p0 = self.seen
        self.seen += n
        new = {"pos": mx.broadcast_to(mx.arange(p0, p0 + n, dtype=mx.int32), (B, H, n))}
        if not self.anchored:
            return new
        if self.press.unrotate:
            keys = required(unrope, self.press.name)(keys, p0)
        ku = _unit(keys.astype(mx.float32))
        total = mx.sum(ku, axis=2, keepdims=True)
        self.g_sum = total if self.g_sum is None else self.g_sum + total
        if not self.nested:
            return new
        # Window: this chunk plus the carried keys, so each new token sees its full trailing window.
        ext = ku if self.carry is None else mx.concatenate([self.carry, ku], axis=2)
        new["cos_c"] = window_cosine(ext, self.window)[:, :, ext.shape[2] - n :]
        self.carry = ext[:, :, max(0, ext.shape[2] - (self.window - 1)) :]
        # Blocks: cosines of every token of the open block(s); a trailing partial block is provisional.
        cur = ku if self.block_keys is None else mx.concatenate([self.block_keys, ku], axis=2)
        cos = block_cosine(cur, self.block)  # [B,H,L], positions block_start..
        new["cos_e"] = cos[:, :, cur.shape[2] - n :]
        if self.rows["pos"] is not None:
            rel = self.rows["pos"] - self.block_start
            pending = rel >= 0
            got = mx.take_along_axis(cos, mx.clip(rel, 0, cos.shape[2] - 1), axis=2)
            self.rows["cos_e"] = mx.where(pending, got, self.rows["cos_e"])
        done = (cur.shape[2] // self.block) * self.block
        self.block_start += done
        self.block_keys = cur[:, :, done:]
        return new

    def append(self, new: dict) -> None:
        for k, v in new.items():
            old = self.rows[k]
            self.rows[k] = v if old is None else mx.concatenate([old, v], axis=2)

    def take(self, idx: mx.array) -> None:
        """Keep the rows at ``idx`` [B,H,K] (the same gather as the cache's keys)."""
        for k, v in self.rows.items():
            if v is not None:
                self.rows[k] = mx.take_along_axis(v, idx, axis=2)
        self.evicted = True

    def arrays(self) -> list:
        return [a for a in (self.g_sum, self.carry, self.block_keys, *self.rows.values()) if a is not None]

    # -- scoring ---------------------------------------------------------------------------------
    def scores(self, keys: mx.array, valid: Optional[mx.array], unrope=None) -> mx.array:
        """Scores ``[B,H,R]`` of the stored rows ``keys`` [B,H,R,D]; invalid (padded) rows get -inf."""
        if self.press.unrotate:
            keys = at_positions(required(unrope, self.press.name), keys, self.rows["pos"])
        if self.nested:
            s = self._nestedkv(keys, valid)
        elif self.anchored:
            s = -self._stable(keys)
        else:
            s = self.press.score(keys)
        return s if valid is None else mx.where(valid, s, -mx.inf)

    def _stable(self, keys):
        ku = _unit(keys.astype(mx.float32))
        dots = (ku @ self.g_sum.swapaxes(-1, -2))[..., 0]
        return _cos(dots, mx.linalg.norm(self.g_sum, axis=-1))

    def _nestedkv(self, keys, valid):
        p = self.press
        raw = -mx.stack([self._stable(keys), self.rows["cos_e"], self.rows["cos_c"]], axis=-1)  # [B,H,R,3]
        return combine(raw, valid, prior=p.prior, beta=p.beta, tail=p.tail, tau=p.tau, kappa=p.kappa,
                       use_gate=p.use_gate, scales=p.scales)

    # -- save / load -----------------------------------------------------------------------------
    def to_state(self) -> dict:
        return {
            "seen": self.seen, "evicted": int(self.evicted), "block_start": self.block_start,
            "block": self.block, "g_sum": self.g_sum, "carry": self.carry, "block_keys": self.block_keys,
            **{f"row_{k}": v for k, v in self.rows.items()},
        }

    @classmethod
    def from_state(cls, press, state: dict) -> "StreamState":
        s = cls.__new__(cls)
        s._bind(press)
        s.seen, s.evicted = int(state["seen"]), bool(state["evicted"])
        s.block_start, s.block = int(state["block_start"]), int(state["block"])
        s.g_sum, s.carry, s.block_keys = state["g_sum"], state["carry"], state["block_keys"]
        s.rows = {k: state[f"row_{k}"] for k in _FEATURES}
        return s


# -- NestedKV's outer learner over (possibly padded) stored rows ------------------------------------------
def _masked_minmax(x: mx.array, valid: Optional[mx.array]) -> mx.array:
    """Min-max along axis 2 over valid rows only; ``valid`` broadcasts against ``x``."""
    if valid is None:
        valid = mx.array(True)
    lo = mx.min(mx.where(valid, x, mx.inf), axis=2, keepdims=True)
    span = mx.max(mx.where(valid, x, -mx.inf), axis=2, keepdims=True) - lo
    out = mx.where(span > EPS, (x - lo) / mx.maximum(span, EPS), 0.0)
    return mx.where(valid, out, 0.0)


def _tail_gap(x: mx.array, valid: Optional[mx.array], tail: float) -> mx.array:
    """Mean of the top ``tail`` share minus mean of the bottom share of each head's valid rows: x [B,H,R,S]."""
    B, H, R, _ = x.shape
    if valid is None:
        valid = mx.ones((B, H, R), dtype=mx.bool_)
    # q = max(1, ceil(tail * n)) in float64, as scoring.tail_gap does in Python (0.1 * 700 differs in fp32).
    counts = np.array(mx.sum(valid, axis=2)).astype(np.float64)  # [B,H]
    q = mx.array(np.maximum(1, np.ceil(tail * counts)).astype(np.float32))[:, :, None, None]
    v = valid[..., None]
    rank = mx.arange(R)[None, None, :, None]
    lo = mx.sort(mx.where(v, x, mx.inf), axis=2)  # valid rows first, ascending
    hi = mx.sort(mx.where(v, x, -mx.inf), axis=2)  # valid rows last, ascending
    bottom = mx.sum(mx.where(rank < q, lo, 0.0), axis=2)
    top = mx.sum(mx.where(rank >= R - q, hi, 0.0), axis=2)
    return (top - bottom) / q[:, :, 0, :]


def combine(
    raw: mx.array,
    valid: Optional[mx.array] = None,
    *,
    prior=scoring.PRIOR,
    beta: float = scoring.BETA,
    tail: float = scoring.TAIL,
    tau: float = scoring.TAU,
    kappa: float = scoring.KAPPA,
    use_gate: bool = True,
    scales=(True, True, True),
) -> mx.array:
    """NestedKV's score from raw per-scale anomalies ``[B,H,R,3]`` (= -cosines): min-max per scale, head-adaptive
    mixing, surprise gate; the same steps as ``scoring.nestedkv_scores`` restricted to the valid rows."""
    vm = None if valid is None else valid[..., None]
    at = _masked_minmax(raw, vm)
    if not all(scales):  # the press validated that at least one is on
        at = at[..., [i for i, on in enumerate(scales) if on]]
        prior = tuple(p for p, on in zip(prior, scales) if on)
    gap = _tail_gap(at, valid, tail)
    w = mx.softmax(mx.log(mx.array(prior, dtype=mx.float32)) + beta * gap, axis=-1)
    blend = mx.sum(at * w[:, :, None, :], axis=-1)
    if not use_gate or at.shape[-1] == 1:
        return blend
    surprise = _masked_minmax(mx.sqrt(mx.var(at, axis=-1)), valid)
    if valid is None:
        surprise = surprise - mx.mean(surprise, axis=2, keepdims=True)
    else:
        n = mx.sum(valid, axis=2, keepdims=True).astype(mx.float32)
        surprise = surprise - mx.sum(surprise, axis=2, keepdims=True) / mx.maximum(n, 1.0)
    gate = mx.sigmoid(kappa * (surprise - tau))
    return (1.0 - gate) * blend + gate * mx.max(at, axis=-1)

