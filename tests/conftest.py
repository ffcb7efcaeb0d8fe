"""Shared fixtures: tiny random-weight mlx-lm models (no downloads, seconds to build)."""

import importlib

import nestedkv

nestedkv.enable_cpu_fast_path()  # before mlx loads (it binds its BLAS then); what the nkv CLI runs with

import mlx.core as mx
import pytest

from flows.cli.app import COMMANDS
from tiny import make_tiny_model

# Every command's module loads here, before a test invokes the CLI in a CliRunner: Prefect, transformers and
# huggingface_hub give their loggers a handler on sys.stderr as they load, which inside the runner is its own
# stream, closed after the call (a later log line then ends the process). nkv loads them with its own stderr.
for _module in dict.fromkeys(entry.module for entry in COMMANDS.values()):
    importlib.import_module(_module)

TINY_ARCHS = ("llama", "qwen2", "qwen3")
SLOW_KINDS = ("e2e", "server", "scaleout")  # each is slow by nature: a real model, server or work pool


def pytest_collection_modifyitems(items):
    for item in items:
        if any(item.get_closest_marker(kind) for kind in SLOW_KINDS):
            item.add_marker(pytest.mark.slow)
    # The files with a work pool or a server first: on two workers (addopts) their long waits then overlap
    # with the files that compute, instead of running alone at the end. A file keeps its own order.
    rank: dict = {}
    for item in items:
        kind = 0 if item.get_closest_marker("scaleout") else 1 if item.get_closest_marker("server") else 2
        rank[item.path] = min(rank.get(item.path, 2), kind)
    items.sort(key=lambda item: rank[item.path])


def build_tiny_model(arch: str = "llama", n_layers: int = 2, dtype=mx.float32, seed: int = 0):
    # GQA on purpose (4 query heads share 2 KV heads), so tests see the KV-head shapes.
    model = make_tiny_model(arch, n_layers=n_layers, n_heads=4, n_kv_heads=2, seed=seed, dtype=dtype)
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
        model = build_tiny_model(arch, n_layers, dtype, seed)
        save_model(path, model)
        save_config({**vars(model.args), "model_type": arch}, path / "config.json")
        return path

    return make


@pytest.fixture
def tokens():
    """Factory: ``tokens(n, seed=0)`` -> random token ids ``[n]`` (int32) for the tiny vocab."""

    def make(n: int, seed: int = 0):
        return mx.random.randint(0, 256, (n,), key=mx.random.key(seed)).astype(mx.int32)

    return make


@pytest.fixture
def prefills(monkeypatch):
    """The doc_id of every context prefill (``Runner.prefill`` is the only place a context is prefilled)."""
    from pipeline.runner import Runner

    calls = []
    real = Runner.prefill

    def counting(self, prepared, res, press=None, on_prefill=None):
        calls.append(res.doc_id)
        return real(self, prepared, res, press=press, on_prefill=on_prefill)

    monkeypatch.setattr(Runner, "prefill", counting)
    return calls


@pytest.fixture(scope="module")
def prefect_api():
    """Prefect's own temporary server and database for a module's flow runs, not the user's profile."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield
