"""A drop-in mlx-lm KV cache that compresses its context: once after the last prefill chunk (``prefill="whole"``),
or also while the context arrives (``prefill="streaming"``, bounded peak).

Layout of one layer after compression, per KV head::

    [ kept context rows (ascending original positions) | appended question/decode rows | free ]

``offset`` is the true number of positions seen (RoPE reads it); ``stored`` is the row count of the longest head.
Three layouts hold the rows:

- dense: ``keys``/``values`` ``[B, H, rows, D]``; every head keeps the same count (uniform budgets, no press).
- per-head: adaptive budgets (B = 1) keep each head's rows without padding in one flat buffer
  ``flat_keys``/``flat_values`` ``[1, 1, sum of region sizes, D]``, one region per KV head
  ``[its kept rows | appended rows | free]``: resident bytes follow kept bytes, and one scatter appends a token
  to every head. ``head_keys``/``head_values`` are the per-head views ``[1, 1, rows_h, D]`` that
  ``attention.attention`` runs each KV head against.
- padded: dense plus ``valid`` ``[B, H, n_ctx_rows]`` marking real context rows; shorter heads are padded and
  ``attention.head_mask`` hides the padding. Used by ``stack`` (batched decode) and by adaptive budgets with
  B > 1; per-head rows are padded transiently (one layer at a time) only to be scored during a streaming prefill.

Streaming (``prefill="streaming"``, see ``streaming.py``): before a chunk is appended, a layer whose stored rows
exceed the budget is scored and evicted down to it, so it never holds more than budget + chunk rows per head
(per layer on average under adaptive budgets) and the chunk attends to the kept rows only. ``compress`` then
brings it to exactly the final budget.

Quantized KV (``press.kv_bits``): once compression has chosen the rows (scored on the real keys), every buffer
above becomes a ``(packed, scales, biases)`` triple of ``mx.quantize`` with the same row layout, rows appended later
are quantized as they arrive, and the cache carries ``bits``/``group_size`` so that mlx-lm's attention (and
``attention.attention``) use ``quantized_scaled_dot_product_attention``, as for its ``QuantizedKVCache``.

Batching: ``stack`` batches compressed caches for decode (configurations of one document, or different
documents: each entry keeps its own rows and position).
mlx-lm's ``merge`` into a ``BatchKVCache`` is refused: that would silently drop the compression.
"""

from __future__ import annotations

import copy
import json
import sys
from typing import Optional, Sequence

import mlx.core as mx
import mlx_lm.models.cache as mlx_cache
import numpy as np
from mlx_lm.models.cache import KVCache, create_attention_mask

import nestedkv.attention as _attention
from nestedkv.accounting import LayerMemory
from nestedkv.activations import install_swiglu_hook
from nestedkv.attention import install_attention_hook  # noqa: F401  (kept importable from here)
from nestedkv.press import KV_GROUP_SIZES, BasePress, NoPress
from nestedkv.selection import select
from nestedkv.rope import from_description as rope_from_description, model_rope
from nestedkv.streaming import StreamState


def _check_context_len(n) -> Optional[int]:
    if n is None:
        return None
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"context_len must be a positive int (the document's token count), got {n!r}")
    return n


# A K or V buffer is an array, or (quantized) a (packed, scales, biases) tuple whose parts share the rows axis 2.
def _parts(buf) -> tuple:
    return buf if isinstance(buf, tuple) else (buf,)


def _map(fn, *bufs):
    """``fn`` applied part by part to equally structured buffers."""
    if isinstance(bufs[0], tuple):
        return tuple(fn(*xs) for xs in zip(*bufs))
    return fn(*bufs)


def _cat(bufs, axis: int = 2):
    return _map(lambda *xs: mx.concatenate(xs, axis=axis), *bufs)


def _rows_of(buf, a: int, b: Optional[int] = None):
    return _map(lambda x: x[..., a:b, :], buf)


def _zeros(buf, B: int, H: int, n: int):
    """``n`` zero rows shaped like ``buf``'s (quantized zeros dequantize to 0: scales and biases are 0)."""
    return _map(lambda x: mx.zeros((B, H, n, x.shape[3]), x.dtype), buf)


def _put(buf, index, new) -> None:
    for dst, src in zip(_parts(buf), _parts(new)):
        dst[index] = src


def _nbytes(buf) -> int:
    return 0 if buf is None else sum(x.nbytes for x in _parts(buf))


def _grow(buf, rows: int, new, step: int):
    """``buf`` with room for ``new`` after its first ``rows`` rows; KVCache's growth policy (steps of ``step``),
    so that with nothing evicted the arrays (and outputs) are bit-identical to mlx-lm's."""
    if isinstance(new, tuple):
        return tuple(_grow(b, rows, x, step) for b, x in zip(buf, new))
    if buf is not None and rows + new.shape[2] <= buf.shape[2]:
        return buf
    B, H, n, d = new.shape
    n_steps = (step + n - 1) // step
    fresh = mx.zeros((B, H, n_steps * step, d), new.dtype)
    if buf is None:
        return fresh
    if rows % step != 0:
        buf = buf[..., :rows, :]
    return mx.concatenate([buf, fresh], axis=2)


class NestedKVCache(KVCache):
    step = KVCache.step
    rope_spec: Optional[dict] = None  # the model's rope (nestedkv.rope.describe), for unrotated scoring

    @property
    def unrope(self):
        return None if self.rope_spec is None else rope_from_description(self.rope_spec)

    def __init__(self, press: Optional[BasePress] = None, context_len: Optional[int] = None):
        super().__init__()
        if press is not None and not isinstance(press, BasePress):
            raise TypeError(f"press must be a nestedkv press (e.g. NestedKVPress), got {type(press).__name__}")
        self.press = press or NoPress()
        self.planned_len = _check_context_len(context_len)  # the document's token count, for streaming
        self.stored = 0
        self.context_len: Optional[int] = None  # positions compressed; None until compressed
        self.n_ctx_rows = 0
        self.kept: Optional[mx.array] = None  # [B, H] kept context rows per head
        self.valid: Optional[mx.array] = None  # [B, H, n_ctx_rows] bool, padded layout only
        self.flat_keys: Optional[mx.array] = None  # per-head layout: [1, 1, sum(head_cap), D]
        self.flat_values: Optional[mx.array] = None
        self.head_rows: Optional[list[int]] = None  # per-head layout: kept context rows per head
        self.head_cap: Optional[list[int]] = None  # per-head layout: rows of each head's region
        self.stream: Optional[StreamState] = None
        self.peak_nbytes = 0
        self._saw_prefill = False

    @property
    def compressed(self) -> bool:
        return self.context_len is not None

    # -- mlx-lm cache protocol -------------------------------------------------------------
    def update_and_fetch(self, keys, values):
        if self.valid is not None or self.flat_keys is not None:
            _attention.check_caller_routed()  # mlx-lm's attention would attend the padding
        n_new = keys.shape[2]
        if not self.compressed:
            if n_new == 1 and self._saw_prefill:
                # Inside mlx_lm.generate: the first single-token step follows the chunked prefill.
                self.compress()
            elif n_new > 1:
                self._saw_prefill = True
        if not self.compressed and self.press.prefill == "streaming":
            self._stream_step(keys)
        if self.quantized:  # after the compress above: new rows join the kept ones quantized
            keys, values = self._quantize(keys), self._quantize(values)
        if self.flat_keys is not None:
            out = self._append_per_head(keys, values)
        else:
            prev = self.stored
            self.keys = _grow(self.keys, prev, keys, self.step)
            self.values = _grow(self.values, prev, values, self.step)
            self.stored += n_new
            rows = (Ellipsis, slice(prev, self.stored), slice(None))
            _put(self.keys, rows, keys)
            _put(self.values, rows, values)
            out = self.keys_and_values()
        self.offset += n_new
        self._note_peak()
        return out

    # -- per-head layout ---------------------------------------------------------------------
    def _views(self, flat: mx.array) -> list:
        """Each head's rows ``[1, 1, rows_h + appended, D]`` (views of its region)."""
        tail = self.stored - self.n_ctx_rows
        out, off = [], 0
        for r, cap in zip(self.head_rows, self.head_cap):
            out.append(_rows_of(flat, off, off + r + tail))
            off += cap
        return out

    @property
    def head_keys(self) -> Optional[list]:
        return None if self.flat_keys is None else self._views(self.flat_keys)

    @property
    def head_values(self) -> Optional[list]:
        return None if self.flat_values is None else self._views(self.flat_values)

    def _set_per_head(self, keys: list, values: list, rows: list[int]) -> None:
        """Per-head layout from each head's rows (context then appended), regions exactly that long."""
        self.flat_keys, self.flat_values = _cat(keys), _cat(values)
        self.head_rows = rows
        self.head_cap = [_parts(k)[0].shape[2] for k in keys]
        self.keys = self.values = self.valid = None

    def _append_per_head(self, keys, values):
        tail = self.stored - self.n_ctx_rows
        B, H, n, _ = _parts(keys)[0].shape
        if any(r + tail + n > cap for r, cap in zip(self.head_rows, self.head_cap)):
            # Every region grows by whole steps, as KVCache does (heads share the appended count).
            extra = ((n + self.step - 1) // self.step) * self.step
            ks, vs = self.head_keys, self.head_values
            zk, zv = _zeros(keys, B, 1, extra), _zeros(values, B, 1, extra)
            self.flat_keys = _cat([x for k in ks for x in (k, zk)])
            self.flat_values = _cat([x for v in vs for x in (v, zv)])
            self.head_cap = [_parts(k)[0].shape[2] + extra for k in ks]
        idx, off = [], 0
        for r, cap in zip(self.head_rows, self.head_cap):
            idx.extend(range(off + r + tail, off + r + tail + n))
            off += cap
        idx = mx.array(idx, dtype=mx.int32)  # head-major, like the reshape below
        at = (slice(None), slice(None), idx, slice(None))
        _put(self.flat_keys, at, _map(lambda x: x.reshape(B, 1, H * n, x.shape[3]), keys))
        _put(self.flat_values, at, _map(lambda x: x.reshape(B, 1, H * n, x.shape[3]), values))
        self.stored += n
        return self.head_keys, self.head_values

    def keys_and_values(self):
        if self.flat_keys is not None:
            return self.head_keys, self.head_values
        if self.stored < _parts(self.keys)[0].shape[2]:
            return _rows_of(self.keys, 0, self.stored), _rows_of(self.values, 0, self.stored)
        return self.keys, self.values

    def make_mask(self, N, return_array=False, window_size=None):
        model = _attention.calling_model()  # a loaded cache never went through make_cache
        if model is not None:
            _route(model, required=False)
        # Keys are the stored rows: "causal" aligns to their end, arrays are built over them.
        return create_attention_mask(N, offset=self.stored, return_array=return_array, window_size=window_size)

    def size(self):
        return self.stored

    def empty(self):
        return self.keys is None and self.flat_keys is None

    def trim(self, n):
        """Drop up to ``n`` of the newest rows. Evicted or compressed context rows are never cut: only rows
        appended after them go (one compressed document, many questions)."""
        floor = self.n_ctx_rows if self.kept is not None else 0
        n = max(0, min(self.stored - floor, n))
        if self.stream is not None and n:
            raise ValueError("trim during a streaming prefill is not supported: compress first")
        self.stored -= n
        self.offset -= n
        return n

    def rewind(self) -> int:
        """Trim back to the compressed context; returns the rows dropped."""
        return self.trim(self.stored)

    @property
    def appended(self) -> int:
        return self.stored - self.n_ctx_rows if self.compressed else 0

    @property
    def quantized(self) -> bool:
        # ``bits`` exists only once quantized: mlx-lm's attention dispatches on hasattr(cache, "bits").
        return "bits" in vars(self)

    def _quantize(self, x: mx.array) -> tuple:
        _check_divides(self.group_size, x.shape[-1])
        return tuple(mx.quantize(x, group_size=self.group_size, bits=self.bits))

    def _quantize_rows(self) -> None:
        """Quantize the rows compression kept, once (they were scored before, on the real keys)."""
        self.bits, self.group_size = self.press.kv_bits, self.press.kv_group_size
        if self.flat_keys is not None:
            self.flat_keys, self.flat_values = self._quantize(self.flat_keys), self._quantize(self.flat_values)
        else:
            n = self.stored
            self.keys = self._quantize(self.keys[..., :n, :])
            self.values = self._quantize(self.values[..., :n, :])
        mx.eval(self.keys, self.values, self.flat_keys, self.flat_values)  # so the unquantized buffers are freed

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        raise ValueError(
            "NestedKVCache is not converted by mlx-lm's kv_bits: give the press kv_bits instead "
            "(e.g. NestedKVPress(compression_ratio=0.75, kv_bits=4)); it quantizes the rows it keeps"
        )

    @classmethod
    def merge(cls, caches):
        raise ValueError(
            "NestedKVCache cannot be merged into mlx-lm's batch cache (BatchKVCache): that would drop each "
            "document's compression. Supported batching: nestedkv.stack(caches) batches compressed caches for "
            "decode (several configurations or documents at once)"
        )

    @property
    def nbytes(self):
        if self.flat_keys is not None:
            return _nbytes(self.flat_keys) + _nbytes(self.flat_values)
        return _nbytes(self.keys) + _nbytes(self.values)

    # Peak resident K/V bytes, noted after every update, compression and load (the transient second buffer
    # of a reallocation or an eviction lives for one operation and is not counted).
    def _note_peak(self) -> None:
        self.peak_nbytes = max(self.peak_nbytes, self.nbytes)

    def reset_peak(self) -> None:
        """Start a new peak window: the peak becomes what is resident now."""
        self.peak_nbytes = self.nbytes

    @property
    def state(self):
        k = v = hk = hv = None
        if self.flat_keys is not None:
            hk, hv = self.keys_and_values()
        elif self.keys is not None:
            k, v = self.keys_and_values()
        return (
            k,
            v,
            self.kept,
            self.valid,
            self.offset,
            self.stored,
            -1 if self.context_len is None else self.context_len,
            self.n_ctx_rows,
            int(self._saw_prefill),
            self.press.to_json(),
            hk,
            hv,
            -1 if self.planned_len is None else self.planned_len,
            None if self.stream is None else self.stream.to_state(),
            "" if self.rope_spec is None else json.dumps(self.rope_spec),
        )

    @state.setter
    def state(self, v):
        v = list(v)
        v += [None, None, -1, None, ""][len(v) - 10 :]  # files saved before per-head and streaming state: 10 fields
        keys, values, self.kept, self.valid, offset, stored, context_len, n_ctx_rows, saw, press_json = v[:10]
        hk, hv, planned, stream, rope_json = v[10:]
        self.rope_spec = json.loads(rope_json) if rope_json else None
        self.keys, self.values = keys, values
        self.offset, self.stored, self.n_ctx_rows = int(offset), int(stored), int(n_ctx_rows)
        self.context_len = None if int(context_len) < 0 else int(context_len)
        self._saw_prefill = bool(saw)
        self.press = BasePress.from_json(press_json)
        vars(self).pop("bits", None)
        if self.compressed and self.press.kv_bits is not None:
            # save_prompt_cache stores tuples as lists; lists of arrays mean per-head rows to the attention
            self.bits, self.group_size = self.press.kv_bits, self.press.kv_group_size
            keys, values = _tuple(keys), _tuple(values)
            self.keys, self.values = keys, values
            hk, hv = (None, None) if hk is None else ([tuple(h) for h in hk], [tuple(h) for h in hv])
        self.planned_len = None if planned is None or int(planned) < 0 else int(planned)
        self.flat_keys = self.flat_values = self.head_rows = self.head_cap = None
        if hk is not None:
            self._set_per_head(list(hk), list(hv), [int(x) for x in self.kept[0].tolist()])
        self.stream = None if stream is None else StreamState.from_state(self.press, stream)
        self.peak_nbytes = self.nbytes

    # -- compression -----------------------------------------------------------------------
    def _keep(self) -> Optional[int]:
        """Rows per head a streaming press keeps (None: nothing to evict). Ratios apply to the planned length;
        without one only an absolute budget can stream (checked in ``_stream_step``)."""
        n = self.planned_len if self.planned_len is not None else sys.maxsize
        return self.press.n_keep(n)

    def _stream_step(self, keys) -> None:
        """Before appending a chunk: fold it into the running statistics, then evict the stored rows down to
        the budget when they exceed it, so this chunk attends to kept rows only (<= budget + chunk rows)."""
        if self.planned_len is None and self.press.budget is None and self.press.compression_ratio > 0:
            raise ValueError(
                f"streaming prefill with compression_ratio={self.press.compression_ratio} needs the document's "
                "token count: make_cache(model, press, context_len=N)"
            )
        if self.planned_len is not None and self.offset + keys.shape[2] > self.planned_len:
            raise ValueError(
                f"streaming prefill: context_len={self.planned_len} was planned but "
                f"{self.offset + keys.shape[2]} positions were fed"
            )
        keep = self._keep()
        if keep is None:
            return  # nothing will ever be evicted: plain appends, bit-identical to KVCache
        if self.stream is None:
            if self.stored:
                raise ValueError("a streaming press must see the context from its first chunk (clone it earlier)")
            self.stream = StreamState(self.press, self.planned_len)
        new = self.stream.observe(keys, self.unrope)
        if self._rows_kept() > keep * keys.shape[1]:
            self._evict(keep)
        self.stream.append(new)
        mx.eval(self.stream.arrays())

    def _rows_kept(self) -> int:
        """Real (head, row) pairs stored, over all heads of batch entry 0."""
        if self.stored == 0:
            return 0
        if self.kept is None:
            return self.stored * self.keys.shape[1]
        return int(mx.sum(self.kept[0]).item()) + (self.stored - self.n_ctx_rows) * self.kept.shape[1]

    def _rows(self):
        """The stored rows as dense ``(keys, values, valid)`` ``[B, H, stored, D]`` in any layout; ``valid``
        (None when no head is padded) covers every row. Per-head rows are padded transiently (one layer)."""
        if self.flat_keys is not None:
            k, v, valid = self.padded()
        else:
            n = self.stored
            k, v, valid = self.keys[..., :n, :], self.values[..., :n, :], self.valid
        if valid is not None and valid.shape[2] < k.shape[2]:
            B, H, R = valid.shape
            valid = mx.concatenate([valid, mx.ones((B, H, k.shape[2] - R), dtype=mx.bool_)], axis=2)
        return k, v, valid

    def _select_stored(self, keep: int):
        keys, values, valid = self._rows()
        scores = self.stream.scores(keys, valid, self.unrope)
        sel = select(scores, keep, self.press.head_budget, n_sink=self.press.n_sink, safeguard=self.press.safeguard)
        return keys, values, sel

    def _evict(self, keep: int) -> None:
        """Keep ``keep`` rows per head (``H * keep`` per layer, adaptive) of the stored rows, by streaming scores."""
        keys, values, sel = self._select_stored(keep)
        self._gather(keys, values, sel)
        self.stream.take(sel.indices)
        if self.valid is not None and self.keys.shape[0] == 1:
            self._to_per_head()  # ragged heads hold their rows unpadded between evictions too

    def _gather(self, keys, values, sel) -> None:
        idx = sel.indices[..., None]
        self.keys = mx.take_along_axis(keys, idx, axis=2)
        self.values = mx.take_along_axis(values, idx, axis=2)
        self.flat_keys = self.flat_values = self.head_rows = self.head_cap = None
        self.stored = self.n_ctx_rows = sel.indices.shape[2]
        self.kept, self.valid = sel.counts, sel.valid

    def compress(self) -> None:
        """Score the context and keep the press's budget (streaming: the rows still stored, scored with the
        running statistics). A second call is a no-op."""
        if self.compressed:
            return
        if self.empty() or self.stored == 0:
            raise ValueError("compress() called on an empty cache: prefill the context first")
        n = self.stored
        streamed = self.stream is not None and self.stream.evicted
        self.context_len = self.offset
        sel = None
        if not streamed:
            # Nothing evicted yet: every key of the context is here, score it whole (exact).
            keys, values = self.keys[..., :n, :], self.values[..., :n, :]
            sel = self.press.select(keys, unrope=self.unrope)
        else:
            keep = self._keep()
            if keep is not None and self._rows_kept() > keep * self.kept.shape[1]:
                keys, values, sel = self._select_stored(keep)
        self.stream = None
        if sel is not None:
            self._gather(keys, values, sel)
        else:  # nothing (more) to evict: the rows after the kept ones join the context
            tail = n - self.n_ctx_rows if self.kept is not None else 0
            if self.kept is None:
                self.kept = mx.full(self.keys.shape[:2], n, dtype=mx.int32)
            elif self.flat_keys is not None:
                self.kept = self.kept + tail
                self.head_rows = [r + tail for r in self.head_rows]
            else:
                self.kept = self.kept + tail
                self.valid = self._rows()[2]
            self.n_ctx_rows = n
        if self.valid is not None and self.keys.shape[0] == 1:
            self._to_per_head()
        if self.press.kv_bits is not None:
            self._quantize_rows()
        self._note_peak()

    def _to_per_head(self) -> None:
        """Padded -> per-head layout (right after compression): each KV head keeps exactly its real rows."""
        valid = np.array(self.valid[0])  # [H, R], R == stored
        B, H, R = self.valid.shape
        idx = mx.array(np.flatnonzero(valid.reshape(-1)).astype(np.int32))  # real rows, head-major
        flat_k = mx.take(self.keys[..., :R, :].reshape(B, 1, H * R, -1), idx, axis=2)
        flat_v = mx.take(self.values[..., :R, :].reshape(B, 1, H * R, -1), idx, axis=2)
        mx.eval(flat_k, flat_v)  # so the padded buffers can be freed
        counts = [int(x) for x in valid.sum(axis=1)]
        self.flat_keys, self.flat_values = flat_k, flat_v
        self.head_rows, self.head_cap = counts, list(counts)
        self.n_ctx_rows = self.stored = max(counts)
        self.keys = self.values = self.valid = None

    def padded(self):
        """This layer's rows as ``(keys, values, valid)``: ``[B, H, n_ctx_rows + appended, D]`` with context rows
        padded per head and ``valid`` ``[B, H, n_ctx_rows]`` (None when no head is padded)."""
        if self.flat_keys is None:
            k, v = self.keys_and_values()
            return k, v, self.valid
        tail = self.stored - self.n_ctx_rows
        R = self.n_ctx_rows
        ks, vs = [], []
        for k, v, r in zip(self.head_keys, self.head_values, self.head_rows):
            ks.append(_cat([_rows_of(k, 0, r), _zeros(k, 1, 1, R - r), _rows_of(k, r, r + tail)]))
            vs.append(_cat([_rows_of(v, 0, r), _zeros(v, 1, 1, R - r), _rows_of(v, r, r + tail)]))
        valid = mx.arange(R)[None, None, :] < self.kept[..., None]
        return _cat(ks, axis=1), _cat(vs, axis=1), valid

    def memory(self, layer: int) -> LayerMemory:
        """Accounting for this layer in its real dtype (see LayerMemory)."""
        if self.empty():
            return LayerMemory(layer, 0, 0, "none", 0, 0, 0, 0.0, 0, 0, 0)
        if self.flat_keys is not None:
            k0, v0 = self.flat_keys, self.flat_values
            B, H = _parts(k0)[0].shape[0], len(self.head_rows)
        else:
            k0, v0 = self.keys, self.values
            B, H = _parts(k0)[0].shape[:2]
        (dk, dtype), (dv, _) = self._dims(k0), self._dims(v0)
        # full: the model's dtype uncompressed; kept: rows as stored (quantized: packed values + scales + biases)
        full_row = (dk + dv) * dtype.size
        row_bytes = sum(x.shape[3] * x.dtype.size for x in _parts(k0) + _parts(v0))
        tail = self.stored - self.n_ctx_rows if self.kept is not None else 0
        kept = self.kept if self.kept is not None else mx.full((B, H), self.stored, dtype=mx.int32)
        seen = self.context_len + tail if self.compressed else self.offset
        return LayerMemory(
            layer=layer,
            n_kv_heads=H,
            head_dim=dk,
            dtype=str(dtype).removeprefix("mlx.core."),
            tokens_seen=self.context_len if self.compressed else self.offset,
            kept_min=int(mx.min(kept).item()),
            kept_max=int(mx.max(kept).item()),
            kept_mean=float(mx.mean(kept.astype(mx.float32)).item()),
            bytes_full=B * H * seen * full_row,
            bytes_kept=(int(mx.sum(kept).item()) + B * H * tail) * row_bytes,
            bytes_resident=self.nbytes,
        )


    def _dims(self, buf):
        """(head dim, model dtype) of a K or V buffer."""
        if isinstance(buf, tuple):  # packed uint32 words of 32 / bits values, scales in the model's dtype
            return buf[0].shape[3] * 32 // self.bits, buf[1].dtype
        return buf.shape[3], buf.dtype


def _tuple(buf):
    return tuple(buf) if isinstance(buf, list) else buf


# load_prompt_cache looks cache classes up by name in mlx_lm.models.cache.
mlx_cache.NestedKVCache = NestedKVCache


def _route(model, required: bool) -> None:
    # Adaptive budgets need the attention hook; elsewhere it only serves the CPU fast path, so a model without
    # it runs as is.
    install_attention_hook(model, required=required)
    install_swiglu_hook(model)


# -- public API ------------------------------------------------------------------------------
def make_cache(model, press: Optional[BasePress] = None, context_len: Optional[int] = None) -> list[NestedKVCache]:
    """One NestedKVCache per layer; a drop-in ``prompt_cache`` for mlx-lm.

    ``context_len``: the document's token count, needed by ``prefill="streaming"`` presses with a
    compression ratio (their budget is a share of the whole document, evicted before it has all arrived).

    Routes this model instance's attention through ``attention.attention`` where it can (required for
    adaptive budgets) and its SwiGLU through ``activations.swiglu``, whatever cache it runs with; other
    models and mlx-lm's modules are left alone. Both are mlx-lm's functions unless the CPU fast path is on
    (``nestedkv.enable_cpu_fast_path``): then on the CPU long prefill chunks take the row-split attention and
    exp is a power of 2 (each within 1e-6 of mlx's, not bit-identical).
    """
    if press is not None and not isinstance(press, BasePress):
        raise TypeError(f"press must be a nestedkv press, got {type(press).__name__}")
    context_len = _check_context_len(context_len)
    defaults = model.make_cache() if hasattr(model, "make_cache") else [KVCache() for _ in model.layers]
    for i, c in enumerate(defaults):
        if type(c) is not KVCache:
            raise ValueError(
                f"layer {i} uses {type(c).__name__}; NestedKV compresses only full-attention KVCache layers"
            )
    if press is not None and press.kv_bits is not None:
        check_group_size(model, press.kv_group_size)
    _route(model, required=press is not None and press.head_budget == "adaptive")
    return _bind([NestedKVCache(press, context_len) for _ in defaults], model, press)


def _bind(cache: list, model, press: Optional[BasePress]) -> list:
    """Give the layers the model's rope (kept by ``clone`` and saved files), which presses scoring unrotated
    keys need; a model whose rope cannot be undone fails only such a press."""
    try:
        spec = model_rope(model)
    except ValueError:
        if press is not None and press.unrotate:
            raise
        spec = None
    if spec is None and press is not None and press.unrotate:
        raise ValueError(f"unrotate=true: the model {type(model).__name__} has no rope module to undo; "
                         "set the press's unrotate=false")
    for c in cache:
        c.rope_spec = spec
    return cache


def check_group_size(model, group_size: int) -> None:
    """Quantized KV needs the group size to divide the head dimension: say so before any prefill."""
    args = getattr(model, "args", None)
    d = getattr(args, "head_dim", None) or (getattr(args, "hidden_size", 0) // max(1, getattr(args, "num_attention_heads", 1)))
    if d:
        _check_divides(group_size, d)


def _check_divides(group_size: int, head_dim: int) -> None:
    if head_dim % group_size:
        fits = [str(g) for g in KV_GROUP_SIZES if head_dim % g == 0]
        raise ValueError(f"kv_group_size={group_size} must divide the model's head dimension {head_dim}; "
                         f"{'choose ' + ' or '.join(fits) if fits else 'this model cannot be KV-quantized'}")


def _check_cache(cache) -> None:
    if not isinstance(cache, (list, tuple)) or not all(isinstance(c, NestedKVCache) for c in cache):
        raise TypeError("cache must be the list returned by nestedkv.make_cache(model, press)")


def compress(cache) -> None:
    """Compress every layer once, after the last chunk of the context; evaluates the result."""
    _check_cache(cache)
    for c in cache:
        c.compress()
    mx.eval([c.state for c in cache])


def clone(cache, press: Optional[BasePress] = None, model=None) -> list[NestedKVCache]:
    """A copy of a cache, optionally (uncompressed caches only) under another press. Cheap: MLX arrays are
    immutable, so the copies share the keys and values until one of them writes. ``model``: the model
    the cache belongs to, for a press that scores unrotated keys of a cache that was loaded from disk."""
    _check_cache(cache)
    if press is not None and not isinstance(press, BasePress):
        raise TypeError(f"press must be a nestedkv press, got {type(press).__name__}")
    out = []
    for c in cache:
        d = copy.copy(c)
        # New array objects: slice assignment rebinds the Python object in place, so sharing
        # the objects themselves would let the copy write into the original.
        if c.keys is not None:
            d.keys, d.values = _rows_of(c.keys, 0, c.stored), _rows_of(c.values, 0, c.stored)
        if c.flat_keys is not None:
            d.flat_keys, d.flat_values = _rows_of(c.flat_keys, 0), _rows_of(c.flat_values, 0)
        if c.stream is not None:
            d.stream = copy.copy(c.stream)
            d.stream.rows = dict(c.stream.rows)
        if press is not None:
            if c.compressed or c.stream is not None or c.kept is not None:
                raise ValueError("clone(cache, press) needs an uncompressed cache that evicted nothing")
            d.press = press
        out.append(d)
    return _bind(out, model, press) if model is not None else out


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
    for layer in zip(*caches):
        if not all(c.compressed for c in layer):
            raise ValueError("stack needs compressed caches (compress each before decoding them together)")
        quant = {(c.bits, c.group_size) if c.quantized else None for c in layer}
        if len(quant) > 1:
            raise ValueError(f"stack needs caches quantized alike (kv_bits, kv_group_size); got {sorted(map(str, quant))}")
        rows = max(c.n_ctx_rows + c.appended for c in layer)
        ks, vs, valid = [], [], []
        for c in layer:
            k, v, ok = c.padded()
            B, H = _parts(k)[0].shape[:2]
            n, a = c.n_ctx_rows, c.appended
            pad = rows - n - a
            ks.append(_cat([_rows_of(k, 0, n), _zeros(k, B, H, pad), _rows_of(k, n, n + a)]))
            vs.append(_cat([_rows_of(v, 0, n), _zeros(v, B, H, pad), _rows_of(v, n, n + a)]))
            ok = ok if ok is not None else mx.ones((B, H, n), dtype=mx.bool_)
            valid.append(mx.concatenate([ok, mx.zeros((B, H, pad), dtype=mx.bool_), mx.ones((B, H, a), dtype=mx.bool_)],
                                        axis=2))
        offsets = [c.offset for c in layer]
        s = NestedKVCache(NoPress())
        s.keys, s.values = _cat(ks, axis=0), _cat(vs, axis=0)
        if quant != {None}:
            s.bits, s.group_size = next(iter(quant))
        s.kept, s.valid = mx.concatenate([c.kept for c in layer], axis=0), mx.concatenate(valid, axis=0)
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
    B = _parts(stacked[0].keys)[0].shape[0] if stacked else 0
    if not rows or any(not 0 <= r < B for r in rows):
        raise ValueError(f"rows must be positions in the batch of {B}, got {rows}")
    idx = mx.array(rows, dtype=mx.int32)
    out = []
    for c in stacked:
        s = NestedKVCache(NoPress())
        s.keys, s.values = _map(lambda x: x[idx], c.keys), _map(lambda x: x[idx], c.values)
        s.kept, s.valid = c.kept[idx], c.valid[idx]
        if c.quantized:
            s.bits, s.group_size = c.bits, c.group_size
        s.offset = c.offset if isinstance(c.offset, int) else c.offset[idx]
        s.context_len, s.n_ctx_rows, s.stored = c.context_len, c.n_ctx_rows, c.stored
        s._note_peak()
        out.append(s)
    return out
