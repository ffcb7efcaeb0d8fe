"""Per-layer KV-memory accounting."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


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

    @property
    def kept_fraction(self) -> float:
        return self.bytes_kept / self.bytes_full if self.bytes_full else 1.0

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def layer_stats(cache) -> list[LayerMemory]:
    """One ``LayerMemory`` per layer of a cache list made by ``make_cache``."""
    return [c.memory(i) for i, c in enumerate(cache)]


def peak_kv_bytes(cache) -> list[int]:
    """Per layer, the largest resident K/V buffer bytes since the last ``reset_peak`` (or since creation)."""
    return [c.peak_nbytes for c in cache]


def reset_peak(cache) -> None:
    """Start a new peak window on every layer: each peak becomes what the layer holds now."""
    for c in cache:
        c.reset_peak()
