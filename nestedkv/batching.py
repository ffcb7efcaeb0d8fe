"""Batching compressed caches for decode: ``stack`` several into one, ``take`` entries back out."""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from nestedkv import buffers as buf
from nestedkv.kvcache import NestedKVCache
from nestedkv.layouts import Dense
from nestedkv.press import NoPress


def stack(caches: Sequence[list]) -> list:
    """Batch compressed caches for decode: one cache per layer with B = len(caches) (each entry B = 1).

    Entries may hold different contexts (documents of different lengths) and different appended rows
    (their questions): row layout per entry and head is ``[its kept context rows | padding | its appended
    rows]``, all entries ending at the same row; ``valid`` marks the padding, which
    ``attention.attention`` masks per entry and head, and ``offset`` becomes one position per entry
    (RoPE takes an array of offsets) when they differ. New tokens are appended for all entries at once.
    Not supported: uncompressed caches, and mlx-lm's ``merge``/``BatchKVCache`` (refused).
    """
    out = []
    for i, layer in enumerate(zip(*caches)):
        if not all(isinstance(c, NestedKVCache) for c in layer):
            raise ValueError(f"stack batches full-attention layers only; layer {i} of this hybrid model is a "
                             f"{type(layer[0]).__name__} (sliding window or state): decode its documents one "
                             "at a time")
        if not all(c.compressed for c in layer):
            raise ValueError("stack needs compressed caches (compress each before decoding them together)")
        quant = {c.quant for c in layer}
        if len(quant) > 1:
            raise ValueError(f"stack needs caches quantized alike (kv_bits, kv_group_size, kv_hadamard); got "
                             f"{sorted(map(str, quant))}")
        rows = max(c.n_ctx_rows + c.appended for c in layer)
        ks, vs, valid = [], [], []
        for c in layer:
            k, v, ok = c.padded()
            B, H = buf.parts(k)[0].shape[:2]
            n, a = c.n_ctx_rows, c.appended
            pad = rows - n - a
            ks.append(buf.cat([buf.rows_of(k, 0, n), buf.zeros(k, B, H, pad), buf.rows_of(k, n, n + a)]))
            vs.append(buf.cat([buf.rows_of(v, 0, n), buf.zeros(v, B, H, pad), buf.rows_of(v, n, n + a)]))
            ok = ok if ok is not None else mx.ones((B, H, n), dtype=mx.bool_)
            valid.append(mx.concatenate([ok, mx.zeros((B, H, pad), dtype=mx.bool_), mx.ones((B, H, a), dtype=mx.bool_)],
                                        axis=2))
        offsets = [c.offset for c in layer]
        s = NestedKVCache(NoPress())
        s.layout = Dense(buf.cat(ks, axis=0), buf.cat(vs, axis=0), mx.concatenate(valid, axis=0))
        s.set_quant(next(iter(quant)))
        s.kept = mx.concatenate([c.kept for c in layer], axis=0)
        s.offset = offsets[0] if len(set(offsets)) == 1 else mx.array(offsets, dtype=mx.int32)
        s.context_len, s.n_ctx_rows = max(c.context_len for c in layer), rows
        s.stored = rows
        s._note_peak()
        out.append(s)
    return out


def take(stacked: list, rows: Sequence[int]) -> list:
    """The entries at batch positions ``rows`` of a cache made by ``stack``, as a stacked cache of their own:
    entries that finished decoding leave the batch, so later steps compute only the others."""
    rows = list(rows)
    for c in stacked:
        if not isinstance(c, NestedKVCache) or c.valid is None or c.keys is None:
            raise TypeError("take needs a cache made by nestedkv.stack")
    B = buf.parts(stacked[0].keys)[0].shape[0] if stacked else 0
    if not rows or any(not 0 <= r < B for r in rows):
        raise ValueError(f"rows must be positions in the batch of {B}, got {rows}")
    idx = mx.array(rows, dtype=mx.int32)
    out = []
    for c in stacked:
        s = NestedKVCache(NoPress())
        s.layout = Dense(*(buf.map_parts(lambda x: x[idx], b) for b in (c.keys, c.values)), c.valid[idx])
        s.kept = c.kept[idx]
        s.set_quant(c.quant)
        s.offset = c.offset if isinstance(c.offset, int) else c.offset[idx]
        s.context_len, s.n_ctx_rows, s.stored = c.context_len, c.n_ctx_rows, c.stored
        s._note_peak()
        out.append(s)
    return out
