"""One K or V buffer: an array ``[B, H, rows, D]``, or (quantized) a ``(packed, scales, biases)`` tuple of
``mx.quantize`` whose parts share the rows axis 2. These helpers treat both alike."""

from __future__ import annotations

import math
from typing import Optional

import mlx.core as mx

from nestedkv.quant import KV_GROUP_SIZES


def parts(buf) -> tuple:
    return buf if isinstance(buf, tuple) else (buf,)


def map_parts(fn, *bufs):
    """``fn`` applied part by part to equally structured buffers."""
    if isinstance(bufs[0], tuple):
        return tuple(fn(*xs) for xs in zip(*bufs))
    return fn(*bufs)


def cat(bufs, axis: int = 2):
    return map_parts(lambda *xs: mx.concatenate(xs, axis=axis), *bufs)


def rows_of(buf, a: int, b: Optional[int] = None):
    return map_parts(lambda x: x[..., a:b, :], buf)


def zeros(buf, B: int, H: int, n: int):
    """``n`` zero rows shaped like ``buf``'s (quantized zeros dequantize to 0: scales and biases are 0)."""
    return map_parts(lambda x: mx.zeros((B, H, n, x.shape[3]), x.dtype), buf)


def put(buf, index, new) -> None:
    for dst, src in zip(parts(buf), parts(new)):
        dst[index] = src


def nbytes(buf) -> int:
    return 0 if buf is None else sum(x.nbytes for x in parts(buf))


def grow(buf, rows: int, new, step: int):
    """``buf`` with room for ``new`` after its first ``rows`` rows; KVCache's growth policy (steps of ``step``),
    so that with nothing evicted the arrays (and outputs) are bit-identical to mlx-lm's."""
    if isinstance(new, tuple):
        return tuple(grow(b, rows, x, step) for b, x in zip(buf, new))
    if buf is not None and rows + new.shape[2] <= buf.shape[2]:
        return buf
    B, H, n, d = new.shape
    n_steps = (step + n - 1) // step
    fresh = mx.zeros((B, H, n_steps * step, d), new.dtype)
    if buf is None:
        return fresh
    if rows % step != 0:
        buf = buf[..., :rows, :]
    return mx.concatenate([buf, fresh], axis=2)


def as_tuple(buf):
    """A quantized buffer as loaded (save_prompt_cache stores tuples as lists)."""
    return tuple(buf) if isinstance(buf, list) else buf


def check_divides(group_size: int, head_dim: int) -> None:
    """Quantized buffers need the group size to divide the head dimension."""
    if head_dim % group_size:
        fits = [str(g) for g in KV_GROUP_SIZES if head_dim % g == 0]
        raise ValueError(f"kv_group_size={group_size} must divide the model's head dimension {head_dim}; "
                         f"{'choose ' + ' or '.join(fits) if fits else 'this model cannot be KV-quantized'}")


# mx.hadamard_transform's sizes, m * 2**k; for other sizes it returns a matrix that is not orthogonal (or
# corrupts memory) instead of raising, so every size is checked here first.
HADAMARD_BASES = (1, 12, 20, 28)


def hadamard_fits(head_dim: int) -> bool:
    return any(head_dim % m == 0 and (head_dim // m) & (head_dim // m - 1) == 0 for m in HADAMARD_BASES)


def check_hadamard(head_dim: int) -> None:
    if not hadamard_fits(head_dim):
        raise ValueError(f"kv_hadamard needs a head dimension of 2**k, or 12, 20 or 28 times one; this model's is "
                         f"{head_dim}: quantize without the rotation (kv_hadamard=False, --kv-hadamard false)")


def hadamard(x: mx.array) -> mx.array:
    """``x`` rotated along its last axis by the orthonormal Hadamard matrix: dot products between rotated
    vectors are unchanged, and a key's few large channels are spread over all of them, so its quantization
    groups hold no outlier (QuaRot, arXiv:2404.00456)."""
    return mx.hadamard_transform(x, scale=1 / math.sqrt(x.shape[-1]))
