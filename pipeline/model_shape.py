"""Shape facts of a loaded mlx-lm model that the runner and reports need (layers, heads, window, dtype)."""

from __future__ import annotations

from typing import Any

import mlx.nn as nn


def _args(model: nn.Module) -> Any:
    return getattr(model, "args", None) or getattr(getattr(model, "model", None), "args", None)


def model_info(model: nn.Module) -> dict:
    """Shape facts the runner needs: layers, KV heads, head dim, context window, dtype."""
    args = _args(model)
    attn = model.layers[0].self_attn
    n_heads = getattr(args, "num_attention_heads", None) or attn.n_heads
    head_dim = getattr(args, "head_dim", None) or getattr(attn, "head_dim", None) or args.hidden_size // n_heads
    proj = attn.q_proj
    quantized = isinstance(proj, nn.QuantizedLinear)
    return {
        "model_type": getattr(args, "model_type", None),
        "n_layers": len(model.layers),
        "n_heads": n_heads,
        "n_kv_heads": getattr(args, "num_key_value_heads", None) or attn.n_kv_heads,
        "head_dim": int(head_dim),
        "max_position_embeddings": getattr(args, "max_position_embeddings", None),
        "dtype": str(proj.scales.dtype if quantized else proj.weight.dtype).removeprefix("mlx.core."),
        "quantization": {"bits": proj.bits, "group_size": proj.group_size} if quantized else None,
    }
