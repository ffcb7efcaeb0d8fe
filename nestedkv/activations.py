"""SwiGLU for the CPU.

mlx's CPU ``exp`` (and so its ``sigmoid`` and ``silu``) costs about three times its ``power``; in a small
model's prefill the MLP's ``silu`` takes longer than the MLP's three matmuls together. ``swiglu`` computes
``silu(gate) * x`` as ``gate / (1 + 2 ** (-gate * log2 e)) * x`` with the CPU fast path
(``nestedkv.enable_cpu_fast_path``; within 1e-6 relative of mlx-lm's) and is mlx-lm's function otherwise.
``install_swiglu_hook`` routes one model instance's MLPs to it, as ``attention.install_attention_hook`` does
for attention (the module and other models keep mlx-lm's).
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import mlx_lm.models.activations as mlx_activations

from nestedkv import _cpu, _routing

_swiglu = mlx_activations.swiglu
LOG2E = 1.4426950408889634


@partial(mx.compile, shapeless=True)
def _swiglu_pow2(gate: mx.array, x: mx.array) -> mx.array:
    # A very negative gate overflows the power to inf: gate / inf = -0, silu's own limit.
    return gate / (1.0 + mx.power(2.0, gate * -LOG2E)) * x


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """``silu(gate) * x``; a drop-in for mlx-lm's ``swiglu``."""
    return _swiglu_pow2(gate, x) if _cpu.fast() else _swiglu(gate, x)


def install_swiglu_hook(model) -> bool:
    """Route this model's MLPs through ``swiglu`` (idempotent); returns whether they are routed. Models whose
    MLP does not call mlx-lm's ``swiglu`` (GELU, mixtures of experts) keep their own."""
    mlps = [getattr(layer, "mlp", None) for layer in getattr(model, "layers", None) or []]
    return _routing.route_all(mlps, "swiglu", _swiglu, swiglu)
