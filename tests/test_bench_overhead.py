"""nkv bench prefect: its no-op run replaces each document's work, and only while it is measured."""

from tiny import sample_docs, save_tiny_model_dir, write_batch

import pipeline.engine as engine
from pipeline.config import RunConfig
from pipeline.store import Store


def outputs(db):
    with Store(db, read_only=True) as s:
        return s.query("SELECT doc_id, status FROM outputs").to_pylist()


def test_the_orchestration_benchmarks_no_op_runs_no_model(tmp_path, prefills):
    # nkv bench prefect measures Prefect's own cost with each document's work replaced by an empty result
    from flows.bench_overhead import _noop_runner

    model = str(save_tiny_model_dir(tmp_path / "model"))
    batch = write_batch(tmp_path / "in.parquet", sample_docs(2, 300))
    with _noop_runner():
        summary = engine.run(batch, [RunConfig(model=model, max_new_tokens=2)], tmp_path / "a.duckdb")
    assert summary.n_ok == 2 and prefills == []
    assert [r["status"] for r in outputs(tmp_path / "a.duckdb")] == ["ok", "ok"]
    engine.run(batch, [RunConfig(model=model, max_new_tokens=2)], tmp_path / "b.duckdb")
    assert len(prefills) == 2  # and the real work is back afterwards
