"""SwiGLU for the CPU.

mlx's CPU ``exp`` (and so its ``sigmoid`` and ``silu``) costs about three times its ``power``; in a small
model's prefill the MLP's ``silu`` takes longer than the MLP's three matmuls together. ``swiglu`` computes
``silu(gate) * x`` as ``gate / (1 + 2 ** (-gate * log2 e)) * x`` on the CPU (within 1e-6 relative of
mlx-lm's) and is mlx-lm's function elsewhere. ``install_swiglu_hook`` swaps mlx-lm's ``swiglu`` for it in the
module of a model's MLP, as ``attention.install_attention_hook`` does for attention.
"""

from __future__ import annotations

import sys
from functools import partial

import mlx.core as mx
import mlx_lm.models.activations as mlx_activations

from nestedkv import _cpu

_swiglu = mlx_activations.swiglu
LOG2E = 1.4426950408889634


@partial(mx.compile, shapeless=True)
def _swiglu_pow2(gate: mx.array, x: mx.array) -> mx.array:
    # A very negative gate overflows the power to inf: gate / inf = -0, silu's own limit.
    return gate / (1.0 + mx.power(2.0, gate * -LOG2E)) * x


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """``silu(gate) * x``; a drop-in for mlx-lm's ``swiglu``."""
    return _swiglu_pow2(gate, x) if _cpu.on_cpu() else _swiglu(gate, x)


def install_swiglu_hook(model) -> bool:
    """Route the model's SwiGLU through ``swiglu`` (idempotent); returns whether it is routed. Models whose
    MLP does not call mlx-lm's ``swiglu`` (GELU, mixtures of experts) keep their own."""
    layers = getattr(model, "layers", None) or []
    mlp = getattr(layers[0], "mlp", None) if layers else None
    module = sys.modules.get(type(mlp).__module__) if mlp is not None else None
    current = getattr(module, "swiglu", None)
    if current is swiglu:
        return True
    if current is not _swiglu:
        return False
    module.swiglu = swiglu
    return True
