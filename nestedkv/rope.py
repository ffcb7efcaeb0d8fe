"""Undo a model's rotary position embedding on cached keys (scoring keys by content, not position).

The cache stores keys after RoPE. Within a short window the high-frequency dimensions rotate through
large angles, so averages of post-RoPE unit keys (NestedKV's block and window anchors) may reflect
position as much as content. ``inverse(rope)`` rotates each key back by its own position; the cache
keeps the rotated keys the model needs, only the scores see the unrotated ones.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import mlx.nn as nn

Unrope = Callable[[mx.array, int], mx.array]  # (keys [B, H, N, D] at positions offset.., offset) -> keys


def describe(rope) -> dict:
    """What ``inverse`` needs of an mlx rope module, as JSON-able data (a saved cache keeps it, so a cache
    loaded from disk scores unrotated keys without the model)."""
    if type(rope) is nn.RoPE:
        return {"dims": rope.dims, "traditional": rope.traditional, "base": rope.base, "scale": rope.scale}
    # mlx-lm's ropes defined by a frequency table (Llama 3, YaRN, Phi-3's su-scaled). YaRN and su-scaled
    # also multiply the rotated dimensions by a constant; that factor stays (it does not depend on position).
    freqs = getattr(rope, "_freqs", None)
    dims = getattr(rope, "dims", None) or getattr(rope, "dim", None)
    if freqs is not None and dims and type(rope).__name__ in ("Llama3RoPE", "YarnRoPE", "SuScaledRoPE"):
        return {"dims": dims, "traditional": bool(getattr(rope, "traditional", False)),
                "freqs": [float(f) for f in freqs.tolist()]}
    raise ValueError(f"unrotated scoring does not support the rope {type(rope).__name__}: "
                     "set the press's unrotate=false")


def from_description(d: dict, sign: float = -1.0) -> Unrope:
    """The inverse rope: the same rotation by minus the angle (rope is linear in the angle and a rotation,
    so rotating by -theta undoes it exactly up to rounding); ``sign=1``: the rope itself (without YaRN's
    constant factor). ``offset`` is the first key's position, or an int array with one position per batch row
    (see ``at_positions``). ``d["at"]``: where the rotated dimensions start in a head (MLA heads put them
    last), 0 by default."""
    if not d["dims"]:  # keys without position (NoPE layers, latent keys)
        return lambda x, offset=0: x
    if "freqs" in d:
        freqs = mx.array(d["freqs"], dtype=mx.float32)
        scale = sign * d.get("scale", 1.0)
        rot = lambda x, offset=0: mx.fast.rope(x, d["dims"], traditional=d["traditional"], base=None,  # noqa: E731
                                               scale=scale, offset=offset, freqs=freqs)
    else:
        rot = lambda x, offset=0: mx.fast.rope(x, d["dims"], traditional=d["traditional"], base=d["base"],  # noqa: E731
                                               scale=sign * d["scale"], offset=offset)
    at = d.get("at", 0)
    if not at:
        return rot
    end = at + d["dims"]
    return lambda x, offset=0: mx.concatenate([x[..., :at], rot(x[..., at:end], offset), x[..., end:]], axis=-1)


def mean_rotation(d: dict, start: int, count: int, dim: int) -> mx.array:
    """``[dim, dim]``: the rope at positions ``start .. start + count - 1`` averaged, as a matrix acting on row
    vectors (``x @ M`` is the mean of x rotated to each of those positions); rope is linear in x."""
    if not d["dims"]:
        return mx.eye(dim, dtype=mx.float32)
    rope = from_description(d, sign=1.0)
    eye = mx.broadcast_to(mx.eye(dim, dtype=mx.float32), (count, dim, dim)).reshape(count * dim, 1, 1, dim)
    pos = mx.repeat(mx.arange(start, start + count, dtype=mx.int32), dim)
    return mx.mean(rope(eye, pos).reshape(count, dim, dim), axis=0)


def inverse(rope) -> Unrope:
    """The inverse of an mlx rope module."""
    return from_description(describe(rope))


def at_positions(unrope: Unrope, keys: mx.array, pos: mx.array) -> mx.array:
    """Keys ``[B, H, R, D]`` rotated back each by its own position ``pos`` [B, H, R] (rows kept by a
    streaming eviction are no longer contiguous): one row per batch entry, each with its offset."""
    B, H, R, D = keys.shape
    flat = unrope(keys.reshape(B * H * R, 1, 1, D), pos.reshape(-1).astype(mx.int32))
    return flat.reshape(B, H, R, D)


def required(unrope: Unrope | None, press_name: str) -> Unrope:
    """``unrope``, or the error that says how a press scoring unrotated keys gets it."""
    if unrope is None:
        raise ValueError(f"press {press_name!r} with unrotate=true needs the model's rope: build the cache "
                         "with nestedkv.make_cache(model, press) or nestedkv.clone(cache, press, model=model)")
    return unrope
