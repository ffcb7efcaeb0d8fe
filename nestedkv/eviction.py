"""Eviction while prefilling (``prefill="streaming"``), and reading a streaming document longer than the
model's window (``make_cache(..., positions=P)``).

``stream_step``: before a chunk is appended, a layer whose stored rows exceed the budget is scored and
evicted down to it, so it never holds more than budget + chunk rows per head (per layer on average under
adaptive budgets) and the chunk attends to the kept rows only.

Past the window: each head keeps at most ``P - 2 chunks`` rows (``row_cap``), and whenever the next chunk
would reach position ``P`` the stored keys are rotated to positions 0..R-1 in row order (``move_rows``; StreamingLLM's
positions within the cache), so the model never attends at a position beyond its window, whatever the
document's length. Rows move only between chunks: the model reads the cache's ``offset`` for the next
chunk's rope before it hands the chunk over, and that read does a pending move first. After the last chunk
the kept rows are moved once more, so the question follows them at position R.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from nestedkv import buffers as buf
from nestedkv.selection import Selection, ascending_positions
from nestedkv.streaming import StreamState


def row_cap(cache) -> Optional[int]:
    """The most rows a head may keep past the window: room for them, the next chunk and the one after
    (rows move only between chunks); None without a position limit."""
    if cache.positions is None:
        return None
    cap = cache.positions - 2 * cache._chunk
    if cap <= cache.press.n_sink:
        raise ValueError(f"a document past the window needs positions > 2 chunks + sinks: {cache.positions} "
                         f"positions for chunks of {cache._chunk} tokens; use smaller chunks")
    return cap


def move_rows(cache) -> None:
    """Every stored row of ``cache`` (each head's real rows first) rotated to positions 0..R-1; the next
    chunk starts at R (``StreamState.reposition``)."""
    cache._reposition = False
    keys, values, valid = cache._rows()
    B, H, R = buf.parts(keys)[0].shape[:3]
    if valid is None:
        sel = Selection(mx.broadcast_to(mx.arange(R, dtype=mx.int32), (B, H, R)), mx.full((B, H), R, mx.int32))
    else:
        counts = mx.sum(valid, axis=-1).astype(mx.int32)
        idx, ok = ascending_positions(valid, int(mx.max(counts).item()))
        sel = Selection(idx, counts, None if bool(mx.all(ok).item()) else ok)
    cache._gather(keys, values, sel)
    cache.stream.take(sel.indices)
    cache.keys = cache.stream.reposition(cache.keys, cache.unrope)
    cache._unpad()
    cache.offset = cache.stored
    mx.eval(cache.layout.buffers(), cache.stream.arrays())


def stream_step(cache, keys) -> None:
    """Before appending a chunk: fold it into the running statistics, then evict the stored rows down to
    the budget when they exceed it, so this chunk attends to kept rows only (<= budget + chunk rows)."""
    if cache.planned_len is None and cache.press.budget is None and cache.press.compression_ratio > 0:
        raise ValueError(
            f"streaming prefill with compression_ratio={cache.press.compression_ratio} needs the document's "
            "token count: make_cache(model, press, context_len=N)"
        )
    seen = cache.positions_seen + keys.shape[2]
    if cache.planned_len is not None and seen > cache.planned_len:
        raise ValueError(
            f"streaming prefill: context_len={cache.planned_len} was planned but {seen} positions were fed"
        )
    cache._chunk = max(cache._chunk, keys.shape[2])
    if cache.positions is not None and cache._offset + keys.shape[2] > cache.positions:
        raise ValueError(f"a chunk of {keys.shape[2]} tokens at position {cache._offset} passes the "
                         f"{cache.positions} positions the context may use: keep the chunk size fixed")
    keep = cache._keep()
    if keep is None:
        return  # nothing will ever be evicted: plain appends, bit-identical to KVCache
    if cache.stream is None:
        if cache.stored:
            raise ValueError("a streaming press must see the context from its first chunk (clone it earlier)")
        cache.stream = StreamState(cache.press, cache.planned_len)
    new = cache.stream.observe(keys, cache.unrope, rot0=cache._offset)
    too_long = cache.positions is not None and cache.stored > row_cap(cache)  # a head past its cap
    if cache._rows_kept() > keep * keys.shape[1] or too_long:
        cache._evict(keep)
    cache.stream.append(new)
    mx.eval(cache.stream.arrays())
