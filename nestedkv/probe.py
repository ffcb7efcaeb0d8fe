"""Forward passes after a prefilled context that store nothing and show each layer's queries: what presses
scoring keys with the model (``BasePress.needs_model``: KVzip's reconstruction, Expected Attention's query
statistics) read before eviction.

Each layer runs on a ``ProbeCache``: the context's stored rows plus the fed chunk, the chunk dropped after the
call, so every fed chunk attends to the whole context and nothing else. ``attention.attention`` hands the
queries and keys of every call to the cache's ``observe``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, create_attention_mask

from nestedkv import _cpu
from nestedkv.attention import LOG2E, MIN_ROWS, install_attention_hook, numpy_softmax, row_plan


@dataclass(frozen=True)
class Instruction:
    """What a press feeds after the context before repeating a chunk of it (KVzip's "repeat the context"), in
    the model's tokens: ``first`` before the first chunk; ``resume`` before each later one, followed by the
    last tokens before that chunk (where the repetition resumes); ``suffix`` after either (a chat template's
    change to the assistant's turn). A plain token list is ``first`` and ``resume`` alike, with no suffix."""

    first: tuple = ()
    resume: Optional[tuple] = None  # None: first
    suffix: tuple = ()

    @classmethod
    def of(cls, prompt) -> "Instruction":
        if isinstance(prompt, cls):
            return prompt
        return cls(tuple(int(t) for t in prompt))

    def feed(self, resume_after: Sequence[int], chunk: Sequence[int], first: bool) -> list[int]:
        """The tokens fed to repeat ``chunk``, ``resume_after`` being the context just before it."""
        head = list(self.first) if first else [*(self.first if self.resume is None else self.resume), *resume_after]
        return [*head, *self.suffix, *chunk]


class ProbeCache(KVCache):
    """One layer's context rows ``[B, H, n, D]``; a fed chunk's rows are attended to, never kept."""

    def __init__(self, keys: mx.array, values: mx.array, observe: Callable, start: Optional[int] = None):
        super().__init__()
        self.ctx_keys, self.ctx_values = keys, values
        self.n = keys.shape[2]
        self.start = self.n if start is None else start  # the position of the first fed token
        self.offset = self.start
        self.observe = observe  # (queries [B, Hq, L, D], keys [B, H, n + L, D], values, scale) -> output or None

    def make_mask(self, N, return_array=False, window_size=None):
        # The keys are the rows held and the fed ones, whatever position the feed starts at.
        return create_attention_mask(N, offset=self.n, return_array=return_array, window_size=window_size)

    def update_and_fetch(self, keys, values):
        self.offset += keys.shape[2]
        return (mx.concatenate([self.ctx_keys, keys], axis=2), mx.concatenate([self.ctx_values, values], axis=2))


def probe(model, cache, feeds: Sequence[Sequence[int]], observe: Callable, press_name: str,
          rows: Optional[int] = None, streaming: bool = False) -> None:
    """Feed each token list of ``feeds`` after the context of ``cache`` (uncompressed, all positions stored),
    or after its first ``rows`` rows only (feeding the rest again recomputes their own queries);
    ``observe(layer, queries, keys, values, scale)`` sees every layer of every feed. Nothing is stored.
    ``streaming``: the cache is mid-way through a streaming prefill (uniform budgets): feed after the rows it
    holds now, at the position its next chunk would take. Yields after each feed, so the caller evaluates what
    it gathered."""
    unrouted = [c.facts.writer for c in cache if c.facts is not None and not c.facts.routed]
    if not install_attention_hook(model, required=False) or unrouted:
        which = f"its attention ({unrouted[0]})" if unrouted else type(model).__module__
        raise ValueError(f"press {press_name!r} reads the model's queries: {which} does not call "
                         "mlx-lm's scaled_dot_product_attention; use a key-only press (e.g. nestedkv)")
    probes = []
    for i, c in enumerate(cache):
        start = None
        if streaming:
            if c.compressed or c.stream is None:
                raise ValueError(f"press {press_name!r} steers a streaming prefill: layer {i} is not streaming")
            start = c.offset  # first: it moves the rows into the window when the next chunk would pass it
            k, v, valid = c._rows()
            if valid is not None:
                raise ValueError(f"press {press_name!r} steers a streaming prefill with uniform head budgets only")
        elif c.compressed or c.kept is not None or c.stream is not None:
            raise ValueError(f"press {press_name!r} scores the whole context with the model: layer {i} already "
                             "evicted rows")
        else:
            end = c.stored if rows is None else rows
            k, v = c.keys[..., :end, :], c.values[..., :end, :]
        probes.append(ProbeCache(k, v, lambda q, kk, vv, s, i=i: observe(i, q, kk, vv, s), start))
    for ids in feeds:
        model(mx.array(list(ids), dtype=mx.int32)[None], cache=probes)  # the logits are never evaluated
        for p in probes:
            p.offset = p.start
        yield


SCORE_BYTES = 64 * 2**20  # fp32 scores held at once while scoring (per block of fed rows), on every device


def peak_context_weights(queries: mx.array, keys: mx.array, scale: float, n: int, total: bool = False) -> mx.array:
    """The most softmax weight each of the first ``n`` (context) keys gets from any fed row, ``[B, H, n]``, fp32,
    query heads grouped by KV head (``total``: the sum of its weights over the fed rows and the group's query
    heads instead); each fed row sees the context and the fed rows up to itself (causal, aligned to the end of
    ``keys``). By blocks of fed rows, each reduced before the next is scored, so the scores held at once stay
    within ``SCORE_BYTES`` whatever the context's length and the device. On the CPU fast path each block's
    softmax runs in NumPy over the cores, as the layers' own attention (mlx's CPU softmax runs on one thread)."""
    B, Hq, L, D = queries.shape
    S = keys.shape[2]
    rows = max(1, min(L, SCORE_BYTES // (4 * B * Hq * S)))
    peak = None
    for a in range(0, L, rows):
        b = min(L, a + rows)
        block = _block_peak(queries[:, :, a:b], keys[:, :, : S - L + b], scale, n, total)
        peak = block if peak is None else (peak + block if total else mx.maximum(peak, block))
        mx.eval(peak)  # the block's scores are freed before the next block is scored
    return peak


def _block_peak(queries: mx.array, keys: mx.array, scale: float, n: int, total: bool = False) -> mx.array:
    """``peak_context_weights`` for the last ``L`` fed rows over ``keys`` (aligned to their end), in one go."""
    B, Hq, L, D = queries.shape
    H, S = keys.shape[1], keys.shape[2]
    g = Hq // H
    q, k = queries.astype(mx.float32), keys.astype(mx.float32)
    plan = row_plan(B, Hq, L, S, _cpu.streams_for(L // MIN_ROWS)) if _cpu.fast() else []
    if plan:
        reduce = (lambda w: w[..., :n].sum(axis=(2, 3))) if total else (lambda w: w[..., :n].max(axis=(2, 3)))
        _, _, peaks = numpy_softmax(q, k, scale, True, plan, reduce=reduce)
        return mx.array((np.add if total else np.maximum).reduce(peaks))
    # log2 e folded into the queries: exp as a power of 2, about three times cheaper than exp on the CPU
    s = (q * (scale * LOG2E)).reshape(B, H, g * L, D) @ k.swapaxes(-1, -2)
    row = mx.tile(mx.arange(L), g)[:, None]  # the fed position of each grouped query row
    s = mx.where(mx.arange(S)[None] - (S - L) <= row, s, -mx.inf)
    p = mx.power(2.0, s - mx.max(s, axis=-1, keepdims=True))
    p = p / mx.sum(p, axis=-1, keepdims=True)
    return mx.sum(p[..., :n], axis=2) if total else mx.max(p[..., :n], axis=2)
