"""The code path a Mac runs, on this CPU: weights as stored (4-bit and 8-bit quantized as mlx-lm's convert writes
them, bf16, fp16; ``--dtype stored``) and the CPU fast path off, so mlx's own attention (on per-head rows too),
quantized matmuls and half-precision caches are what run.

With ``no_press`` the pipeline's answers equal mlx-lm's own ``generate`` on the same model, token for token; and
every feature runs on such weights through ``nkv run``: whole and streaming prefill, map-reduce past the window,
batched decode, quantized KV, KVzip, the prefill cache.
"""

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest
from typer.testing import CliRunner

import archs
from flows.cli import app
from nestedkv import _platform
from pipeline import models
from pipeline.config import RunConfig
from pipeline.documents import Document
from pipeline.runner import Runner
from pipeline.store import Store
from tiny import sample_docs, write_batch

WEIGHTS = {"q4": {"bits": 4}, "q8": {"bits": 8}, "bf16": {"dtype": mx.bfloat16}, "fp16": {"dtype": mx.float16}}
# head dim 32: quantized KV groups of 32 fit a head
SHAPE = {"hidden_size": 128, "head_dim": 32, "intermediate_size": 256}


@pytest.fixture(autouse=True)
def mac_path(monkeypatch):
    """The CPU fast path off for the test (mlx's own attention and SwiGLU), as on Metal."""
    monkeypatch.setitem(_platform._state, "fast_path", False)
    yield
    models.clear_loaded()


def saved(tmp_path, weights: str, kind: str = "llama", **overrides):
    path = tmp_path / "-".join([kind, weights, *(f"{k}{v}" for k, v in overrides.items())])
    return archs.save_arch_dir(kind, path, **WEIGHTS[weights], **SHAPE, **overrides)


def stored_as(model, weights: str) -> bool:
    """The loaded model kept its weights as saved: quantized layers, or every float weight in that dtype."""
    layers = [m for _, m in model.named_modules() if isinstance(m, (nn.Linear, nn.QuantizedLinear))]
    if weights.startswith("q"):
        return all(isinstance(m, nn.QuantizedLinear) and m.bits == WEIGHTS[weights]["bits"] for m in layers)
    return all(m.weight.dtype == WEIGHTS[weights]["dtype"] for m in layers)


@pytest.mark.parametrize("kind", ["llama", "gemma3_text"])
@pytest.mark.parametrize("weights", sorted(WEIGHTS))
def test_no_press_answers_equal_mlx_lm_generate(weights, kind, tmp_path):
    path = saved(tmp_path, weights, kind)
    model, tokenizer = models.load_model(str(path), dtype="stored")
    assert stored_as(model, weights)
    doc = Document(**sample_docs(1, 300)[0])
    cfg = RunConfig(task="qa", press="no_press", compression_ratio=0.0, dtype="stored", max_new_tokens=12)
    runner = Runner(model, tokenizer, cfg)
    res = runner.run(doc)
    assert res.status == "ok", res.error
    prepared = runner.prepare(doc, fit=False)
    theirs, their_tokenizer = mlx_lm.load(str(path))  # mlx-lm's own model, attention and caches
    for q, (_, question_ids, _) in zip(res.questions, prepared.questions):
        text = mlx_lm.generate(theirs, their_tokenizer, prompt=prepared.context_ids + question_ids, max_tokens=12)
        assert q.output == text.strip()
    cache = runner.prefill(prepared, res)
    assert {c.keys.dtype for c in cache} == {model.layers[-1].input_layernorm.weight.dtype}  # the model's dtype


def nkv(*args):
    return CliRunner().invoke(app, list(map(str, args)))


@pytest.mark.slow
@pytest.mark.parametrize("weights", sorted(WEIGHTS))
def test_quantized_and_half_models_run_with_the_defaults(weights, tmp_path, prefect_api):
    """``nkv run`` with every option at its default (the CPU's float32) and with the weights as stored."""
    path = saved(tmp_path, weights)
    batch = write_batch(tmp_path / "in.parquet", sample_docs(1, 300))
    for dtype in ("auto", "stored"):
        db = tmp_path / f"{dtype}.duckdb"
        res = nkv("run", "--model", path, "--input", batch, "--task", "qa", "--max-new-tokens", 4, "--db", db,
                  *(["--dtype", dtype] if dtype != "auto" else []))
        assert res.exit_code == 0, (dtype, res.output, res.exception)
        with Store(str(db), read_only=True) as store:
            assert {r["status"] for r in store.query("SELECT status FROM outputs").to_pylist()} == {"ok"}
            dtypes = {r["dtype"] for r in store.query("SELECT DISTINCT dtype FROM layer_memory").to_pylist()}
        half = weights in ("bf16", "fp16") and dtype == "stored"
        assert dtypes == ({"bfloat16" if weights == "bf16" else "float16"} if half else {"float32"}), dtypes


FEATURES = {
    "whole": [],
    "streaming": ["--prefill", "streaming", "--budget", 48],
    "batch-decode": ["--compression-ratio", "0.5,0.75", "--batch-decode"],
    "kv-bits": ["--kv-bits", 8, "--kv-group-size", 32],
    "kvzip": ["--press", "kvzip"],
}


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["q4", "bf16"])
def test_every_feature_runs_on_stored_weights(weights, tmp_path, prefect_api):
    path = saved(tmp_path, weights)
    batch = write_batch(tmp_path / "in.parquet", sample_docs(2, 400))
    long_path = saved(tmp_path, weights, max_position_embeddings=256)  # the documents run past its window
    runs = {name: ["--model", path, *extra] for name, extra in FEATURES.items()}
    runs["map-reduce"] = ["--model", long_path, "--long-docs", "map_reduce"]
    cached = tmp_path / "prefills"
    runs["prefill-cache"] = runs["prefill-cache-again"] = ["--model", path, "--prefill-cache", cached]
    for name, extra in runs.items():
        db = tmp_path / f"{name}.duckdb"
        res = nkv("run", "--input", batch, "--task", "qa", "--dtype", "stored", "--max-new-tokens", 4, "--db", db,
                  *extra)
        assert res.exit_code == 0, (name, res.output, res.exception)
        with Store(str(db), read_only=True) as store:
            rows = store.query("SELECT status, read_mode FROM outputs").to_pylist()
            dtypes = {r["dtype"] for r in store.query("SELECT DISTINCT dtype FROM layer_memory").to_pylist()}
        assert rows and all(r["status"] == "ok" for r in rows), (name, rows)
        if name == "map-reduce":
            assert {r["read_mode"] for r in rows} == {"map_reduce"}
        if weights == "bf16":
            assert dtypes == {"bfloat16"}, (name, dtypes)  # the cache keeps the model's dtype
    assert len(list(cached.glob("nkv-prefill-*.safetensors"))) == 2  # stored once per document, then loaded
