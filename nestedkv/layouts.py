"""How one layer holds its rows, per KV head ``[ kept context rows | appended rows | free ]``: two classes
behind one interface, chosen by the cache (``kvcache.py``).

- ``Dense``: ``keys``/``values`` ``[B, H, rows, D]``, every head the same row count (uniform budgets, no press).
  With ``valid`` ``[B, H, n_ctx_rows]`` it is the padded layout: shorter heads are padded and
  ``attention.head_mask`` hides the padding (``stack``'s batches, adaptive budgets with B > 1).
- ``PerHead``: adaptive budgets (B = 1) keep each head's rows without padding in one flat buffer
  ``flat_keys``/``flat_values`` ``[1, 1, sum of region sizes, D]``, one region per KV head
  ``[its kept rows | appended rows | free]``: resident bytes follow kept bytes, and one scatter (on the CPU, a
  slice update per head) appends a token to every head. The model gets ``HeadRows`` (the flat buffer and where
  each head's rows are), which ``attention.attention`` attends in one call, each query head masked to its KV
  head's rows (on the CPU, one call per KV head a decode step, in place).

``stored`` (the longest head's rows) and ``n_ctx`` (its context rows) belong to the cache, which passes them.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np

from nestedkv import _cpu
from nestedkv import buffers as buf


def pad_valid(valid: Optional[mx.array], rows: int) -> Optional[mx.array]:
    """``valid`` extended with real rows up to ``rows`` (the appended rows are never padded)."""
    if valid is None or valid.shape[2] >= rows:
        return valid
    B, H, R = valid.shape
    return mx.concatenate([valid, mx.ones((B, H, rows - R), dtype=mx.bool_)], axis=2)


class Dense:
    ragged_heads = False  # per-head views instead of one array per buffer

    def __init__(self, keys=None, values=None, valid: Optional[mx.array] = None):
        self.keys, self.values, self.valid = keys, values, valid

    @property
    def empty(self) -> bool:
        return self.keys is None

    @property
    def padded_heads(self) -> bool:
        """Rows that attention must not see (mlx-lm's attention would attend them)."""
        return self.valid is not None

    @property
    def batch_heads(self) -> tuple[int, int]:
        return tuple(buf.parts(self.keys)[0].shape[:2])

    def fetch(self, stored: int, n_ctx: int):
        if stored < buf.parts(self.keys)[0].shape[2]:
            return buf.rows_of(self.keys, 0, stored), buf.rows_of(self.values, 0, stored)
        return self.keys, self.values

    def append(self, keys, values, stored: int, n_ctx: int, step: int):
        self.keys = buf.grow(self.keys, stored, keys, step)
        self.values = buf.grow(self.values, stored, values, step)
        rows = (Ellipsis, slice(stored, stored + buf.parts(keys)[0].shape[2]), slice(None))
        buf.put(self.keys, rows, keys)
        buf.put(self.values, rows, values)

    def padded(self, stored: int, n_ctx: int, kept):
        k, v = self.fetch(stored, n_ctx)
        return k, v, self.valid

    def extend_context(self, tail: int, stored: int) -> None:
        """The ``tail`` appended rows join the context rows."""
        self.valid = pad_valid(self.valid, stored)

    def per_head(self) -> "PerHead":
        """Padded (B = 1) -> per-head, right after a selection: each KV head keeps exactly its real rows."""
        valid = np.array(self.valid[0])  # [H, R]
        B, H, R = self.valid.shape
        idx = mx.array(np.flatnonzero(valid.reshape(-1)).astype(np.int32))  # real rows, head-major
        flat_k = mx.take(self.keys[..., :R, :].reshape(B, 1, H * R, -1), idx, axis=2)
        flat_v = mx.take(self.values[..., :R, :].reshape(B, 1, H * R, -1), idx, axis=2)
        mx.eval(flat_k, flat_v)  # so the padded buffers can be freed
        counts = [int(x) for x in valid.sum(axis=1)]
        return PerHead(flat_k, flat_v, counts, list(counts))

    def quantize(self, qk, qv, stored: int) -> None:
        self.keys, self.values = qk(self.keys[..., :stored, :]), qv(self.values[..., :stored, :])

    def buffers(self) -> tuple:
        return self.keys, self.values

    @property
    def nbytes(self) -> int:
        return buf.nbytes(self.keys) + buf.nbytes(self.values)

    def copy(self, stored: int) -> "Dense":
        # New array objects: slice assignment rebinds the Python object in place, so sharing the objects
        # themselves would let the copy write into the original.
        if self.empty:
            return Dense(valid=self.valid)
        return Dense(buf.rows_of(self.keys, 0, stored), buf.rows_of(self.values, 0, stored), self.valid)

    def saved(self, stored: int, n_ctx: int) -> tuple:
        """(keys, values, head_keys, head_values) as the cache's state holds them."""
        k, v = (None, None) if self.empty else self.fetch(stored, n_ctx)
        return k, v, None, None


GROWTH = 64  # rows a per-head region grows by at the most (each head's free rows are attended, masked)


class HeadRows(list):
    """One per-head layer's keys (or values) as its model's attention gets them: the flat buffer ``flat``
    ``[1, 1, T, D]`` (a quantized triple too), each KV head's region start ``starts`` and context rows ``ctx``
    (``[H]`` int32 arrays; the lists ``starts_list``, ``ctx_list``), and the appended rows ``tail`` every head
    shares. To other code an empty list, so models pass it through to their attention unchanged
    (``nestedkv.introspect`` checks that a layer does)."""

    def __init__(self, flat, layout: "PerHead", tail: int):
        super().__init__()
        self.flat, self.tail, self.layout = flat, tail, layout
        self.starts_list, self.ctx_list = layout.starts, layout.head_rows

    @property
    def n_heads(self) -> int:
        return len(self.starts_list)

    def mask(self, n_q_heads: int, L: int) -> mx.array:
        """``[Hq * L, T]``: each flattened query row (head-major) may see its KV head's context rows and, of the
        rows appended, those up to its own position."""
        same, pos = self.layout.head_masks(n_q_heads, buf.parts(self.flat)[0].shape[2])
        if L == 1:
            return same & (pos < self.tail)[None]
        q_pos = mx.arange(L, dtype=mx.int32) + (self.tail - L + 1)
        return mx.repeat(same, L, axis=0) & (pos[None] < mx.tile(q_pos, n_q_heads)[:, None])

    def views(self) -> list:
        """Each head's rows ``[1, 1, ctx_h + tail, D]``."""
        return [buf.rows_of(self.flat, s, s + c + self.tail) for s, c in zip(self.starts_list, self.ctx_list)]


class PerHead:
    ragged_heads = True
    padded_heads = True  # mlx-lm's attention cannot take per-head views
    valid = None
    empty = False

    def __init__(self, flat_keys, flat_values, head_rows: list[int], head_cap: list[int]):
        self.flat_keys, self.flat_values = flat_keys, flat_values
        self.head_rows = head_rows  # kept context rows per head (lists are replaced, never changed in place)
        self.head_cap = head_cap  # rows of each head's region

    # The regions as lists (Python's loops) and as device arrays, made when they change, not per token.
    @property
    def head_cap(self) -> list[int]:
        return self._cap

    @head_cap.setter
    def head_cap(self, cap: list[int]) -> None:
        self._cap = cap
        self.starts = [int(x) for x in np.cumsum([0] + cap[:-1])]  # each region's first row
        self.device_starts = mx.array(self.starts, dtype=mx.int32)
        self._changed()

    def _changed(self) -> None:
        """The regions moved or their context grew: what is made from them is made again when next asked."""
        self._masks, self._first, self._padded = {}, None, None

    @property
    def head_rows(self) -> list[int]:
        return self._rows

    @head_rows.setter
    def head_rows(self, rows: list[int]) -> None:
        self._rows = rows
        self.device_rows = mx.array(rows, dtype=mx.int32)
        self._changed()

    def head_masks(self, n_q_heads: int, rows: int) -> tuple[mx.array, mx.array]:
        """For attention over the flat buffer of ``rows`` rows: ``[Hq, rows]`` whether a row is the query head's
        KV head's, and ``[rows]`` its place among its head's appended rows (negative: a context row). Made once
        per region layout, not per token."""
        key = (n_q_heads, rows)
        if key not in self._masks:
            row = mx.arange(rows, dtype=mx.int32)
            head = mx.sum(row[None] >= self.device_starts[1:, None], axis=0)
            q_head = mx.arange(n_q_heads, dtype=mx.int32) // (n_q_heads // len(self._rows))
            pos = row - self.device_starts[head] - self.device_rows[head]
            self._masks = {key: (head[None] == q_head[:, None], pos)}
            mx.eval(self._masks[key])
        return self._masks[key]

    def padded_slots(self, n_q_heads: int, tail: int) -> tuple[mx.array, mx.array]:
        """For a decode step over each KV head's region gathered to the largest region's length M: ``[H, M]``
        the flat row of each slot (past a region's end its last row again) and ``[1, Hq, 1, M]`` whether a
        slot is one of its head's rows (context, then ``tail`` appended). The rows, once per region layout;
        the mask, per step."""
        if self._padded is None:
            M = max(self._cap)
            slot = mx.arange(M, dtype=mx.int32)
            cap = mx.array(self._cap, dtype=mx.int32)
            rows = self.device_starts[:, None] + mx.minimum(slot[None], cap[:, None] - 1)
            self._padded = (rows, slot)
            mx.eval(self._padded)
        rows, slot = self._padded
        own = slot[None] < (self.device_rows + tail)[:, None]
        return rows, mx.repeat(own, n_q_heads // len(self._rows), axis=0)[None, :, None]

    @classmethod
    def from_heads(cls, keys: list, values: list, rows: list[int]) -> "PerHead":
        """From each head's rows (context then appended), regions exactly that long."""
        return cls(buf.cat(keys), buf.cat(values), rows, [buf.parts(k)[0].shape[2] for k in keys])

    @property
    def batch_heads(self) -> tuple[int, int]:
        return buf.parts(self.flat_keys)[0].shape[0], len(self.head_rows)

    def views(self, flat, tail: int) -> list:
        """Each head's rows ``[1, 1, rows_h + tail, D]`` (views of its region)."""
        out, off = [], 0
        for r, cap in zip(self.head_rows, self.head_cap):
            out.append(buf.rows_of(flat, off, off + r + tail))
            off += cap
        return out

    def fetch(self, stored: int, n_ctx: int):
        tail = stored - n_ctx
        return self.views(self.flat_keys, tail), self.views(self.flat_values, tail)

    def head_rows_of(self, stored: int, n_ctx: int) -> tuple[HeadRows, HeadRows]:
        """What the model's attention gets: the flat buffers and where each head's rows are."""
        tail = stored - n_ctx
        return HeadRows(self.flat_keys, self, tail), HeadRows(self.flat_values, self, tail)

    def append(self, keys, values, stored: int, n_ctx: int, step: int):
        tail = stored - n_ctx
        B, H, n, _ = buf.parts(keys)[0].shape
        if any(r + tail + n > cap for r, cap in zip(self.head_rows, self.head_cap)):
            # Every region grows by whole steps (heads share the appended count); smaller ones than KVCache's,
            # since attention reads the free rows of every region too (masked).
            step = min(step, GROWTH)
            extra = ((n + step - 1) // step) * step
            ks, vs = self.fetch(stored, n_ctx)
            zk, zv = buf.zeros(keys, B, 1, extra), buf.zeros(values, B, 1, extra)
            self.flat_keys = buf.cat([x for k in ks for x in (k, zk)])
            self.flat_values = buf.cat([x for v in vs for x in (v, zv)])
            self.head_cap = [buf.parts(k)[0].shape[2] + extra for k in ks]
        if n == 1 and _cpu.fast():
            # The CPU's scatter copies the whole buffer (4.8 against 1.8 ms a step over 60 buffers of 4k rows):
            # a slice update per head writes in place.
            for h, (s, r) in enumerate(zip(self.starts, self._rows)):
                at = (Ellipsis, slice(s + r + tail, s + r + tail + 1), slice(None))
                buf.put(self.flat_keys, at, buf.map_parts(lambda x: x[:, h : h + 1], keys))
                buf.put(self.flat_values, at, buf.map_parts(lambda x: x[:, h : h + 1], values))
            return
        # Each head's next free rows, head-major like the reshape below (built on the device, not in Python).
        if self._first is None:
            self._first = self.device_starts + self.device_rows  # each head's first appended row
        if n == 1:
            idx = self._first + tail
        else:
            idx = (self._first[:, None] + (tail + mx.arange(n, dtype=mx.int32))[None]).reshape(-1)
        at = (slice(None), slice(None), idx, slice(None))
        buf.put(self.flat_keys, at, buf.map_parts(lambda x: x.reshape(B, 1, H * n, x.shape[3]), keys))
        buf.put(self.flat_values, at, buf.map_parts(lambda x: x.reshape(B, 1, H * n, x.shape[3]), values))

    def padded(self, stored: int, n_ctx: int, kept):
        """Rows ``[B, H, n_ctx + appended, D]``, context rows padded per head, and ``valid`` [B, H, n_ctx]."""
        tail, R = stored - n_ctx, n_ctx
        ks, vs = [], []
        for k, v, r in zip(*self.fetch(stored, n_ctx), self.head_rows):
            ks.append(buf.cat([buf.rows_of(k, 0, r), buf.zeros(k, 1, 1, R - r), buf.rows_of(k, r, r + tail)]))
            vs.append(buf.cat([buf.rows_of(v, 0, r), buf.zeros(v, 1, 1, R - r), buf.rows_of(v, r, r + tail)]))
        valid = mx.arange(R)[None, None, :] < kept[..., None]
        return buf.cat(ks, axis=1), buf.cat(vs, axis=1), valid

    def extend_context(self, tail: int, stored: int) -> None:
        self.head_rows = [r + tail for r in self.head_rows]

    def quantize(self, qk, qv, stored: int) -> None:
        self.flat_keys, self.flat_values = qk(self.flat_keys), qv(self.flat_values)

    def buffers(self) -> tuple:
        return self.flat_keys, self.flat_values

    @property
    def nbytes(self) -> int:
        return buf.nbytes(self.flat_keys) + buf.nbytes(self.flat_values)

    def copy(self, stored: int) -> "PerHead":
        return PerHead(buf.rows_of(self.flat_keys, 0), buf.rows_of(self.flat_values, 0), self.head_rows,
                       self.head_cap)

    def saved(self, stored: int, n_ctx: int) -> tuple:
        hk, hv = self.fetch(stored, n_ctx)
        return None, None, hk, hv
