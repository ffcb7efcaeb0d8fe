"""``NestedKVCache``: one layer of a drop-in mlx-lm KV cache that compresses its context: once after the last
prefill chunk (``prefill="whole"``), or also while the context arrives (``prefill="streaming"``, bounded peak).

``offset`` is the true number of positions seen (RoPE reads it); ``stored`` is the row count of the longest
head, ``n_ctx_rows`` its context rows. The rows live in a layout (``layouts.py``): dense, padded, or per head.

Past the window (``positions``, ``eviction.py``): ``offset`` is the rope position of the next token, which
can be less than the positions seen (``positions_seen``).

Streaming: eviction while the context arrives is ``eviction.py``; the scoring state, ``streaming.py``.

Quantized KV (``press.kv_bits``): once compression has chosen the rows (scored on the real keys), every buffer
becomes a ``(packed, scales, biases)`` triple of ``mx.quantize`` with the same row layout, rows appended later
are quantized as they arrive, and the cache carries ``bits``/``group_size`` so that mlx-lm's attention (and
``attention.attention``) use ``quantized_scaled_dot_product_attention``, as for its ``QuantizedKVCache``.
With ``press.kv_hadamard`` the keys are rotated (``buffers.hadamard``) before they are quantized, and
``attention.attention`` rotates the queries alike; mlx-lm's own attention is then refused.
"""

from __future__ import annotations

import json
import sys
from typing import Optional

import mlx.core as mx
import mlx_lm.models.cache as mlx_cache
from mlx_lm.models.cache import KVCache, create_attention_mask

import nestedkv.attention as _attention
from nestedkv import buffers as buf
from nestedkv.accounting import LayerMemory, layer_memory
from nestedkv.activations import install_swiglu_hook
from nestedkv.attention import install_attention_hook
from nestedkv.buffers import check_divides
from nestedkv.layouts import Dense, PerHead, pad_valid
from nestedkv.press import BasePress, NoPress
from nestedkv import eviction
from nestedkv.rope import from_description as rope_from_description
from nestedkv.streaming import StreamState


def check_context_len(n) -> Optional[int]:
    if n is None:
        return None
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"context_len must be a positive int (the document's token count), got {n!r}")
    return n


def _layout_field(name: str, writable: bool = False):
    """The layout's buffers, read (and for dense ones written) where callers have always found them."""
    get = lambda self: getattr(self.layout, name, None)  # noqa: E731
    return property(get, (lambda self, v: setattr(self.layout, name, v)) if writable else None)


class NestedKVCache(KVCache):
    step = KVCache.step
    rope_spec: Optional[dict] = None  # the rope of this layer's keys (nestedkv.introspect), for unrotated scoring
    run_press: Optional[BasePress] = None  # the run's press, when this layer runs another (``adapted``)
    adapted: Optional[str] = None  # what this layer runs differently from the run's press, and why
    facts = None  # this layer's nestedkv.introspect.LayerFacts (None in a cache loaded from a file)
    positions: Optional[int] = None  # rope positions the context may use (past the window), or None
    _chunk = 0  # the largest chunk seen (past the window: the room the next one needs)
    _reposition = False  # the next read of ``offset`` moves the rows first
    _checked = None  # the layout whose caller was checked to attend through nestedkv's attention

    keys, values, valid = (_layout_field(n, writable=True) for n in ("keys", "values", "valid"))
    flat_keys, flat_values, head_rows, head_cap = map(_layout_field, ("flat_keys", "flat_values", "head_rows",
                                                                      "head_cap"))

    @property
    def unrope(self):
        return None if self.rope_spec is None else rope_from_description(self.rope_spec)

    def __init__(self, press: Optional[BasePress] = None, context_len: Optional[int] = None,
                 positions: Optional[int] = None):
        if press is not None and not isinstance(press, BasePress):
            raise TypeError(f"press must be a nestedkv press (e.g. NestedKVPress), got {type(press).__name__}")
        self.layout = Dense()
        self.offset = 0
        self.press = press or NoPress()
        self.planned_len = check_context_len(context_len)  # the document's token count, for streaming
        self.positions = check_context_len(positions)
        self.stored = 0
        self.context_len: Optional[int] = None  # positions compressed; None until compressed
        self.n_ctx_rows = 0
        self.kept: Optional[mx.array] = None  # [B, H] kept context rows per head
        self.stream: Optional[StreamState] = None
        self.peak_nbytes = 0
        self._saw_prefill = False

    @property
    def compressed(self) -> bool:
        return self.context_len is not None

    # The model reads ``offset`` for the rope of the next chunk before handing that chunk over: a pending
    # move of the rows (past the window) happens then, between the chunks.
    @property
    def offset(self) -> int:
        if self._reposition:
            self._move_rows()
        return self._offset

    @offset.setter
    def offset(self, value: int) -> None:
        self._offset = value

    @property
    def positions_seen(self) -> int:
        """Context positions fed so far (``offset`` once rows were moved to fit the window is less)."""
        if self.context_len is not None:
            return self.context_len
        return self.stream.seen if self.stream is not None else self._offset

    # -- mlx-lm cache protocol -------------------------------------------------------------
    def update_and_fetch(self, keys, values):
        n_new = keys.shape[2]
        if not self.compressed:
            if n_new == 1 and self._saw_prefill:
                # Inside mlx_lm.generate: the first single-token step follows the chunked prefill.
                self.compress()
            elif n_new > 1:
                self._saw_prefill = True
        if self._checked is not self.layout:  # once per layout: the caller does not change between tokens
            if self.layout.padded_heads:
                _attention.check_caller_routed("holds per-head rows (adaptive head budgets or nestedkv.stack)")
                self._checked = self.layout
            elif self.quantized and self.hadamard:
                _attention.check_caller_routed("holds keys quantized after a Hadamard rotation (kv_hadamard)")
                self._checked = self.layout
        if not self.compressed and self.press.prefill == "streaming":
            eviction.stream_step(self, keys)
        if self.quantized:  # after the compress above: new rows join the kept ones quantized
            keys, values = self._quantize(keys, rotate=self.hadamard), self._quantize(values)
        self.layout.append(keys, values, self.stored, self.n_ctx_rows, self.step)
        self.stored += n_new
        self._offset += n_new
        if self.stream is not None and self.positions is not None:
            self._reposition = self._offset + self._chunk > self.positions
        self._note_peak()
        if self.layout.ragged_heads:  # one flat buffer and where each head's rows are: one attention call
            return self.layout.head_rows_of(self.stored, self.n_ctx_rows)
        return self.keys_and_values()

    @property
    def head_keys(self) -> Optional[list]:
        """Per-head layout: each head's rows ``[1, 1, rows_h + appended, D]``."""
        return self.keys_and_values()[0] if self.layout.ragged_heads else None

    @property
    def head_values(self) -> Optional[list]:
        return self.keys_and_values()[1] if self.layout.ragged_heads else None

    def keys_and_values(self):
        return self.layout.fetch(self.stored, self.n_ctx_rows)

    def make_mask(self, N, return_array=False, window_size=None):
        model = _attention.calling_model()  # a loaded cache never went through make_cache
        if model is not None:
            route(model, required=False)
        # Keys are the stored rows: "causal" aligns to their end, arrays are built over them.
        return create_attention_mask(N, offset=self.stored, return_array=return_array, window_size=window_size)

    def size(self):
        return self.stored

    def empty(self):
        return self.layout.empty

    def trim(self, n):
        """Drop up to ``n`` of the newest rows. Evicted or compressed context rows are never cut: only rows
        appended after them go (one compressed document, many questions)."""
        floor = self.n_ctx_rows if self.kept is not None else 0
        n = max(0, min(self.stored - floor, n))
        if self.stream is not None and n:
            raise ValueError("trim during a streaming prefill is not supported: compress first")
        self.stored -= n
        self._offset -= n
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

    @property
    def quant(self) -> Optional[tuple]:
        """(bits, group_size, hadamard) once quantized, else None."""
        return (self.bits, self.group_size, self.hadamard) if self.quantized else None

    def set_quant(self, quant: Optional[tuple]) -> None:
        vars(self).pop("bits", None)
        if quant is not None:
            self.bits, self.group_size, self.hadamard = quant

    def _quantize(self, x: mx.array, rotate: bool = False) -> tuple:
        return tuple(mx.quantize(buf.hadamard(x) if rotate else x, group_size=self.group_size, bits=self.bits))

    def _quantize_rows(self) -> None:
        """Quantize the rows compression kept, once (they were scored before, on the real keys); rows appended
        later have the same head dimension, so the group size is checked here only."""
        head_dim = self.layout.buffers()[0].shape[-1]
        check_divides(self.press.kv_group_size, head_dim)
        if self.press.kv_hadamard:
            buf.check_hadamard(head_dim)
        self.set_quant((self.press.kv_bits, self.press.kv_group_size, self.press.kv_hadamard))
        self.layout.quantize(lambda x: self._quantize(x, rotate=self.hadamard), self._quantize, self.stored)
        mx.eval(self.layout.buffers())  # so the unquantized buffers are freed

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
        return self.layout.nbytes

    # Peak resident K/V bytes, noted after every update, compression and load (the transient second buffer
    # of a reallocation or an eviction lives for one operation and is not counted).
    def _note_peak(self) -> None:
        self.peak_nbytes = max(self.peak_nbytes, self.nbytes)

    def reset_peak(self) -> None:
        """Start a new peak window: the peak becomes what is resident now."""
        self.peak_nbytes = self.nbytes

    @property
    def state(self):
        k, v, hk, hv = self.layout.saved(self.stored, self.n_ctx_rows)
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
        keys, values, self.kept, valid, offset, stored, context_len, n_ctx_rows, saw, press_json = v[:10]
        hk, hv, planned, stream, rope_json = v[10:]
        self.rope_spec = json.loads(rope_json) if rope_json else None
        self.offset, self.stored, self.n_ctx_rows = int(offset), int(stored), int(n_ctx_rows)
        self.context_len = None if int(context_len) < 0 else int(context_len)
        self._saw_prefill = bool(saw)
        self.press = BasePress.from_json(press_json)
        self.set_quant(None)
        if self.compressed and self.press.kv_bits is not None:
            # save_prompt_cache stores tuples as lists; lists of arrays mean per-head rows to the attention
            self.set_quant((self.press.kv_bits, self.press.kv_group_size, self.press.kv_hadamard))
            keys, values = buf.as_tuple(keys), buf.as_tuple(values)
            hk, hv = (None, None) if hk is None else ([tuple(h) for h in hk], [tuple(h) for h in hv])
        self.planned_len = None if planned is None or int(planned) < 0 else int(planned)
        if hk is not None:
            self.layout = PerHead.from_heads(list(hk), list(hv), [int(x) for x in self.kept[0].tolist()])
        else:
            self.layout = Dense(keys, values, valid)
        self.stream = None if stream is None else StreamState.from_state(self.press, stream)
        self.peak_nbytes = self.nbytes

    # -- compression -----------------------------------------------------------------------
    def _keep(self) -> Optional[int]:
        """Rows per head a streaming press keeps (None: nothing to evict). Ratios apply to the planned length;
        without one only an absolute budget can stream (checked in ``eviction.stream_step``). Past the
        window no head keeps more than ``eviction.row_cap``."""
        n = self.planned_len if self.planned_len is not None else sys.maxsize
        keep = self.press.n_keep(n)
        if self.positions is None:
            return keep
        return min(n if keep is None else keep, eviction.row_cap(self))

    def _rows_kept(self) -> int:
        """Real (head, row) pairs stored, over all heads of batch entry 0."""
        if self.stored == 0:
            return 0
        if self.kept is None:
            return self.stored * self.layout.batch_heads[1]
        return int(mx.sum(self.kept[0]).item()) + (self.stored - self.n_ctx_rows) * self.kept.shape[1]

    def _rows(self):
        """The stored rows as dense ``(keys, values, valid)`` ``[B, H, stored, D]`` in any layout; ``valid``
        (None when no head is padded) covers every row. Per-head rows are padded transiently (one layer)."""
        k, v, valid = self.padded()
        return k, v, pad_valid(valid, buf.parts(k)[0].shape[2])

    def _select_stored(self, keep: int):
        keys, values, valid = self._rows()
        scores = self.stream.scores(keys, valid, self.unrope)
        sel = self.press.select_scores(scores, keep, cap=eviction.row_cap(self))
        return keys, values, sel

    def _evict(self, keep: int) -> None:
        """Keep ``keep`` rows per head (``H * keep`` per layer, adaptive) of the stored rows, by streaming scores."""
        keys, values, sel = self._select_stored(keep)
        self._gather(keys, values, sel)
        self.stream.take(sel.indices)
        self._unpad()  # ragged heads hold their rows unpadded between evictions too

    def _move_rows(self) -> None:
        eviction.move_rows(self)

    def _gather(self, keys, values, sel) -> None:
        idx = sel.indices[..., None]
        self.layout = Dense(mx.take_along_axis(keys, idx, axis=2), mx.take_along_axis(values, idx, axis=2),
                            sel.valid)
        self.stored = self.n_ctx_rows = sel.indices.shape[2]
        self.kept = sel.counts

    def _unpad(self) -> None:
        """Padded rows of a single entry (B = 1) -> the per-head layout: each KV head keeps its real rows."""
        if isinstance(self.layout, Dense) and self.layout.valid is not None and self.layout.batch_heads[0] == 1:
            self.layout = self.layout.per_head()
            self.n_ctx_rows = self.stored = max(self.layout.head_rows)

    def compress(self, scores: Optional[mx.array] = None, keep: Optional[int] = None) -> None:
        """Score the context and keep the press's budget (streaming: the rows still stored, scored with the
        running statistics). ``scores``: ``[B, H, N]`` a model-scoring press computed for the whole context;
        ``keep``: the rows per head it allots this layer (``BasePress.layer_keeps``). A second call is a no-op."""
        if self.compressed:
            return
        if self.empty() or self.stored == 0:
            raise ValueError("compress() called on an empty cache: prefill the context first")
        n = self.stored
        streamed = self.stream is not None and self.stream.evicted
        self.context_len = self.positions_seen
        sel = None
        if not streamed:
            # Nothing evicted yet: every key of the context is here, score it whole (exact).
            keys, values = self.keys[..., :n, :], self.values[..., :n, :]
            sel = (self.press.select(keys, unrope=self.unrope) if scores is None
                   else self.press.select_model_scores(scores, keep))
        else:
            keep = self._keep()
            if keep is not None and self._rows_kept() > keep * self.kept.shape[1]:
                keys, values, sel = self._select_stored(keep)
            if self.positions is not None:  # the question follows the kept rows at their positions 0..R-1
                if sel is not None:
                    self._gather(keys, values, sel)
                    self.stream.take(sel.indices)
                    sel = None
                self._move_rows()
                n = self.stored
        self.stream = None
        if sel is not None:
            self._gather(keys, values, sel)
        else:  # nothing (more) to evict: the rows after the kept ones join the context
            if self.kept is None:
                self.kept = mx.full(self.layout.batch_heads, n, dtype=mx.int32)
            else:
                tail = n - self.n_ctx_rows
                self.kept = self.kept + tail
                self.layout.extend_context(tail, n)
            self.n_ctx_rows = n
        self._unpad()
        if self.press.kv_bits is not None:
            self._quantize_rows()
        self._note_peak()

    def padded(self):
        """This layer's rows as ``(keys, values, valid)``: ``[B, H, n_ctx_rows + appended, D]`` with context rows
        padded per head and ``valid`` ``[B, H, n_ctx_rows]`` (None when no head is padded)."""
        return self.layout.padded(self.stored, self.n_ctx_rows, self.kept)

    def memory(self, layer: int) -> LayerMemory:
        """Accounting for this layer in its real dtype (see LayerMemory)."""
        return layer_memory(self, layer)


# load_prompt_cache looks cache classes up by name in mlx_lm.models.cache.
mlx_cache.NestedKVCache = NestedKVCache


def route(model, required: bool) -> bool:
    """Whether the model's attention is routed. Adaptive budgets need the attention hook; elsewhere it serves
    the CPU fast path and rotated quantized keys, so a model without it runs as is."""
    routed = install_attention_hook(model, required=required)
    install_swiglu_hook(model)
    return routed
