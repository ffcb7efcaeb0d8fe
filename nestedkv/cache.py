"""A drop-in mlx-lm KV cache that compresses its context once, after the last prefill chunk.

Layout of one layer's buffer after compression::

    [ kept context rows (ascending original positions) | appended question/decode rows | free ]
      n_ctx_rows                                          stored - n_ctx_rows

``offset`` is the true number of positions seen (RoPE reads it); ``stored`` is the row count.
In ``adaptive`` mode heads keep different counts: shorter heads are padded up to ``n_ctx_rows``
and ``valid`` marks real rows; the attention hook below masks the padding per layer and head.
"""

from __future__ import annotations

import copy
import sys
from typing import Optional, Sequence

import mlx.core as mx
import mlx_lm.models.base as mlx_base
import mlx_lm.models.cache as mlx_cache
from mlx_lm.models.cache import KVCache, create_attention_mask

from nestedkv.accounting import LayerMemory
from nestedkv.press import BasePress, NoPress


class NestedKVCache(KVCache):
    step = KVCache.step

    def __init__(self, press: Optional[BasePress] = None):
        super().__init__()
        if press is not None and not isinstance(press, BasePress):
            raise TypeError(f"press must be a nestedkv press (e.g. NestedKVPress), got {type(press).__name__}")
        self.press = press or NoPress()
        self.stored = 0
        self.context_len: Optional[int] = None  # positions compressed; None until compressed
        self.n_ctx_rows = 0
        self.kept: Optional[mx.array] = None  # [B, H] kept context rows per head
        self.valid: Optional[mx.array] = None  # [B, H, n_ctx_rows] bool, adaptive only
        self._saw_prefill = False

    @property
    def compressed(self) -> bool:
        return self.context_len is not None

    # -- mlx-lm cache protocol -------------------------------------------------------------
    def update_and_fetch(self, keys, values):
        if self.valid is not None and not getattr(self, "_hooked", False):
            # A loaded adaptive cache never went through make_cache: without the hook the
            # padded rows would silently be attended to.
            _hook_loaded_models()
            self._hooked = True
        n_new = keys.shape[2]
        if not self.compressed:
            if n_new == 1 and self._saw_prefill:
                # Inside mlx_lm.generate: the first single-token step follows the chunked prefill.
                self.compress()
            elif n_new > 1:
                self._saw_prefill = True
        prev = self.stored
        # Same growth policy as KVCache, indexed by rows instead of positions, so that with
        # nothing evicted the arrays (and outputs) are bit-identical to mlx-lm's.
        if self.keys is None or prev + n_new > self.keys.shape[2]:
            B, n_kv_heads, _, k_head_dim = keys.shape
            n_steps = (self.step + n_new - 1) // self.step
            new_k = mx.zeros((B, n_kv_heads, n_steps * self.step, k_head_dim), keys.dtype)
            new_v = mx.zeros((B, n_kv_heads, n_steps * self.step, values.shape[3]), values.dtype)
            if self.keys is not None:
                if prev % self.step != 0:
                    self.keys = self.keys[..., :prev, :]
                    self.values = self.values[..., :prev, :]
                self.keys = mx.concatenate([self.keys, new_k], axis=2)
                self.values = mx.concatenate([self.values, new_v], axis=2)
            else:
                self.keys, self.values = new_k, new_v
        self.stored += n_new
        self.offset += n_new
        self.keys[..., prev : self.stored, :] = keys
        self.values[..., prev : self.stored, :] = values
        return self.keys_and_values()

    def keys_and_values(self):
        if self.stored < self.keys.shape[2]:
            return self.keys[..., : self.stored, :], self.values[..., : self.stored, :]
        return self.keys, self.values

    def make_mask(self, N, return_array=False, window_size=None):
        # Keys are the stored rows: "causal" aligns to their end, arrays are built over them.
        return create_attention_mask(N, offset=self.stored, return_array=return_array, window_size=window_size)

    def size(self):
        return self.stored

    def empty(self):
        return self.keys is None

    def trim(self, n):
        """Drop up to ``n`` of the newest rows. After compression only appended rows can go, so
        ``trim`` never cuts into the compressed context (one compressed document, many questions)."""
        floor = self.n_ctx_rows if self.compressed else 0
        n = max(0, min(self.stored - floor, n))
        self.stored -= n
        self.offset -= n
        return n

    def rewind(self) -> int:
        """Trim back to the compressed context; returns the rows dropped."""
        return self.trim(self.stored)

    @property
    def appended(self) -> int:
        return self.stored - self.n_ctx_rows if self.compressed else 0

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        raise ValueError(
            "NestedKVCache cannot be converted to a quantized cache (kv_bits): "
            "compression and KV quantization are not combined; leave kv_bits unset"
        )

    @classmethod
    def merge(cls, caches):
        raise ValueError(
            "NestedKVCache cannot be merged into a batch cache: each document is compressed on its own "
            "(per-sample budgets); run documents one at a time or use mlx-lm's KVCache for batching"
        )

    @property
    def nbytes(self):
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    @property
    def state(self):
        if self.keys is None:
            k = v = None
        else:
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
        )

    @state.setter
    def state(self, v):
        keys, values, self.kept, self.valid, offset, stored, context_len, n_ctx_rows, saw, press_json = v
        self.keys, self.values = keys, values
        self.offset, self.stored, self.n_ctx_rows = int(offset), int(stored), int(n_ctx_rows)
        self.context_len = None if int(context_len) < 0 else int(context_len)
        self._saw_prefill = bool(saw)
        self.press = BasePress.from_json(press_json)

    # -- compression -----------------------------------------------------------------------
    def compress(self) -> None:
        """Score the whole context once and keep the press's budget. A second call is a no-op."""
        if self.compressed:
            return
        if self.keys is None or self.stored == 0:
            raise ValueError("compress() called on an empty cache: prefill the context first")
        n = self.stored
        keys, values = self.keys[..., :n, :], self.values[..., :n, :]
        sel = self.press.select(keys)
        B, H = keys.shape[:2]
        self.context_len = n
        if sel is None:
            self.n_ctx_rows = n
            self.kept = mx.full((B, H), n, dtype=mx.int32)
            return
        idx = sel.indices[..., None]
        self.keys = mx.take_along_axis(keys, idx, axis=2)
        self.values = mx.take_along_axis(values, idx, axis=2)
        self.stored = self.n_ctx_rows = sel.indices.shape[2]
        self.kept, self.valid = sel.counts, sel.valid

    def head_mask(self, mask, n_q_heads: int, n_queries: int, n_keys: int):
        """The attention mask with this layer's padded rows hidden, per KV head: ``[B, Hq, L, S]``."""
        B, H, R = self.valid.shape
        rows = mx.concatenate([self.valid, mx.ones((B, H, n_keys - R), dtype=mx.bool_)], axis=-1)
        rows = mx.repeat(rows, n_q_heads // H, axis=1)[:, :, None, :]
        if mask is None:
            return rows
        if isinstance(mask, str):
            if mask != "causal":
                raise ValueError(f"unsupported attention mask {mask!r}")
            q = mx.arange(n_keys - n_queries, n_keys)[:, None]
            mask = q >= mx.arange(n_keys)[None]
        if mask.dtype == mx.bool_:
            return rows & mask
        return mx.where(rows, mask, mx.finfo(mask.dtype).min)

    def memory(self, layer: int) -> LayerMemory:
        """Accounting for this layer in its real dtype (see LayerMemory)."""
        if self.keys is None:
            return LayerMemory(layer, 0, 0, "none", 0, 0, 0, 0.0, 0, 0, 0)
        B, H, _, dk = self.keys.shape
        dv = self.values.shape[3]
        row_bytes = (dk * self.keys.dtype.size + dv * self.values.dtype.size)
        seen = self.context_len if self.compressed else self.stored
        kept = self.kept if self.compressed else mx.full((B, H), self.stored, dtype=mx.int32)
        appended = self.appended
        return LayerMemory(
            layer=layer,
            n_kv_heads=H,
            head_dim=dk,
            dtype=str(self.keys.dtype).removeprefix("mlx.core."),
            tokens_seen=seen,
            kept_min=int(mx.min(kept).item()),
            kept_max=int(mx.max(kept).item()),
            kept_mean=float(mx.mean(kept.astype(mx.float32)).item()),
            bytes_full=B * H * (seen + appended) * row_bytes,
            bytes_kept=(int(mx.sum(kept).item()) + B * H * appended) * row_bytes,
            bytes_resident=self.nbytes,
        )


# load_prompt_cache looks cache classes up by name in mlx_lm.models.cache.
mlx_cache.NestedKVCache = NestedKVCache


# -- attention hook for adaptive head budgets ---------------------------------------------------
# mlx-lm builds one mask from the first layer's cache for all layers, so a per-layer, per-head
# mask cannot come from make_mask. Model modules call the `scaled_dot_product_attention` they
# imported from mlx_lm.models.base; we swap that name for a wrapper that adds the head mask for
# NestedKVCache layers holding padded rows and passes everything else through untouched.
_sdpa = mlx_base.scaled_dot_product_attention


def attention(queries, keys, values, cache, scale, mask, sinks=None):
    if isinstance(cache, NestedKVCache) and cache.valid is not None:
        mask = cache.head_mask(mask, queries.shape[1], queries.shape[2], keys.shape[2])
    return _sdpa(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def _hook_loaded_models() -> None:
    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_lm.models.") and getattr(module, "scaled_dot_product_attention", None) is _sdpa:
            module.scaled_dot_product_attention = attention


def _attention_modules(model):
    for layer in model.layers:
        attn = getattr(layer, "self_attn", None) or getattr(layer, "attention", None)
        yield sys.modules[type(attn).__module__] if attn is not None else None


def install_attention_hook(model) -> None:
    """Route the model's attention through ``attention`` (idempotent); raise if it cannot be."""
    for module in _attention_modules(model):
        fn = getattr(module, "scaled_dot_product_attention", None) if module else None
        if fn is _sdpa:
            module.scaled_dot_product_attention = attention
        elif fn is not attention:
            raise ValueError(
                f"head_budget='adaptive' needs a model whose attention calls mlx-lm's "
                f"scaled_dot_product_attention; {type(model).__module__} does not. Use head_budget='uniform'"
            )


# -- public API ------------------------------------------------------------------------------
def make_cache(model, press: Optional[BasePress] = None) -> list[NestedKVCache]:
    """One NestedKVCache per layer; a drop-in ``prompt_cache`` for mlx-lm."""
    if press is not None and not isinstance(press, BasePress):
        raise TypeError(f"press must be a nestedkv press, got {type(press).__name__}")
    defaults = model.make_cache() if hasattr(model, "make_cache") else [KVCache() for _ in model.layers]
    for i, c in enumerate(defaults):
        if type(c) is not KVCache:
            raise ValueError(
                f"layer {i} uses {type(c).__name__}; NestedKV compresses only full-attention KVCache layers"
            )
    if press is not None and press.head_budget == "adaptive":
        install_attention_hook(model)
    return [NestedKVCache(press) for _ in defaults]


def _check_cache(cache) -> None:
    if not isinstance(cache, (list, tuple)) or not all(isinstance(c, NestedKVCache) for c in cache):
        raise TypeError("cache must be the list returned by nestedkv.make_cache(model, press)")


def compress(cache) -> None:
    """Compress every layer once, after the last chunk of the context; evaluates the result."""
    _check_cache(cache)
    for c in cache:
        c.compress()
    mx.eval([(c.keys, c.values, c.kept, c.valid) for c in cache])


def clone(cache, press: Optional[BasePress] = None) -> list[NestedKVCache]:
    """A copy of an uncompressed cache, optionally under another press. Cheap: MLX arrays are
    immutable, so the copies share the prefilled keys and values until one of them writes."""
    _check_cache(cache)
    if press is not None and not isinstance(press, BasePress):
        raise TypeError(f"press must be a nestedkv press, got {type(press).__name__}")
    out = []
    for c in cache:
        d = copy.copy(c)
        if c.keys is not None:
            # New array objects: slice assignment rebinds the Python object in place, so sharing
            # the objects themselves would let the copy write into the original.
            d.keys, d.values = c.keys[..., : c.stored, :], c.values[..., : c.stored, :]
        if press is not None:
            if c.compressed:
                raise ValueError("clone(cache, press) needs an uncompressed cache: this one is compressed")
            d.press = press
        out.append(d)
    return out


def stack(caches: Sequence[list]) -> list:
    """One batch cache (B = len(caches)) per layer from compressed single-document caches that hold the
    same context and the same appended rows (the question), each with its own kept context rows.

    Row layout per batch entry: ``[its kept context rows | padding up to the longest | appended rows]``;
    the padding is marked invalid (``valid``), so the attention hook masks it per batch entry and head,
    exactly like the padding of adaptive head budgets. RoPE offsets are equal (same positions seen).
    """
    out = []
    for layer in zip(*caches):
        first = layer[0]
        if any(c.offset != first.offset or c.appended != first.appended or not c.compressed for c in layer):
            raise ValueError("stack needs compressed caches of the same context and appended rows")
        rows = max(c.n_ctx_rows for c in layer)
        ks, vs, valid = [], [], []
        for c in layer:
            k, v = c.keys_and_values()
            B, H, _, _ = k.shape
            pad = rows - c.n_ctx_rows
            n = c.n_ctx_rows
            zk = mx.zeros((B, H, pad, k.shape[3]), k.dtype)
            zv = mx.zeros((B, H, pad, v.shape[3]), v.dtype)
            ks.append(mx.concatenate([k[..., :n, :], zk, k[..., n:, :]], axis=2))
            vs.append(mx.concatenate([v[..., :n, :], zv, v[..., n:, :]], axis=2))
            ok = c.valid if c.valid is not None else mx.ones((B, H, n), dtype=mx.bool_)
            valid.append(mx.concatenate([ok, mx.zeros((B, H, pad), dtype=mx.bool_)], axis=2))
        s = NestedKVCache(NoPress())
        s.keys, s.values = mx.concatenate(ks, axis=0), mx.concatenate(vs, axis=0)
        s.kept, s.valid = mx.concatenate([c.kept for c in layer], axis=0), mx.concatenate(valid, axis=0)
        s.offset, s.context_len, s.n_ctx_rows = first.offset, first.context_len, rows
        s.stored = rows + first.appended
        out.append(s)
    return out
