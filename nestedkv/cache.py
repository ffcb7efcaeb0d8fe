"""A drop-in mlx-lm KV cache that compresses its context (the public functions; one layer is
``kvcache.NestedKVCache``, its rows a layout of ``layouts.py``, batching in ``batching.py``).

Layout of one layer after compression, per KV head::

    [ kept context rows (ascending original positions) | appended question/decode rows | free ]

mlx-lm's ``merge`` into a ``BatchKVCache`` is refused: that would silently drop the compression; ``stack``
batches compressed caches for decode instead.
"""

from __future__ import annotations

import copy
from typing import Optional

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from nestedkv.attention import install_attention_hook  # noqa: F401  (kept importable from here)
from nestedkv.batching import stack, take  # noqa: F401  (public here)
from nestedkv.buffers import check_divides, check_hadamard
from nestedkv.kvcache import NestedKVCache, check_context_len, route
from nestedkv.press import BasePress
from nestedkv.rope import model_rope


def make_cache(model, press: Optional[BasePress] = None, context_len: Optional[int] = None,
               positions: Optional[int] = None) -> list[NestedKVCache]:
    """One NestedKVCache per layer; a drop-in ``prompt_cache`` for mlx-lm.

    ``context_len``: the document's token count, needed by ``prefill="streaming"`` presses with a
    compression ratio (their budget is a share of the whole document, evicted before it has all arrived).
    ``positions``: read a streaming document of any length within this many rope positions (the model's
    window less the room its question and answer need): each head keeps at most ``positions`` less two
    chunks, and the kept rows are moved to positions 0..R-1 whenever the next chunk would pass the limit.

    Routes this model instance's attention through ``attention.attention`` where it can (required for
    adaptive budgets) and its SwiGLU through ``activations.swiglu``, whatever cache it runs with; other
    models and mlx-lm's modules are left alone. Both are mlx-lm's functions unless the CPU fast path is on
    (``nestedkv.enable_cpu_fast_path``): then on the CPU long prefill chunks take the row-split attention and
    exp is a power of 2 (each within 1e-6 of mlx's, not bit-identical).
    """
    if press is not None and not isinstance(press, BasePress):
        raise TypeError(f"press must be a nestedkv press, got {type(press).__name__}")
    context_len = check_context_len(context_len)
    defaults = model.make_cache() if hasattr(model, "make_cache") else [KVCache() for _ in model.layers]
    for i, c in enumerate(defaults):
        if type(c) is not KVCache:
            raise ValueError(
                f"layer {i} uses {type(c).__name__}; NestedKV compresses only full-attention KVCache layers"
            )
    if press is not None and press.kv_bits is not None:
        check_group_size(model, press.kv_group_size, press.kv_hadamard)
    if positions is not None and (press is None or press.prefill != "streaming"):
        raise ValueError("positions (reading past the window) needs a press with prefill='streaming': only "
                         "eviction while prefilling keeps a document of any length within the window")
    rotated = press is not None and press.kv_bits is not None and press.kv_hadamard
    if not route(model, required=press is not None and press.head_budget == "adaptive") and rotated:
        raise ValueError(f"kv_hadamard needs a model whose attention calls mlx-lm's scaled_dot_product_attention "
                         f"(the queries are rotated there); {type(model).__module__} does not: quantize "
                         "with kv_hadamard=False")
    cache = _bind([NestedKVCache(press, context_len, positions) for _ in defaults], model, press)
    if positions is not None and cache[0].rope_spec is None:
        raise ValueError(f"reading past the window moves keys to new rope positions: the model "
                         f"{type(model).__name__} has no rope module this can be done with")
    return cache


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


def check_group_size(model, group_size: int, hadamard: bool = False) -> None:
    """Quantized KV needs the group size to divide the head dimension (and the rotation a size it has):
    say so before any prefill."""
    args = getattr(model, "args", None)
    d = getattr(args, "head_dim", None) or (getattr(args, "hidden_size", 0) // max(1, getattr(args, "num_attention_heads", 1)))
    if d:
        check_divides(group_size, d)
        if hadamard:
            check_hadamard(d)


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
        d.layout = c.layout.copy(c.stored)
        if c.stream is not None:
            d.stream = c.stream.copy()
        if press is not None:
            if c.compressed or c.stream is not None or c.kept is not None:
                raise ValueError("clone(cache, press) needs an uncompressed cache that evicted nothing")
            d.press = press
        out.append(d)
    return _bind(out, model, press) if model is not None else out
