import importlib

import mlx.core as mx
import numpy as np
import pytest

import nestedkv
from nestedkv import activations


@pytest.mark.parametrize("dtype,tol", [(mx.float32, 2e-6), (mx.float16, 2e-3), (mx.bfloat16, 2e-2)])
def test_swiglu_equals_mlx_lm_within_rounding(dtype, tol):
    gate = mx.concatenate([mx.random.normal((4, 1000), key=mx.random.key(1)) * 6,
                           mx.array([[-200.0, -90.0, -30.0, 0.0, 1e-8, 30.0, 90.0, 200.0] * 125])]).astype(dtype)
    x = mx.random.normal(gate.shape, key=mx.random.key(2)).astype(dtype)
    with mx.stream(mx.cpu):  # the CPU's formula, wherever the test runs
        got = activations._swiglu_pow2(gate, x)
        want = activations._swiglu(gate, x)
    assert got.dtype == dtype and got.shape == gate.shape
    got, want = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def test_install_swiglu_hook_routes_the_model_and_keeps_its_outputs(tiny_model):
    llama = importlib.import_module("mlx_lm.models.llama")
    model = tiny_model("llama")
    tokens = mx.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    before = model(tokens)
    assert activations.install_swiglu_hook(model) and activations.install_swiglu_hook(model)
    assert all(type(layer.mlp) is not llama.MLP for layer in model.layers)
    assert llama.swiglu is activations._swiglu  # the module is left alone
    np.testing.assert_allclose(np.array(model(tokens)), np.array(before), rtol=1e-5, atol=1e-5)
    other = tiny_model("llama")
    nestedkv.make_cache(other, nestedkv.NestedKVPress(compression_ratio=0.5))
    assert type(other.layers[0].mlp) is type(model.layers[0].mlp)  # make_cache routes it


def test_a_model_with_its_own_activation_is_left_alone(tiny_model, monkeypatch):
    llama = importlib.import_module("mlx_lm.models.llama")
    own = lambda gate, x: gate * x  # noqa: E731
    monkeypatch.setattr(llama, "swiglu", own)
    model = tiny_model("llama")
    assert activations.install_swiglu_hook(model) is False
    assert llama.swiglu is own and type(model.layers[0].mlp) is llama.MLP
