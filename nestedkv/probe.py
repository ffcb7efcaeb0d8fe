"""Forward passes after a prefilled context that store nothing and show each layer's queries: what presses
scoring keys with the model (``BasePress.needs_model``: KVzip's reconstruction, Expected Attention's query
statistics) read before eviction.

Each layer runs on a ``ProbeCache``: the context's stored rows plus the fed chunk, the chunk dropped after the
call, so every fed chunk attends to the whole context and nothing else. ``attention.attention`` hands the
queries and keys of every call to the cache's ``observe``.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from nestedkv.attention import LOG2E, install_attention_hook


class ProbeCache(KVCache):
    """One layer's context rows ``[B, H, n, D]``; a fed chunk's rows are attended to, never kept."""

    def __init__(self, keys: mx.array, values: mx.array, observe: Callable):
        super().__init__()
        self.ctx_keys, self.ctx_values = keys, values
        self.n = keys.shape[2]
        self.offset = self.n
        self.observe = observe  # (queries [B, Hq, L, D], keys [B, H, n + L, D], values, scale) -> output or None

    def update_and_fetch(self, keys, values):
        self.offset += keys.shape[2]
        return (mx.concatenate([self.ctx_keys, keys], axis=2), mx.concatenate([self.ctx_values, values], axis=2))


def probe(model, cache, feeds: Sequence[Sequence[int]], observe: Callable, press_name: str,
          rows: Optional[int] = None) -> None:
    """Feed each token list of ``feeds`` after the context of ``cache`` (uncompressed, all positions stored),
    or after its first ``rows`` rows only (feeding the rest again recomputes their own queries);
    ``observe(layer, queries, keys, values, scale)`` sees every layer of every feed. Nothing is stored.
    Yields after each feed, so the caller evaluates what it gathered."""
    if not install_attention_hook(model, required=False):
        raise ValueError(f"press {press_name!r} reads the model's queries: {type(model).__module__} does not call "
                         "mlx-lm's scaled_dot_product_attention; use a key-only press (e.g. nestedkv)")
    probes = []
    for i, c in enumerate(cache):
        if c.compressed or c.kept is not None or c.stream is not None:
            raise ValueError(f"press {press_name!r} scores the whole context with the model: layer {i} already "
                             "evicted rows")
        end = c.stored if rows is None else rows
        k, v = c.keys[..., :end, :], c.values[..., :end, :]
        probes.append(ProbeCache(k, v, lambda q, kk, vv, s, i=i: observe(i, q, kk, vv, s)))
    for ids in feeds:
        model(mx.array(list(ids), dtype=mx.int32)[None], cache=probes)  # the logits are never evaluated
        for p in probes:
            p.offset = p.n
        yield


def probe_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, n: int) -> tuple:
    """The fed rows' attention output ``[B, Hq, L, D]`` and their softmax weights ``[B, H, g * L, n]`` on the
    first ``n`` (context) keys, fp32, each fed row seeing the context and the fed rows up to itself; query
    heads grouped by KV head. An observer returning the output spares the layer computing it again."""
    B, Hq, L, D = queries.shape
    H, S = keys.shape[1], keys.shape[2]
    g = Hq // H
    # log2 e folded into the queries: exp as a power of 2, about three times cheaper than exp on the CPU
    q = (queries.astype(mx.float32) * (scale * LOG2E)).reshape(B, H, g * L, D)
    s = q @ keys.astype(mx.float32).swapaxes(-1, -2)
    row = mx.tile(mx.arange(L), g)[:, None]  # the fed position of each grouped query row
    col = mx.arange(S)[None] - n
    s = mx.where(col <= row, s, -mx.inf)
    p = mx.power(2.0, s - mx.max(s, axis=-1, keepdims=True))
    p = p / mx.sum(p, axis=-1, keepdims=True)
    out = (p.astype(values.dtype) @ values).reshape(B, Hq, L, D)
    return out, p[..., :n]
