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


def inverse(rope) -> Unrope:
    """The inverse of an mlx rope module: the same rotation by minus the angle (rope is linear in the angle
    and a rotation, so rotating by -theta undoes it exactly up to rounding)."""
    if type(rope) is nn.RoPE:
        return lambda x, offset=0: mx.fast.rope(x, rope.dims, traditional=rope.traditional, base=rope.base,
                                                scale=-rope.scale, offset=offset)
    # mlx-lm's rope variants that only change the frequencies (Llama 3's); those that also rescale
    # the rotated dimensions' magnitudes are not handled.
    freqs = getattr(rope, "_freqs", None)
    if freqs is not None and type(rope).__name__ == "Llama3RoPE":
        return lambda x, offset=0: mx.fast.rope(x, rope.dims, traditional=rope.traditional, base=None,
                                                scale=-1.0, offset=offset, freqs=freqs)
    raise ValueError(f"unrotated scoring does not support the rope {type(rope).__name__}")


def model_unrope(model) -> Unrope | None:
    """The inverse rope of a model's attention (its first layer's), or None when it has no rope module."""
    layers = getattr(model, "layers", None) or getattr(getattr(model, "model", None), "layers", None) or []
    rope = getattr(getattr(layers[0], "self_attn", None), "rope", None) if layers else None
    return None if rope is None else inverse(rope)
