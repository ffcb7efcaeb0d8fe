"""Scoring state for ``prefill="streaming"``: what a layer must remember to score its stored rows while the
context is still arriving (spec, "Streaming variant").

``StreamState`` keeps what every press needs: the positions seen, each stored row's original position, and
the rows' per-press features, gathered with the cache's rows at each eviction. What a press remembers
beyond that is its ``stream_scorer`` (``press.stream_scorer``): ``StreamScorer`` remembers nothing and
scores the stored keys with the press's own ``score`` (knorm, streaming_llm, random); ``AnchorScorer`` keeps
the running sum of the unit keys of every token seen, evicted ones included (KeyDiff); NestedKV's adds its
block and window cosines (``nestedkv.press.nestedkv``).

A press with ``unrotate`` sees every key rotated back by its own position (``nestedkv.rope``): each chunk
as it arrives (the anchors and cosines), and the stored rows, by their original positions, at each
eviction; a stream that never evicts still scores as the whole context does.

Under adaptive budgets heads keep different counts: the cache hands its rows over padded per head (for the
time of one eviction), ``valid`` [B, H, R] marks the real ones, and every statistic ignores the others.
"""

from __future__ import annotations

import copy
from typing import ClassVar, Optional

import mlx.core as mx

from nestedkv import scoring
from nestedkv.rope import at_positions, required

# Every saved stream holds these keys (None or 0 where its press keeps no such statistic), so that saved
# files keep the one format they have had since streaming began.
_SAVED = {"block_start": 0, "block": 0, "g_sum": None, "carry": None, "block_keys": None}
_SAVED_ROWS = ("pos", "cos_e", "cos_c")

_unit, _cos = scoring._unit, scoring._cos


class StreamScorer:
    """A press's streaming memory; this one keeps none and scores the stored keys with ``press.score``."""

    features: ClassVar[tuple[str, ...]] = ()  # per-row features, kept aligned with the stored rows

    def __init__(self, press, context_len: Optional[int]):
        self.press = press

    def observe(self, keys: mx.array, p0: int, rows: dict) -> dict:
        """Fold a new chunk ``[B,H,n,D]`` at positions ``p0..`` in; return its rows' features. ``rows``: the
        stored rows' features, which a scorer may refresh in place."""
        return {}

    def scores(self, keys: mx.array, rows: dict, valid: Optional[mx.array]) -> mx.array:
        return self.press.score(keys)

    def arrays(self) -> list:
        return []

    def to_state(self) -> dict:
        return {}

    @classmethod
    def from_state(cls, press, state: dict) -> "StreamScorer":
        return cls(press, None)


class AnchorScorer(StreamScorer):
    """KeyDiff's memory: the running sum of the unit keys of every token seen (the global anchor)."""

    def __init__(self, press, context_len: Optional[int]):
        super().__init__(press, context_len)
        self.g_sum: Optional[mx.array] = None  # [B,H,1,D] fp32

    def unit_keys(self, keys: mx.array) -> mx.array:
        """The chunk's unit keys, folded into the anchor."""
        ku = _unit(keys.astype(mx.float32))
        total = mx.sum(ku, axis=2, keepdims=True)
        self.g_sum = total if self.g_sum is None else self.g_sum + total
        return ku

    def observe(self, keys, p0, rows):
        self.unit_keys(keys)
        return {}

    def stable(self, keys: mx.array) -> mx.array:
        """Cosine of each stored key with the anchor."""
        ku = _unit(keys.astype(mx.float32))
        dots = (ku @ self.g_sum.swapaxes(-1, -2))[..., 0]
        return _cos(dots, mx.linalg.norm(self.g_sum, axis=-1))

    def scores(self, keys, rows, valid):
        return -self.stable(keys)

    def arrays(self):
        return [] if self.g_sum is None else [self.g_sum]

    def to_state(self):
        return {"g_sum": self.g_sum}

    @classmethod
    def from_state(cls, press, state):
        s = cls.__new__(cls)
        s.press, s.g_sum = press, state["g_sum"]
        return s


class StreamState:
    """Per-layer running statistics of a streaming prefill; rows are aligned with the cache's stored rows."""

    def __init__(self, press, context_len: Optional[int]):
        self._start(press, press.stream_scorer(press, context_len))

    def _start(self, press, scorer: StreamScorer) -> None:
        self.press, self.scorer = press, scorer
        self.seen = 0  # positions observed
        self.evicted = False
        # pos: each row's position in the document; rot: the position its key is rotated by (the same
        # until ``reposition`` moves the rows to fit the model's window). Each [B,H,R].
        self.rows: dict[str, Optional[mx.array]] = {k: None for k in ("pos", "rot", *scorer.features)}

    # -- feeding ---------------------------------------------------------------------------------
    def observe(self, keys: mx.array, unrope=None, rot0: Optional[int] = None) -> dict:
        """Update the running statistics with a new chunk ``[B,H,n,D]``; return the new rows' features (append
        them with ``append`` once the old rows are evicted). ``unrope``: the model's inverse rope, for a press
        that scores unrotated keys; ``rot0``: the position the chunk's first key is rotated by (default: its
        position in the document)."""
        B, H, n, _ = keys.shape
        p0 = self.seen
        rot0 = p0 if rot0 is None else rot0
        self.seen += n
        new = {k: mx.broadcast_to(mx.arange(a, a + n, dtype=mx.int32), (B, H, n)) for k, a in (("pos", p0),
                                                                                             ("rot", rot0))}
        if self.press.unrotate:  # the scorers see the chunk as they see the stored rows in ``scores``
            keys = required(unrope, self.press.name)(keys, rot0)
        return {**new, **self.scorer.observe(keys, p0, self.rows)}

    def reposition(self, keys: mx.array, unrope) -> mx.array:
        """The stored rows' keys ``[B,H,R,D]`` rotated to positions 0..R-1 in row order (StreamingLLM's
        positions within the cache), so that a document longer than the model's window never reaches a
        position beyond it; the rotation is done in fp32, and rows that do not move are left exact."""
        slots = mx.broadcast_to(mx.arange(keys.shape[2], dtype=mx.int32), self.rows["rot"].shape)
        back = mx.maximum(self.rows["rot"] - slots, 0)  # rows keep their order, so no row moves forward
        moved = at_positions(required(unrope, "reposition"), keys.astype(mx.float32), back).astype(keys.dtype)
        self.rows["rot"] = slots
        return mx.where((back > 0)[..., None], moved, keys)

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
        return [*self.scorer.arrays(), *(a for a in self.rows.values() if a is not None)]

    def copy(self) -> "StreamState":
        """An independent copy (arrays are immutable and shared; the statistics are rebound, never written)."""
        out = copy.copy(self)
        out.scorer, out.rows = copy.copy(self.scorer), dict(self.rows)
        return out

    # -- scoring ---------------------------------------------------------------------------------
    def scores(self, keys: mx.array, valid: Optional[mx.array], unrope=None) -> mx.array:
        """Scores ``[B,H,R]`` of the stored rows ``keys`` [B,H,R,D]; invalid (padded) rows get -inf."""
        if self.press.unrotate:
            keys = at_positions(required(unrope, self.press.name), keys, self.rows["rot"])
        s = self.scorer.scores(keys, self.rows, valid)
        return s if valid is None else mx.where(valid, s, -mx.inf)

    # -- save / load -----------------------------------------------------------------------------
    def to_state(self) -> dict:
        rows = {f"row_{k}": self.rows.get(k) for k in _SAVED_ROWS}
        return {"seen": self.seen, "evicted": int(self.evicted), **_SAVED, **self.scorer.to_state(), **rows,
                **{f"row_{k}": v for k, v in self.rows.items()}}

    @classmethod
    def from_state(cls, press, state: dict) -> "StreamState":
        s = cls.__new__(cls)
        s._start(press, press.stream_scorer.from_state(press, state))
        s.seen, s.evicted = int(state["seen"]), bool(state["evicted"])
        s.rows = {k: state.get(f"row_{k}") for k in s.rows}
        if s.rows["rot"] is None:  # saved before rows could be repositioned: rotated by their positions
            s.rows["rot"] = s.rows["pos"]
        return s
