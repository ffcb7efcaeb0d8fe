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
from nestedkv.layer_kinds import FULL, copy_layer, is_kept_as_is, kind_of, remember_context, restore_context
from nestedkv.press import BasePress
from nestedkv.probe import Instruction
from nestedkv.rope import model_rope


def make_cache(model, press: Optional[BasePress] = None, context_len: Optional[int] = None,
               positions: Optional[int] = None) -> list:
    """One NestedKVCache per full-attention layer; a drop-in ``prompt_cache`` for mlx-lm. The sliding-window
    and state layers of hybrid models (Gemma 3, gpt-oss, Qwen3-Next, ...) keep mlx-lm's own cache.

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
    kinds = [kind_of(c, i) for i, c in enumerate(defaults)]
    if FULL not in kinds:
        raise ValueError(f"{type(model).__module__} has no full-attention (KVCache) layer: nothing grows "
                         "with the document, so there is nothing for NestedKV to compress")
    hybrid = len(set(kinds)) > 1
    if positions is not None and hybrid:
        raise ValueError("positions (reading past the window) moves keys to new rope positions, which the "
                         "sliding-window and state layers of this hybrid model cannot follow")
    if press is not None and press.kv_bits is not None:
        check_group_size(model, press.kv_group_size, press.kv_hadamard)
        if any(getattr(getattr(layer, "self_attn", None), "sinks", None) is not None for layer in model.layers):
            raise ValueError(f"kv_bits: {type(model).__module__} has attention sinks, which mlx's quantized "
                             "attention does not support: run it with kv_bits=None")
    if positions is not None and (press is None or press.prefill != "streaming"):
        raise ValueError("positions (reading past the window) needs a press with prefill='streaming': only "
                         "eviction while prefilling keeps a document of any length within the window")
    rotated = press is not None and press.kv_bits is not None and press.kv_hadamard
    if not route(model, required=press is not None and press.head_budget == "adaptive") and rotated:
        raise ValueError(f"kv_hadamard needs a model whose attention calls mlx-lm's scaled_dot_product_attention "
                         f"(the queries are rotated there); {type(model).__module__} does not: quantize "
                         "with kv_hadamard=False")
    cache = _bind([NestedKVCache(press, context_len, positions) if k == FULL else c
                   for k, c in zip(kinds, defaults)], model, press)
    if positions is not None and cache[0].rope_spec is None:
        raise ValueError(f"reading past the window moves keys to new rope positions: the model "
                         f"{type(model).__name__} has no rope module this can be done with")
    return cache


def _bind(cache: list, model, press: Optional[BasePress]) -> list:
    """Give the layers the model's rope (kept by ``clone`` and saved files), which presses scoring unrotated
    keys need; a model whose rope cannot be undone fails only such a press."""
    for i, c in enumerate(cache):
        if not isinstance(c, NestedKVCache):
            continue
        try:
            spec = model_rope(model, i)  # each layer its own (Gemma 3: local and global bases differ)
        except ValueError:
            if press is not None and press.unrotate:
                raise
            spec = None
        if spec is None and press is not None and press.unrotate:
            raise ValueError(f"unrotate=true: the model {type(model).__name__} has no rope module to undo; "
                             "set the press's unrotate=false")
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
    if not isinstance(cache, (list, tuple)) or not all(isinstance(c, NestedKVCache) or is_kept_as_is(c)
                                                           for c in cache):
        raise TypeError("cache must be the list returned by nestedkv.make_cache(model, press)")


def compress(cache, model=None, tokens=None, prompt=(), scores=None) -> None:
    """Compress every full-attention layer once, after the last chunk of the context (the layers mlx-lm keeps
    as is stay so); evaluates the result. A press that scores with the model (``needs_model``) needs ``model``
    and the context's ``tokens``; ``prompt``: its instruction (KVzip's "repeat the context"), a
    ``nestedkv.Instruction`` or a token list.
    ``scores``: what ``model_scores`` gave for this context under a press of the same ``scoring_key`` (a
    sweep scores once for all its budgets)."""
    _check_cache(cache)
    full = [c for c in cache if isinstance(c, NestedKVCache)]
    if scores is None and press_of(cache).needs_model and not full[0].compressed:
        scores = model_scores(cache, model, tokens, prompt)
    scores = scores or [None] * len(cache)
    keeps = press_of(cache).layer_keeps(scores) if any(s is not None for s in scores) else [None] * len(cache)
    for c, s, k in zip(cache, scores, keeps):
        if isinstance(c, NestedKVCache):
            c.compress(s, k)
        else:
            remember_context(c)
    mx.eval([c.state for c in cache])


def model_scores(cache, model, tokens, prompt=()) -> list:
    """One ``[B, H, N]`` score per layer of an uncompressed ``cache`` holding ``tokens``, from its press's
    pass with the model (``needs_model`` presses); nothing of the cache changes."""
    _check_cache(cache)
    press = press_of(cache)
    full = [c for c in cache if isinstance(c, NestedKVCache)]
    if len(full) < len(cache):  # its probe pass feeds full-attention caches only
        raise ValueError(f"press {press.name!r} scores with the model on full-attention models only; this "
                         "model has sliding-window or state layers: use a key-only press (nestedkv, keydiff)")
    if model is None or tokens is None:
        raise ValueError(f"press {press.name!r} scores keys with the model: call "
                         "nestedkv.compress(cache, model=model, tokens=context_ids)")
    if len(tokens) != full[0].stored:
        raise ValueError(f"press {press.name!r}: {len(tokens)} tokens given for a cache of {full[0].stored} "
                         "context positions")
    return press.model_scores(model, cache, list(tokens), Instruction.of(prompt))


def press_of(cache) -> BasePress:
    """The press of a cache list (its compressed layers'; a hybrid model's first layer may be one mlx-lm keeps)."""
    _check_cache(cache)
    return next(c.press for c in cache if isinstance(c, NestedKVCache))


def rewind(cache) -> None:
    """Every layer back to the compressed context (the rows of a question and its answer go): trimmed where
    NestedKV compresses, restored to the end of the context where mlx-lm keeps the layer as is."""
    _check_cache(cache)
    for c in cache:
        c.rewind() if isinstance(c, NestedKVCache) else restore_context(c)


def clone(cache, press: Optional[BasePress] = None, model=None) -> list[NestedKVCache]:
    """A copy of a cache, optionally (uncompressed caches only) under another press. Cheap: MLX arrays are
    immutable, so the copies share the keys and values until one of them writes. ``model``: the model
    the cache belongs to, for a press that scores unrotated keys of a cache that was loaded from disk."""
    _check_cache(cache)
    if press is not None and not isinstance(press, BasePress):
        raise TypeError(f"press must be a nestedkv press, got {type(press).__name__}")
    out = []
    for c in cache:
        if is_kept_as_is(c):
            out.append(copy_layer(c))
            continue
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
