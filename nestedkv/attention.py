"""Attention over compressed caches whose KV heads hold different rows.

Two layouts need more than mlx-lm's attention:

- padded (``valid`` [B, H, R] on the cache): every head is padded to R context rows; ``head_mask`` hides the
  padding per batch entry and KV head. Used by ``nestedkv.stack`` (batched decode of compressed caches).
- per-head (the cache returns lists of ``[B, 1, S_h, D]`` keys and values, one per KV head): adaptive head
  budgets stored without padding; each KV head attends with its own query group.

mlx-lm builds one mask from the first layer's cache for all layers, so a per-layer, per-head mask cannot come
from ``make_mask``. Model modules call the ``scaled_dot_product_attention`` they imported from
``mlx_lm.models.base``; ``install_attention_hook`` routes one model instance's attention layers to ``attention``
instead (``_routing``: the module and other models keep mlx-lm's), which handles the two layouts above and
passes everything else to mlx-lm's function.

On the CPU, long prefill chunks are also split by query rows (``row_plan``): mlx's CPU attention computes its
softmax on one thread, and its exp dominates prefill time past a few hundred context tokens, so row blocks
on several CPU streams use every core; causal blocks skip the keys they cannot see, and every block's scores
stay under ``_cpu.CHUNK_BYTES``. fp32 blocks under a causal or no mask take their softmax in NumPy
(``numpy_rows``: its vectorized exp), others and every shorter call (decode steps included) as
``softmax_attention``, whose exp is a power of 2 (mlx's CPU exp is about three times slower). Both only with
the CPU fast path (``nestedkv.enable_cpu_fast_path``); elsewhere (without it, Metal, CUDA, attention sinks)
mlx's attention runs as is.
"""

from __future__ import annotations

import sys

import mlx.core as mx
import mlx.nn as nn
import mlx_lm.models.base as mlx_base
import numpy as np

from nestedkv import _cpu, _routing
from nestedkv import buffers as buf
from nestedkv.layouts import HeadRows

_sdpa = mlx_base.scaled_dot_product_attention
NAME = "scaled_dot_product_attention"  # the global name mlx-lm's attention layers call it by
_ROUTED = "_nkv_routed"  # on a model instance: whether install_attention_hook routed some of its modules
_ROUTED = "_nkv_routed"  # on a model instance: whether install_attention_hook routed some of its modules
MIN_ROWS = 16  # query rows per block at least
LOG2E = 1.4426950408889634
PARALLEL_MIN_SCORES = 2**20  # B x query heads x rows x keys below which one call is as fast


def head_mask(valid: mx.array, mask, n_q_heads: int, n_queries: int, n_keys: int):
    """``mask`` with the padded context rows hidden per KV head: ``[B, Hq, L, S]``.

    ``valid`` [B, H, R] marks the real rows among the first R keys; keys past R (appended rows) are real.
    ``mask`` is None, ``"causal"`` (aligned to the end of the keys) or an array broadcastable to [B, Hq, L, S].
    """
    B, H, R = valid.shape
    rows = mx.concatenate([valid, mx.ones((B, H, n_keys - R), dtype=mx.bool_)], axis=-1)
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


def row_plan(B: int, n_q_heads: int, n_queries: int, n_keys: int, streams: int) -> list[list[tuple[int, int]]]:
    """Per CPU stream, the query-row blocks it computes: at least one block per stream, each block's fp32
    scores within ``_cpu.CHUNK_BYTES``; blocks go round-robin, so under a causal mask (later rows see more
    keys) the streams get similar work. Empty when one call is as fast."""
    scores = B * n_q_heads * n_queries * n_keys
    if n_queries < 2 * MIN_ROWS or scores < PARALLEL_MIN_SCORES:
        return []
    n = max(streams, -(-scores * 4 // _cpu.CHUNK_BYTES))
    n = min(n, n_queries // MIN_ROWS)
    bounds = [round(i * n_queries / n) for i in range(n + 1)]
    return [[(bounds[j], bounds[j + 1]) for j in range(i, n, streams)] for i in range(streams)]


def softmax_attention(queries, keys, values, scale: float, mask):
    """``softmax(Q K^T * scale + mask) V`` for the CPU, with grouped KV heads and the softmax in fp32.

    The same attention as mlx's, but its exp as ``2 ** (x * log2 e)``: mlx's CPU ``exp`` costs about three
    times its ``power``, and softmax's exp is most of prefill. Within 1e-6 relative of mlx's. ``mask``: None,
    ``"causal"`` (aligned to the end of the keys), a boolean or an additive array broadcastable to
    ``[B, Hq, L, S]``."""
    B, Hq, L, D = queries.shape
    H, S = keys.shape[1], keys.shape[2]
    g = Hq // H
    q = (queries * (scale * LOG2E)).reshape(B, H, g * L, D)  # log2 e folded into the queries
    s = (q @ keys.swapaxes(-1, -2)).astype(mx.float32).reshape(B, H, g, L, S)
    if isinstance(mask, str):
        mask = mx.arange(S - L, S)[:, None] >= mx.arange(S)[None]
    elif mask is not None and mask.ndim > 2:
        mask = mx.broadcast_to(mask, (B, Hq, L, S)).reshape(B, H, g, L, S)
    if mask is not None:
        s = mx.where(mask, s, -mx.inf) if mask.dtype == mx.bool_ else s + mask.astype(mx.float32) * LOG2E
    p = mx.power(2.0, s - mx.max(s, axis=-1, keepdims=True))
    p = (p / mx.sum(p, axis=-1, keepdims=True)).astype(values.dtype)
    return (p.reshape(B, H, g * L, S) @ values).reshape(B, Hq, L, values.shape[-1])  # MLA: V's width differs


def _by_rows(queries, keys, values, scale, mask, sinks, plan):
    L, S = queries.shape[2], keys.shape[2]
    parts = {}
    for i, blocks in enumerate(plan):
        with mx.stream(_cpu.stream(i)):
            for a, b in blocks:
                if isinstance(mask, str):  # causal, aligned to the end of the keys: later keys are hidden
                    end = S - L + b
                    k, v, m = keys[:, :, :end], values[:, :, :end], mask
                else:
                    k, v = keys, values
                    m = mask if mask is None or mask.shape[-2] == 1 else mask[..., a:b, :]
                if sinks is None:
                    parts[a] = softmax_attention(queries[:, :, a:b], k, v, scale, m)
                else:
                    parts[a] = mx.fast.scaled_dot_product_attention(queries[:, :, a:b], k, v, scale=scale, mask=m,
                                                                    sinks=sinks)
    return mx.concatenate([parts[a] for a in sorted(parts)], axis=2)


def _upper(n: int) -> np.ndarray:
    return np.triu(np.ones((n, n), dtype=bool), 1)


def numpy_softmax(queries, keys, scale: float, causal: bool, plan, reduce=None) -> tuple:
    """fp32 softmax weights by the row blocks of ``plan`` (causal: aligned to the end of the keys): the
    products in mlx (its BLAS), the softmax in NumPy, in place on the evaluated scores, one thread per list of
    blocks. NumPy's exp is vectorized, several times mlx's CPU exp per value, and every pass releases the GIL.
    Returns each block's weights ``[B, H, g, b - a, end]`` (mlx arrays), its ``(a, b, end)`` span, and
    ``reduce(weights)`` of each block, taken in its thread while the block is in cache (None without one)."""
    B, Hq, L, D = queries.shape
    H, S = keys.shape[1], keys.shape[2]
    g = Hq // H
    q = queries * (scale * LOG2E)
    scores, spans = [], []
    for todo in plan:
        for a, b in todo:
            end = S - L + b if causal else S
            qb = q[:, :, a:b].reshape(B, H, g * (b - a), D)
            scores.append((qb @ keys[:, :, :end].swapaxes(-1, -2)).reshape(B, H, g, b - a, end))
            spans.append((a, b, end))
    mx.eval(scores)
    arrays = [np.asarray(x) for x in scores]  # mlx's own buffers, written in place below
    reduced: list = [None] * len(arrays)

    def softmax(blocks: range) -> None:
        for i in blocks:
            a, b, end = spans[i]
            s = arrays[i]
            if causal:
                np.copyto(s[..., end - (b - a):], -np.inf, where=_upper(b - a))
            s -= s.max(axis=-1, keepdims=True)
            np.exp2(s, out=s)  # log2 e is folded into the queries
            s /= s.sum(axis=-1, keepdims=True)
            if reduce is not None:
                reduced[i] = reduce(s)

    firsts = np.cumsum([0] + [len(todo) for todo in plan])
    list(_cpu.pool().map(softmax, [range(firsts[i], firsts[i + 1]) for i in range(len(plan))]))
    return scores, spans, reduced


def waves(plan: list[list[tuple[int, int]]]) -> list[list[list[tuple[int, int]]]]:
    """``plan`` as waves of one block per stream: a wave's scores are all that is held at once."""
    return [[todo[i : i + 1] for todo in plan if i < len(todo)] for i in range(max(map(len, plan)))]


def numpy_rows(queries, keys, values, scale: float, causal: bool, plan) -> mx.array:
    """fp32 attention by the row blocks of ``plan``, the softmax in NumPy (``numpy_softmax``), a wave of blocks
    at a time, so the scores held at once stay within one block per stream whatever the context's length."""
    B, Hq, L, _ = queries.shape
    H = keys.shape[1]
    Dv = values.shape[-1]
    outs = {}
    for wave in waves(plan):
        weights, spans, _ = numpy_softmax(queries, keys, scale, causal, wave)
        done = {a: (p.reshape(B, H, (Hq // H) * (b - a), end) @ values[:, :, :end]).reshape(B, Hq, b - a, Dv)
                for p, (a, b, end) in zip(weights, spans)}
        mx.eval(list(done.values()))  # the wave's scores are freed before the next wave is scored
        outs.update(done)
    return mx.concatenate([outs[a] for a in sorted(outs)], axis=2)


def _attend(queries, keys, values, cache, scale, mask, sinks=None):
    """mlx-lm's attention; with the CPU fast path ``softmax_attention``, long query chunks by row blocks over
    the cores (see ``row_plan``)."""
    splittable = (
        _cpu.fast()
        and not hasattr(cache, "bits")
        and (mask is None or mask == "causal" if isinstance(mask, (str, type(None)))
             else mask.ndim >= 2 and mask.shape[-2] in (1, queries.shape[2]))
    )
    if splittable:
        B, Hq, L, _ = queries.shape
        plan = row_plan(B, Hq, L, keys.shape[2], _cpu.streams_for(L // MIN_ROWS))
        if plan and sinks is None and isinstance(mask, (str, type(None))) and all(
                x.dtype == mx.float32 for x in (queries, keys, values)):
            return numpy_rows(queries, keys, values, scale, mask == "causal", plan)
        if plan:
            return _by_rows(queries, keys, values, scale, mask, sinks, plan)
        if sinks is None:  # decode steps too: ~25% faster than mlx's CPU attention for 5 rows, 400 keys
            return softmax_attention(queries, keys, values, scale, mask)
    return _sdpa(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def per_head_attention(queries, keys: list, values: list, scale, mask, sinks=None, cache=None):
    """Attention where KV head h holds its own rows ``keys[h]`` ``[B, 1, S_h, D]``; the query heads of its GQA
    group attend to those rows only. ``mask`` is None or ``"causal"`` (aligned to the end of each head's keys).
    A quantized ``cache`` (``bits``) gives each head's rows as a (packed, scales, biases) triple."""
    H = len(keys)
    Hq = queries.shape[1]
    if Hq % H:
        raise ValueError(f"per-head attention needs query heads ({Hq}) to be a multiple of KV heads ({H})")
    if mask is not None and not isinstance(mask, str):
        # An array mask is built over one key length; heads here have different lengths.
        raise ValueError("per-head (adaptive, unpadded) attention supports only mask=None or 'causal'")
    g = Hq // H
    outs = [
        _attend(
            queries[:, h * g : (h + 1) * g],
            keys[h],
            values[h],
            cache=cache,
            scale=scale,
            mask=mask,
            sinks=None if sinks is None else sinks[h * g : (h + 1) * g],
        )
        for h in range(H)
    ]
    return mx.concatenate(outs, axis=1)


# Per-head rows attend in one call while its masked scores stay within this; past it (a long question over a
# long context) one call per KV head, each within its own rows.
ONE_CALL_SCORES = 2**24


def head_rows_attention(queries, keys: HeadRows, values: HeadRows, scale, sinks=None, cache=None):
    """Attention over a per-head layer (``layouts.HeadRows``) in one call: every query row of every head against
    the layer's flat buffer, masked to its own KV head's rows and, among the rows just appended, to those up to
    its own position (causal). One call per KV head instead where the masked scores would be large, with
    attention sinks (one per query head, which a flattened call cannot give), or for a decode step on the CPU
    fast path."""
    B, Hq, L, D = queries.shape
    H = keys.n_heads
    T = buf.parts(keys.flat)[0].shape[2]
    if Hq % H:
        raise ValueError(f"per-head attention needs query heads ({Hq}) to be a multiple of KV heads ({H})")
    if sinks is not None or Hq * L * T > ONE_CALL_SCORES or (L == 1 and _cpu.fast()):
        # A decode step on the CPU too: a call costs it little and a copy much, so each head attends its own
        # rows in place (SmolLM2 decode 0.88-0.89 of uniform budgets' speed, 0.71-0.86 gathered).
        return per_head_attention(queries, keys.views(), values.views(), scale, "causal" if L > 1 else None,
                                  sinks, cache=cache)
    if L == 1 and not isinstance(keys.flat, tuple):
        # A decode step where calls are dear (Metal): each head's region gathered to the longest (two takes), so
        # each query head scores its own KV head's rows (Hq x M) and not every head's (Hq x T, masked).
        rows, own = keys.layout.padded_slots(Hq, keys.tail)
        k, v = (mx.take(x[0, 0], rows, axis=0)[None] for x in (keys.flat, values.flat))
        return _attend(queries, k, v, cache, scale, own)
    mask = keys.mask(Hq, L)
    out = _attend(queries.reshape(B, 1, Hq * L, D), keys.flat, values.flat, cache, scale, mask[None, None])
    return out.reshape(B, Hq, L, out.shape[-1])


def attention(queries, keys, values, cache, scale, mask, sinks=None):
    """Drop-in for mlx-lm's ``scaled_dot_product_attention`` that understands NestedKV's ragged layouts."""
    observe = getattr(cache, "observe", None)
    if observe is not None:  # a probe pass (nestedkv.probe) reads the queries, and may attend itself
        out = observe(queries, keys, values, scale)
        if out is not None:
            return out
    quantized = hasattr(cache, "bits")
    if quantized and getattr(cache, "hadamard", False):
        queries = buf.hadamard(queries)  # the stored keys are rotated: rotated queries give the same scores
    if isinstance(keys, HeadRows):
        return head_rows_attention(queries, keys, values, scale, sinks, cache=cache)
    # Per-head rows come as a list of each head's keys; a quantized cache's keys are one (packed, scales,
    # biases) group, which mlx-lm's QuantizedKVCache may hand over as a list too.
    if isinstance(keys, list) and (not quantized or isinstance(keys[0], (list, tuple))):
        return per_head_attention(queries, keys, values, scale, mask, sinks, cache=cache)
    valid = getattr(cache, "valid", None)
    if valid is not None:
        # mlx-lm's quantized attention broadcasts the mask over each KV head's query group: one mask per KV head
        heads = valid.shape[1] if quantized else queries.shape[1]
        n_keys = (keys[0] if quantized else keys).shape[2]
        mask = head_mask(valid, mask, heads, queries.shape[2], n_keys)
    return _attend(queries, keys, values, cache, scale, mask, sinks)


def install_attention_hook(model, required: bool = True) -> bool:
    """Route every module of this model whose ``__call__`` calls mlx-lm's ``scaled_dot_product_attention``
    through ``attention`` (idempotent); the module and other model instances keep mlx-lm's. A model none of
    whose modules calls it raises when ``required``, else keeps its own attention; returns whether any is
    routed (which layers are: ``nestedkv.introspect``). Walks the model once per instance: caches ask on every
    forward pass."""
    found = vars(model).get(_ROUTED)
    if found is None:
        mods = [m for _, m in model.named_modules()
                if _routing.routed(m, NAME, attention) or _routing.can_route(m, NAME, _sdpa)]
        for m in mods:
            _routing.route(m, NAME, _sdpa, attention)
        found = bool(mods)
        object.__setattr__(model, _ROUTED, found)  # not a module attribute: stays out of its parameters
    if found or not required:
        return found
    raise ValueError(
        f"head_budget='adaptive' and nestedkv.stack need a model whose attention calls mlx-lm's "
        f"scaled_dot_product_attention; {type(model).__module__} does not. Use head_budget='uniform'"
    )


def calling_model(skip: int = 2):
    """The model whose forward pass is calling (``skip`` frames up, then a few more): mlx-lm models ask
    their first cache for the mask in their body, whose ``self`` holds ``layers``; None if not found."""
    frame = sys._getframe(skip)
    for _ in range(4):
        if frame is None:
            return None
        obj = frame.f_locals.get("self")
        if isinstance(getattr(obj, "layers", None), list):
            return obj
        frame = frame.f_back
    return None


def check_caller_routed(holds: str) -> None:
    """Raise if the layer calling ``update_and_fetch`` is about to give rows only ``attention`` reads right
    (ragged ones, whose padding it would attend; rotated keys, which it would score unrotated queries against)
    to mlx-lm's attention."""
    frame = sys._getframe(2)
    caller = frame.f_locals.get("self")
    own = isinstance(caller, nn.Module) and not _routing.routed(caller, NAME, attention)  # its own attention
    if own or frame.f_globals.get(NAME) is _sdpa:
        raise RuntimeError(
            f"this NestedKVCache {holds} but the layer calling it does not attend through nestedkv's attention: "
            "route it first with nestedkv.install_attention_hook(model), or give it uniform head budgets"
        )
