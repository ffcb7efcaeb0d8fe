"""Hybrid models: which layers NestedKV compresses, and what the other layers hold.

mlx-lm gives each layer its own cache. Only full-attention layers (``KVCache``) grow with the document, so
only they become ``NestedKVCache``; sliding-window and chunked layers (``RotatingKVCache``, ``ChunkedKVCache``,
already bounded) and state-space layers (``ArraysCache``, constant size) stay exactly as mlx-lm makes them. A
layer with several caches (``CacheList``: a state and an attention, or two attentions) is a container: each
cache in it is one of the kinds above (``leaves``).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, CacheList, ChunkedKVCache, KVCache, RotatingKVCache

FULL, SLIDING, STATE = "full", "sliding", "state"  # a layer's cache: compressed, window, state (kept as is)


def kind_of(c, layer: int) -> str:
    """``full``, ``sliding`` or ``state`` for a layer's mlx-lm cache; any other cache type is refused."""
    if isinstance(c, KVCache) and type(c).__name__ in ("KVCache", "NestedKVCache"):
        return FULL
    if type(c) in (RotatingKVCache, ChunkedKVCache):
        return SLIDING
    if isinstance(c, ArraysCache):
        return STATE
    raise ValueError(f"layer {layer} uses {type(c).__name__}; NestedKV supports models whose layers use "
                     "KVCache (compressed), RotatingKVCache, ChunkedKVCache or ArraysCache (kept as mlx-lm has "
                     "them), or a CacheList of these")


def is_cache_list(c) -> bool:
    return isinstance(c, CacheList)


def indexed_leaves(cache) -> list[tuple[int, object]]:
    """(layer, cache) for every cache of a cache list, those inside a ``CacheList`` in their order."""
    return [(i, s) for i, c in enumerate(cache) for s in (c.caches if is_cache_list(c) else (c,))]


def leaves(cache) -> list:
    """Every cache of a cache list, those inside a ``CacheList`` in their order."""
    return [s for _, s in indexed_leaves(cache)]


def kinds(cache) -> list[str]:
    """``kind_of`` each cache of ``leaves(cache)``."""
    return [kind_of(s, i) for i, s in indexed_leaves(cache)]


def is_hybrid(model) -> bool:
    """Whether some layer of ``model`` keeps mlx-lm's own cache (sliding window or state): such a model's
    caches cannot be stacked for a batched decode."""
    caches = model.make_cache() if hasattr(model, "make_cache") else []
    return any(is_cache_list(c) or is_kept_as_is(c) for c in caches)


def is_kept_as_is(c) -> bool:
    """A layer NestedKV leaves to mlx-lm (sliding window, chunk or state)."""
    return isinstance(c, (RotatingKVCache, ChunkedKVCache, ArraysCache))


def copy_layer(c):
    """An independent copy of a layer kept as mlx-lm has it. mlx-lm writes into these caches' arrays in
    place (slice assignment), so the copy gets its own array objects, not shared ones."""
    d = type(c).__new__(type(c))
    d.__dict__.update(c.__dict__)
    if isinstance(c, ArraysCache):
        d.cache = [None if a is None else mx.array(a) for a in c.cache]
    elif c.keys is not None:
        d.keys, d.values = mx.array(c.keys), mx.array(c.values)
    return d


def remember_context(c) -> None:
    """Keep this layer as it is at the end of the context, for ``restore_context``: mlx-lm's sliding window
    overwrites old rows and a state absorbs every token, so neither can be trimmed back after a question."""
    c.nestedkv_context = copy_layer(c)


def restore_context(c) -> None:
    """Back to what ``remember_context`` kept (a fresh copy, so the kept state stays for the next question)."""
    kept = vars(c).get("nestedkv_context")
    if kept is None:
        raise ValueError(f"a {type(c).__name__} layer can be rewound only to a context nestedkv.compress ended")
    vars(c).update(vars(copy_layer(kept)))
