"""Hybrid models: which layers NestedKV compresses, and what the other layers hold.

mlx-lm gives each layer its own cache. Only full-attention layers (``KVCache``) grow with the document, so
only they become ``NestedKVCache``; sliding-window layers (``RotatingKVCache``, already bounded by the
window) and state-space layers (``ArraysCache``, constant size) stay exactly as mlx-lm makes them.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from nestedkv.accounting import FULL, SLIDING, STATE  # noqa: F401  (the kinds, named where they are counted)


def kind_of(c, layer: int) -> str:
    """``full``, ``sliding`` or ``state`` for a layer's mlx-lm cache; any other cache type is refused."""
    if isinstance(c, KVCache) and type(c).__name__ in ("KVCache", "NestedKVCache"):
        return FULL
    if type(c) is RotatingKVCache:
        return SLIDING
    if isinstance(c, ArraysCache):
        return STATE
    raise ValueError(f"layer {layer} uses {type(c).__name__}; NestedKV supports models whose layers use "
                     "KVCache (compressed), RotatingKVCache or ArraysCache (kept as mlx-lm has them)")


def is_hybrid(model) -> bool:
    """Whether some layer of ``model`` keeps mlx-lm's own cache (sliding window or state): such a model's
    caches cannot be stacked for a batched decode."""
    caches = model.make_cache() if hasattr(model, "make_cache") else []
    return any(is_kept_as_is(c) for c in caches)


def is_kept_as_is(c) -> bool:
    """A layer NestedKV leaves to mlx-lm (sliding window or state)."""
    return isinstance(c, (RotatingKVCache, ArraysCache))


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
