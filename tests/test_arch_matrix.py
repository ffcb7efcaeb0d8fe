"""Every model type of the installed mlx-lm through the command a user runs: a tiny random model saved as an
mlx-lm directory (config.json, safetensors, a tokenizer), then ``nkv run`` with the defaults on a one-document
QA batch. Each type either completes (exit 0, every row ok, every cache counted) or is refused in one line before
any run opens (``archs.REFUSED``). A type a new mlx-lm release adds joins the matrix by itself.

``nkv eval`` with the defaults runs on one type of each kind of model (``EVAL``), a hub id resolved offline from a
local Hugging Face cache on three, and docs/architectures.md's table is checked against ``archs.table``.
"""

import os
import re
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

import archs
from flows.cli import app
from nestedkv.layer_kinds import leaves
from pipeline import models
from pipeline.store import Store
from tiny import sample_docs, write_batch

pytestmark = pytest.mark.slow
DOCS = Path(__file__).resolve().parents[1] / "docs" / "architectures.md"
# One type of each kind: dense, MoE, MLA, sliding window, chunked, state, a CacheList layer, KV sharing, a wrapper,
# NoPE layers, an attention of its own (soft caps), absolute positions.
EVAL = ("llama", "mixtral", "deepseek_v3", "gemma3_text", "llama4", "qwen3_next", "falcon_h1", "gemma3n",
        "gemma3", "smollm3", "gemma2", "gpt2")
HUB = ("llama", "gemma3", "qwen3_5")


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    return write_batch(tmp_path_factory.mktemp("batch") / "one.parquet", sample_docs(1))


@pytest.fixture(autouse=True)
def fresh_models():
    yield
    models.clear_loaded()  # a tiny model per test: none kept for the next


def nkv(*args):
    return CliRunner().invoke(app, list(map(str, args)))


def one_error_line(res) -> str:
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


def check_rows(db, model_dir, n_runs: int = 1) -> None:
    model, _ = models.load_model(str(model_dir))
    n_caches = len(leaves(model.make_cache())) if hasattr(model, "make_cache") else len(model.layers)
    with Store(str(db), read_only=True) as store:
        runs = store.query("SELECT run_id FROM runs").to_pylist()
        out = store.query("SELECT status, error, output FROM outputs").to_pylist()
        layers = store.query("SELECT run_id, kind, bytes_kept, bytes_full FROM layer_memory").to_pylist()
    assert len(runs) == n_runs and out and all(r["status"] == "ok" for r in out), out
    assert len(layers) == n_caches * n_runs  # every cache of every layer counted, for every run
    full = [r for r in layers if r["kind"] == "full"]
    assert full and any(r["bytes_kept"] < r["bytes_full"] for r in full)


@pytest.mark.parametrize("kind", archs.matrix_types())
def test_nkv_run_with_the_defaults(kind, tmp_path, batch, prefect_api):
    model_dir = archs.save_arch_dir(kind, tmp_path / kind)
    db = tmp_path / "runs.duckdb"
    res = nkv("run", "--model", model_dir, "--task", "qa", "--input", batch, "--max-new-tokens", 4, "--db", db)
    if kind in archs.REFUSED:
        assert res.exit_code == 2, res.output
        assert re.search(archs.REFUSED[kind], one_error_line(res))
        assert not db.exists()  # refused before any run opened
        return
    assert res.exit_code == 0, (res.output, res.exception)
    check_rows(db, model_dir)


@pytest.mark.parametrize("kind", EVAL)
def test_nkv_eval_with_the_defaults(kind, tmp_path, batch):
    model_dir = archs.save_arch_dir(kind, tmp_path / kind)
    db = tmp_path / "eval.duckdb"
    res = nkv("eval", "--model", model_dir, "--input", batch, "--max-new-tokens", 4, "--db", db)
    assert res.exit_code == 0, (res.output, res.exception)
    with Store(str(db), read_only=True) as store:
        presses = {r["press"] for r in store.query("SELECT DISTINCT press FROM runs").to_pylist()}
        scored = store.query("SELECT count(*) AS n FROM evaluations").to_pylist()[0]["n"]
    assert {"no_press", "nestedkv", "keydiff"} <= presses and scored > 0
    if "not compared on this model" in res.stderr:  # presses that score with the model, on a hybrid: left out
        assert "kvzip" not in presses


@pytest.mark.parametrize("kind", HUB)
def test_hub_id_resolved_offline_from_a_local_cache(kind, tmp_path, batch, prefect_api, monkeypatch):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hf" / "hub" / f"models--tiny-org--{kind}"
    snapshot = archs.save_arch_dir(kind, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    from huggingface_hub import constants  # read from the environment once, at import

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    db = tmp_path / "runs.duckdb"
    res = nkv("run", "--model", f"tiny-org/{kind}", "--task", "qa", "--input", batch, "--max-new-tokens", 4,
              "--db", db)
    assert res.exit_code == 0, (res.output, res.exception)
    check_rows(db, snapshot)


def test_architectures_doc_table_is_the_matrix():
    text = DOCS.read_text()
    start, end = "<!-- matrix -->\n", "<!-- /matrix -->"
    assert start in text and end in text, f"{DOCS} lost its matrix markers"
    got = text.split(start)[1].split(end)[0]
    want = archs.table(archs.matrix_types())
    assert got == want, "docs/architectures.md's table is stale: python tests/archs.py writes it"
