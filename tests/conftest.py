"""Shared fixtures: tiny random-weight mlx-lm models (no downloads, seconds to build)."""

import nestedkv  # noqa: F401  (loads OpenBLAS before mlx)

import importlib

import mlx.core as mx
import pytest

TINY_ARCHS = ("llama", "qwen2", "qwen3")

# GQA on purpose (4 query heads share 2 KV heads), so tests see the KV-head shapes.
_BASE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    vocab_size=256,
    tie_word_embeddings=True,
)
_EXTRA = {
    "llama": dict(rope_theta=10000.0),
    "qwen2": dict(rope_theta=10000.0, max_position_embeddings=8192),
    "qwen3": dict(rope_theta=10000.0, max_position_embeddings=8192, head_dim=16),
}


def tiny_config(arch: str = "llama", n_layers: int = 2) -> dict:
    """The config dict of a tiny model (what config.json would hold)."""
    if arch not in TINY_ARCHS:
        raise ValueError(f"arch must be one of {TINY_ARCHS}, got {arch!r}")
    return {"model_type": arch, "num_hidden_layers": n_layers, **_BASE, **_EXTRA[arch]}


def build_tiny_model(arch: str = "llama", n_layers: int = 2, dtype=mx.float32, seed: int = 0):
    config = tiny_config(arch, n_layers)
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    model.eval()
    return model


@pytest.fixture
def tiny_model():
    """Factory: ``tiny_model(arch="llama"|"qwen2"|"qwen3", n_layers=2, dtype=mx.float32, seed=0)``."""
    return build_tiny_model


@pytest.fixture
def tiny_model_dir(tmp_path):
    """Factory: save a tiny model as an mlx-lm directory (config.json + safetensors, no tokenizer)."""

    def make(arch: str = "llama", n_layers: int = 2, dtype=mx.float32, seed: int = 0):
        from mlx_lm.utils import save_config, save_model

        path = tmp_path / f"tiny-{arch}-{n_layers}-{seed}"
        save_model(path, build_tiny_model(arch, n_layers, dtype, seed))
        save_config(tiny_config(arch, n_layers), path / "config.json")
        return path

    return make


@pytest.fixture
def tokens():
    """Factory: ``tokens(n, seed=0)`` -> random token ids ``[n]`` (int32) for the tiny vocab."""

    def make(n: int, seed: int = 0):
        return mx.random.randint(0, _BASE["vocab_size"], (n,), key=mx.random.key(seed)).astype(mx.int32)

    return make
