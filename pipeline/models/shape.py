"""Shape facts of a loaded mlx-lm model that the runner and reports need (layers, KV heads, window, dtype),
read from mlx-lm's own structures (a wrapper's text settings, the caches a forward pass writes), never from one
architecture's attribute names."""

from __future__ import annotations

from typing import Any, Optional

import mlx.nn as nn

from nestedkv import introspect


def weights(model: nn.Module) -> tuple[str, Optional[dict]]:
    """The dtype the model computes in (its quantized layers' scales, else its first floating weight) and its
    quantization ({"bits", "group_size"} of the first quantized layer, or None)."""
    for _, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            return _name(m.scales.dtype), {"bits": m.bits, "group_size": m.group_size}
    for _, m in model.named_modules():
        w = m.get("weight") if isinstance(m, (nn.Linear, nn.Embedding)) else None
        if w is not None:
            return _name(w.dtype), None
    return "unknown", None


def _name(dtype: Any) -> str:
    return str(dtype).removeprefix("mlx.core.")


def model_info(model: nn.Module) -> dict:
    """Layers, KV heads and head dim (of the first full-attention cache), context window, dtype and
    quantization. Runs the model once on a few tokens (``nestedkv.introspect.probe``, kept on the model): a
    model that cannot run on this device raises ``ValueError`` in one line."""
    facts = introspect.probe(model)
    dtype, quantization = weights(model)
    return {
        "model_type": introspect.setting(model, "model_type"),
        "n_layers": len(model.layers),
        "n_heads": introspect.setting(model, "num_attention_heads", "n_head", "n_heads", "num_heads"),
        "n_kv_heads": facts[0].n_kv_heads if facts else None,
        "head_dim": facts[0].head_dim if facts else None,
        "max_position_embeddings": introspect.model_window(model),
        "dtype": dtype,
        "quantization": quantization,
    }
