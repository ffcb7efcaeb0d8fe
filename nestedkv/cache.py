"""A drop-in mlx-lm KV cache that compresses its context (the public functions; one layer is
``kvcache.NestedKVCache``, its rows a layout of ``layouts.py``, batching in ``batching.py``).

Layout of one layer after compression, per KV head::

    [ kept context rows (ascending original positions) | appended question/decode rows | free ]

mlx-lm's ``merge`` into a ``BatchKVCache`` is refused: that would silently drop the compression; ``stack``
batches compressed caches for decode instead.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Optional

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from nestedkv.attention import install_attention_hook  # noqa: F401  (kept importable from here)
from nestedkv.batching import stack, take  # noqa: F401  (public here)
from nestedkv.buffers import check_divides, check_hadamard
from nestedkv.kvcache import NestedKVCache, check_context_len, route
from nestedkv import introspect
from nestedkv.introspect import model_type
from nestedkv.layer_kinds import (FULL, copy_layer, is_cache_list, is_kept_as_is, kind_of, kinds, leaves,
                                  remember_context, restore_context)
from nestedkv.press import BasePress
from nestedkv.probe import Instruction


def make_cache(model, press: Optional[BasePress] = None, context_len: Optional[int] = None,
               positions: Optional[int] = None) -> list:
    """One NestedKVCache per full-attention cache; a drop-in ``prompt_cache`` for mlx-lm. The sliding-window,
    chunked and state caches of hybrid models (Gemma 3, gpt-oss, Qwen3-Next, Llama 4, ...) keep mlx-lm's own, and
    a layer with several caches (``CacheList``) keeps its container with each full-attention cache in it replaced.

    ``context_len``: the document's token count, needed by ``prefill="streaming"`` presses with a
    compression ratio (their budget is a share of the whole document, evicted before it has all arrived).
    ``positions``: read a streaming document of any length within this many rope positions (the model's
    window less the room its question and answer need): each head keeps at most ``positions`` less two
    chunks, and the kept rows are moved to positions 0..R-1 whenever the next chunk would pass the limit.

    What each full-attention cache holds is learned once per model by running it on a few tokens
    (``nestedkv.introspect``): the rope its keys carry and whether its attention can read per-head rows. A layer
    where a setting of the press cannot apply runs the nearest one that can and says so (``adapted``): keys no
    known rope undoes are scored as cached, an attention that computes its own softmax gets uniform head budgets.

    Routes this model instance's attention through ``attention.attention`` where it can (required for
    adaptive budgets) and its SwiGLU through ``activations.swiglu``, whatever cache it runs with; other
    models and mlx-lm's modules are left alone. Both are mlx-lm's functions unless the CPU fast path is on
    (``nestedkv.enable_cpu_fast_path``): then on the CPU long prefill chunks take the row-split attention and
    exp is a power of 2 (each within 1e-6 of mlx's, not bit-identical).
    """
    if press is not None and not isinstance(press, BasePress):
        raise TypeError(f"press must be a nestedkv press, got {type(press).__name__}")
    context_len = check_context_len(context_len)
    facts = check_model(model)
    defaults = model.make_cache() if hasattr(model, "make_cache") else [KVCache() for _ in model.layers]
    hybrid = len(set(kinds(defaults))) > 1 or any(is_cache_list(c) for c in defaults)
    if positions is not None and hybrid:
        raise ValueError("positions (reading past the window) moves keys to new rope positions, which the "
                         "sliding-window and state layers of this hybrid model cannot follow")
    if positions is not None and (press is None or press.prefill != "streaming"):
        raise ValueError("positions (reading past the window) needs a press with prefill='streaming': only "
                         "eviction while prefilling keeps a document of any length within the window")
    if press is not None and press.needs_model:
        unrouted = [f.writer for f in facts if not f.routed]
        if hybrid:
            raise ValueError(f"press {press.name!r} scores with the model on full-attention models only; "
                             f"{model_type(model)} has sliding-window, state or several caches in a layer: use a "
                             "key-only press (nestedkv, keydiff)")
        if unrouted:
            raise ValueError(f"press {press.name!r} reads the model's queries: the attention of "
                             f"{model_type(model)} ({unrouted[0]}) does not call mlx-lm's "
                             "scaled_dot_product_attention; use a key-only press (nestedkv, keydiff)")
    if press is not None and press.kv_bits is not None:
        for f in facts:
            check_divides(press.kv_group_size, f.head_dim)
        if any(getattr(m, "sinks", None) is not None for _, m in model.named_modules()):
            raise ValueError(f"kv_bits: {model_type(model)} has attention sinks, which mlx's quantized "
                             "attention does not support: run it with kv_bits=None")

    def nested(c, i):
        return NestedKVCache(press, context_len, positions) if kind_of(c, i) == FULL else c

    cache = []
    for i, c in enumerate(defaults):
        if is_cache_list(c):
            c.caches = tuple(nested(s, i) for s in c.caches)
            cache.append(c)
        else:
            cache.append(nested(c, i))
    _bind(cache, model, press, facts)
    if positions is not None and any(f.rope is None for f in facts):
        raise ValueError(f"reading past the window moves keys to new rope positions: {model_type(model)} has "
                         f"{next(f for f in facts if f.rope is None).rope_reason}")
    return cache


def check_model(model) -> list:
    """Raise ``ValueError`` in one line naming the model type when NestedKV cannot compress this model: no
    cache that grows with the document, a cache type it does not know, caches whose rows must stay aligned, or
    a forward pass that fails on this device. Returns the facts of its full-attention caches
    (``nestedkv.introspect``); routes its attention and SwiGLU (``make_cache``)."""
    defaults = model.make_cache() if hasattr(model, "make_cache") else [KVCache() for _ in model.layers]
    try:
        layer_kinds = kinds(defaults)
    except ValueError as exc:
        raise ValueError(f"{model_type(model)}: {exc}") from None
    if FULL not in layer_kinds:
        raise ValueError(f"{model_type(model)} has no full-attention (KVCache) layer: nothing grows with the "
                         "document, so there is nothing for NestedKV to compress")
    route(model, required=False)
    facts = introspect.probe(model)
    aligned = introspect.aligned_lists(model, facts)
    if aligned:
        raise ValueError(f"{model_type(model)}: layer {aligned[0]} holds several caches written by one attention "
                         "(an indexer over its keys: sparse attention), whose rows must stay aligned; NestedKV "
                         "cannot evict rows from one of them without the others")
    return facts


def unfit(model, press: BasePress) -> Optional[str]:
    """Why ``press`` cannot run on ``model`` (what ``make_cache`` refuses, in one line), or None."""
    try:
        make_cache(model, press, context_len=1 if press.prefill == "streaming" else None)
    except ValueError as exc:
        return str(exc)
    return None


def full_layers(cache) -> list[NestedKVCache]:
    """The caches NestedKV compresses, in ``leaves`` order."""
    return [c for c in leaves(cache) if isinstance(c, NestedKVCache)]


def layer_press(press: BasePress, facts: introspect.LayerFacts) -> tuple[BasePress, Optional[str]]:
    """The press one layer runs: ``press``, or the nearest to it this layer can run, and what was changed and
    why (None when nothing was)."""
    changes, notes = {}, []
    if press.unrotate and facts.rope is None:
        changes["unrotate"] = False
        notes.append(f"keys scored as cached: {facts.rope_reason}")
    routed_only = f"its attention ({facts.writer}) does not read rows laid out per head (a forward pass with " \
                  "them failed or gave other logits)"
    if press.head_budget == "adaptive" and facts.n_kv_heads == 1:
        changes["head_budget"] = "uniform"  # one head (MLA's latent): the same rows, a dense layout
    elif press.head_budget == "adaptive" and not facts.routed:
        changes["head_budget"] = "uniform"
        notes.append(f"uniform head budget: {routed_only}")
    elif press.head_budget == "adaptive" and facts.shared:
        changes["head_budget"] = "uniform"
        notes.append("uniform head budget: other layers read this layer's keys (KV sharing), and only "
                     "its own attention reads per-head rows")
    if press.kv_bits is not None and facts.shared:
        changes["kv_bits"] = None
        notes.append("kept rows not quantized: other layers read this layer's keys (KV sharing) as plain rows")
    if press.kv_bits is not None and press.kv_hadamard and not facts.routed:
        changes["kv_hadamard"] = False
        notes.append(f"quantized keys not rotated: rotated keys need nestedkv's attention to rotate the queries, "
                     f"and {routed_only}")
    return (replace(press, **changes) if changes else press), "; ".join(notes) or None


def _bind(cache: list, model, press: Optional[BasePress], facts=None) -> list:
    """Give each full-attention cache the facts of its layer (the rope its keys carry, kept by ``clone`` and
    saved files) and the press it runs (``layer_press``); without ``model``, the facts the layers already hold
    (a layer loaded from a file holds none and runs ``press`` as given)."""
    if facts is None:
        facts = introspect.probe(model) if model is not None else [c.facts for c in full_layers(cache)]
    for c, f in zip(full_layers(cache), facts):
        if f is None:
            continue
        c.rope_spec, c.facts = f.rope, f
        if press is not None:
            c.run_press = press
            c.press, c.adapted = layer_press(press, f)
    return cache


def check_group_size(model, group_size: int, hadamard: bool = False) -> None:
    """Quantized KV needs the group size to divide the head dimension of every compressed layer (and the
    rotation a size it has): say so before any prefill."""
    for d in sorted({f.head_dim for f in introspect.probe(model)}):
        check_divides(group_size, d)
        if hadamard:
            check_hadamard(d)


def _check_cache(cache) -> None:
    if not isinstance(cache, (list, tuple)) or not all(isinstance(c, NestedKVCache) or is_kept_as_is(c)
                                                           for c in leaves(cache)):
        raise TypeError("cache must be the list returned by nestedkv.make_cache(model, press)")


def compress(cache, model=None, tokens=None, prompt=(), scores=None, questions=()) -> None:
    """Compress every full-attention layer once, after the last chunk of the context (the layers mlx-lm keeps
    as is stay so); evaluates the result. A press that scores with the model (``needs_model``) needs ``model``
    and the context's ``tokens``; ``prompt``: its instruction (KVzip's "repeat the context"), a
    ``nestedkv.Instruction`` or a token list; ``questions``: the token lists a question-aware press
    (``needs_questions``) lets pick the rows.
    ``scores``: what ``model_scores`` gave for this context under a press of the same ``scoring_key`` (a
    sweep scores once for all its budgets)."""
    _check_cache(cache)
    full = full_layers(cache)
    press = press_of(cache)
    if scores is None and press.needs_model and not full[0].compressed:
        # A steered stream is read by its questions once more, the last chunk's rows among them.
        scores = (steer(cache, model, questions) if press.prefill == "streaming"
                  else model_scores(cache, model, tokens, prompt, questions))
    layers = leaves(cache)
    scores = scores or [None] * len(layers)
    keeps = press.layer_keeps(scores) if any(s is not None for s in scores) else [None] * len(layers)
    for c, s, k in zip(layers, scores, keeps):
        if isinstance(c, NestedKVCache):
            c.compress(s, k)
            mx.eval(c.state)  # one layer's scoring buffers at a time, not every layer's at once
        else:
            remember_context(c)
    mx.eval(arrays(cache))


def model_scores(cache, model, tokens, prompt=(), questions=()) -> list:
    """One ``[B, H, N]`` score per layer of an uncompressed ``cache`` holding ``tokens``, from its press's
    pass with the model (``needs_model`` presses); nothing of the cache changes."""
    _check_cache(cache)
    press = press_of(cache)
    full = full_layers(cache)
    if len(full) < len(cache) or len(full) < len(leaves(cache)):  # its probe pass feeds full-attention caches only
        raise ValueError(f"press {press.name!r} scores with the model on full-attention models only; this "
                         "model has sliding-window or state layers: use a key-only press (nestedkv, keydiff)")
    if model is None or tokens is None:
        raise ValueError(f"press {press.name!r} scores keys with the model: call "
                         "nestedkv.compress(cache, model=model, tokens=context_ids)")
    if len(tokens) != full[0].stored:
        raise ValueError(f"press {press.name!r}: {len(tokens)} tokens given for a cache of {full[0].stored} "
                         "context positions")
    if not press.needs_questions:
        return press.model_scores(model, cache, list(tokens), Instruction.of(prompt))
    return press.model_scores(model, cache, list(tokens), Instruction.of(prompt), questions=_asked(press, questions))


def steer(cache, model, questions) -> list:
    """Between the chunks of a streaming prefill under a press that steers it (``snapkv``, uniform budgets;
    Finch-class reading): the questions score the rows the cache holds now, and the next chunk's eviction
    keeps the best. ``nestedkv.compress`` steers once more after the last chunk. Returns the scores."""
    _check_cache(cache)
    press = press_of(cache)
    if not (press.needs_questions and press.streams and press.prefill == "streaming"):
        raise ValueError(f"press {press.name!r} (prefill={press.prefill!r}) does not steer a streaming prefill")
    if model is None:
        raise ValueError(f"press {press.name!r} steers with the model: nestedkv.steer(cache, model, questions)")
    return press.steer(model, cache, _asked(press, questions))


def _asked(press, questions) -> list[list[int]]:
    asked = [list(q) for q in questions if len(q)]
    if not asked:
        raise ValueError(f"press {press.name!r} lets the document's questions pick the rows: give them "
                         "(nestedkv.compress(..., questions=[ids, ...])); none were given")
    return asked


def press_of(cache) -> BasePress:
    """The press of a cache list (its compressed layers'; a hybrid model's first layer may be one mlx-lm keeps)."""
    _check_cache(cache)
    first = full_layers(cache)[0]
    return first.run_press or first.press


def rewind(cache) -> None:
    """Every layer back to the compressed context (the rows of a question and its answer go): trimmed where
    NestedKV compresses, restored to the end of the context where mlx-lm keeps the layer as is."""
    _check_cache(cache)
    for c in leaves(cache):
        c.rewind() if isinstance(c, NestedKVCache) else restore_context(c)


def clone(cache, press: Optional[BasePress] = None, model=None) -> list[NestedKVCache]:
    """A copy of a cache, optionally (uncompressed caches only) under another press. Cheap: MLX arrays are
    immutable, so the copies share the keys and values until one of them writes. ``model``: the model
    the cache belongs to, for a press that scores unrotated keys of a cache that was loaded from disk."""
    _check_cache(cache)
    if press is not None and not isinstance(press, BasePress):
        raise TypeError(f"press must be a nestedkv press, got {type(press).__name__}")

    def copied(c):
        if is_kept_as_is(c):
            return copy_layer(c)
        d = copy.copy(c)
        d.layout = c.layout.copy(c.stored)
        if c.stream is not None:
            d.stream = c.stream.copy()
        if press is not None:
            if c.compressed or c.stream is not None or c.kept is not None:
                raise ValueError("clone(cache, press) needs an uncompressed cache that evicted nothing")
            d.press, d.run_press, d.adapted = press, None, None
        return d

    out = []
    for c in cache:
        if is_cache_list(c):
            d = copy.copy(c)
            d.caches = tuple(copied(s) for s in c.caches)
            out.append(d)
        else:
            out.append(copied(c))
    return _bind(out, model, press) if press is not None or model is not None else out


def arrays(cache) -> list:
    """Every array a cache list holds (for ``mx.eval``; a ``CacheList``'s state also names its classes)."""
    return [c.state for c in leaves(cache)]
