"""What compression costs a summary, for a user's own batch: ``nkv run --compare-full`` runs each document
uncompressed too and prints delta NLL and ROUGE-L of every compressed run against it; ``nkv eval --task
summarize`` scores summaries against the uncompressed summary."""

import pytest
from typer.testing import CliRunner

from flows.cli import app
from pipeline import models
from pipeline.store import Store
from tiny import sample_docs, save_tiny_model_dir, write_batch

pytestmark = pytest.mark.slow  # a Prefect flow run


@pytest.fixture
def files(tmp_path):
    yield save_tiny_model_dir(tmp_path / "m"), write_batch(tmp_path / "in.parquet", sample_docs(2, 400))
    models.clear_loaded()


def metrics(db) -> dict:
    with Store(str(db), read_only=True) as store:
        rows = store.query("SELECT r.press, e.metric, e.reference_run_id IS NOT NULL AS against_full FROM "
                           "evaluations e JOIN runs r USING (run_id)").to_pylist()
    return {(r["press"], r["metric"]): r["against_full"] for r in rows}


def latest_report() -> str:
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterType

    with get_client(sync_client=True) as client:
        arts = client.read_artifacts(artifact_filter=ArtifactFilter(type=ArtifactFilterType(any_=["markdown"])))
    return max(arts, key=lambda a: a.created).data


def test_run_compare_full_scores_the_summaries_against_the_uncompressed_ones(files, tmp_path, prefect_api):
    model, batch = files
    db = tmp_path / "runs.duckdb"
    res = CliRunner().invoke(app, ["run", "--model", str(model), "--input", batch, "--max-new-tokens", "6",
                                   "--db", str(db), "--compare-full"])
    assert res.exit_code == 0, res.output
    got = metrics(db)
    assert got[("nestedkv", "delta_nll")] and got[("nestedkv", "rouge_l")] and got[("nestedkv", "top1_agreement")]
    assert not any(metric in ("correct", "gold_nll") for _, metric in got)  # a summary has no gold answer
    assert "against the uncompressed run" in res.stdout and "delta_nll" in res.stdout
    # where each summary draws from, the uncompressed one's too: scored against the document, no reference
    assert got[("nestedkv", "source_coverage")] is False and got[("no_press", "source_ends")] is False
    assert "source_coverage" in res.stdout and "accuracy" not in res.stdout
    assert "Quality against the uncompressed run" in latest_report() and "source_coverage" in latest_report()
    plain = CliRunner().invoke(app, ["run", "--model", str(model), "--input", batch, "--max-new-tokens", "6",
                                     "--db", str(tmp_path / "plain.duckdb")])
    assert plain.exit_code == 0 and "against the uncompressed run" not in plain.stdout
    with Store(str(tmp_path / "plain.duckdb"), read_only=True) as store:  # no reference, no scores
        assert store.query("SELECT count(*) AS n FROM evaluations").to_pylist()[0]["n"] == 0


def test_eval_task_summarize_scores_every_press_against_the_uncompressed_summary(files, tmp_path):
    model, batch = files
    db = tmp_path / "eval.duckdb"
    res = CliRunner().invoke(app, ["eval", "--model", str(model), "--input", batch, "--task", "summarize",
                                   "--press", "nestedkv,keydiff", "--compression-ratio", "0.75",
                                   "--max-new-tokens", "6", "--db", str(db)])
    assert res.exit_code == 0, res.output
    got = metrics(db)
    for press in ("nestedkv", "keydiff"):
        assert got[(press, "delta_nll")] and got[(press, "rouge_l")]
    with Store(str(db), read_only=True) as store:
        assert {r["task"] for r in store.query("SELECT DISTINCT task FROM runs").to_pylist()} == {"summarize"}
