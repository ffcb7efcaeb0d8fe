"""Per-layer KV-memory accounting."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Optional

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from nestedkv import buffers as buf
from nestedkv.layer_kinds import SLIDING, STATE, indexed_leaves, leaves



@dataclass(frozen=True)
class LayerMemory:
    """What one layer's KV cache holds, in the cache's real dtype.

    ``bytes_full`` is what an uncompressed cache would hold for the context seen so far,
    ``bytes_kept`` counts only rows that are attended to (logical), ``bytes_resident`` is what
    is actually allocated (padding of shorter heads and preallocated decode space included).
    """

    layer: int
    n_kv_heads: int
    head_dim: int
    dtype: str
    tokens_seen: int
    kept_min: int
    kept_max: int
    kept_mean: float
    bytes_full: int
    bytes_kept: int
    bytes_resident: int
    # Peak resident bytes of this layer's K/V buffers in each phase; filled in by whoever ran the phases.
    peak_prefill_kv_bytes: int = 0
    peak_decode_kv_bytes: int = 0
    # What the layer's cache is: "full" attention (compressed), "sliding" window or "state" (kept as is).
    kind: str = "full"
    # What this layer ran differently from the run's press, and why (None: the press as given).
    adapted: Optional[str] = None

    @property
    def kept_fraction(self) -> float:
        return self.bytes_kept / self.bytes_full if self.bytes_full else 1.0

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def _dims(b, bits):
    """(head dim, model dtype) of a K or V buffer."""
    if isinstance(b, tuple):  # packed uint32 words of 32 / bits values, scales in the model's dtype
        return b[0].shape[3] * 32 // bits, b[1].dtype
    return b.shape[3], b.dtype


def layer_memory(c, layer: int) -> LayerMemory:
    """Accounting for one NestedKVCache layer in its real dtype."""
    if c.empty():
        return LayerMemory(layer, 0, 0, "none", 0, 0, 0, 0.0, 0, 0, 0)
    k0, v0 = c.layout.buffers()
    B, H = c.layout.batch_heads
    bits = getattr(c, "bits", None)
    (dk, dtype), (dv, _) = _dims(k0, bits), _dims(v0, bits)
    # full: the model's dtype uncompressed; kept: rows as stored (quantized: packed values + scales + biases)
    full_row = (dk + dv) * dtype.size
    row_bytes = sum(x.shape[3] * x.dtype.size for x in buf.parts(k0) + buf.parts(v0))
    tail = c.stored - c.n_ctx_rows if c.kept is not None else 0
    kept = c.kept if c.kept is not None else mx.full((B, H), c.stored, dtype=mx.int32)
    seen = c.context_len + tail if c.compressed else c.positions_seen
    return LayerMemory(
        layer=layer,
        n_kv_heads=H,
        head_dim=dk,
        dtype=str(dtype).removeprefix("mlx.core."),
        tokens_seen=c.context_len if c.compressed else c.positions_seen,
        kept_min=int(mx.min(kept).item()),
        kept_max=int(mx.max(kept).item()),
        kept_mean=float(mx.mean(kept.astype(mx.float32)).item()),
        bytes_full=B * H * seen * full_row,
        bytes_kept=(int(mx.sum(kept).item()) + B * H * tail) * row_bytes,
        bytes_resident=c.nbytes,
        adapted=c.adapted,
    )


def other_memory(c, layer: int) -> LayerMemory:
    """Accounting of a layer kept as mlx-lm has it: what it holds is both its full and its kept bytes
    (nothing of it is evicted), and resident is what its arrays take."""
    nbytes = c.nbytes
    if isinstance(c, ArraysCache):
        arrays = [a for a in c.cache if a is not None]
        dtype = str(arrays[0].dtype).removeprefix("mlx.core.") if arrays else "none"
        return LayerMemory(layer, 0, 0, dtype, 0, 0, 0, 0.0, nbytes, nbytes, nbytes, kind=STATE)
    if c.keys is None:
        return LayerMemory(layer, 0, 0, "none", 0, 0, 0, 0.0, 0, 0, 0, kind=SLIDING)
    rows = min(c.offset, c.keys.shape[2])  # rows holding keys (the buffer may have grown past them)
    B, H, _, D = c.keys.shape
    held = B * H * rows * (D + c.values.shape[3]) * c.keys.dtype.size
    return LayerMemory(layer, H, D, str(c.keys.dtype).removeprefix("mlx.core."), c.offset, rows, rows,
                       float(rows), held, held, nbytes, kind=SLIDING)


def layer_stats(cache) -> list[LayerMemory]:
    """One ``LayerMemory`` per cache of a cache list made by ``make_cache`` (every layer, whatever its kind; a
    layer holding several caches, a ``CacheList``, has one per cache, each with the layer's number)."""
    return [c.memory(i) if hasattr(c, "memory") else other_memory(c, i) for i, c in indexed_leaves(cache)]


def peak_kv_bytes(cache) -> list[int]:
    """Per cache (``layer_stats``' order), the largest resident K/V buffer bytes since the last ``reset_peak``
    (or since creation)."""
    # The layers mlx-lm keeps as is have no peak of their own: what they hold now.
    return [c.peak_nbytes if hasattr(c, "peak_nbytes") else c.nbytes for c in leaves(cache)]


def reset_peak(cache) -> None:
    """Start a new peak window on every layer: each peak becomes what the layer holds now."""
    for c in leaves(cache):
        if hasattr(c, "reset_peak"):  # the layers mlx-lm keeps have no peak of their own
            c.reset_peak()
