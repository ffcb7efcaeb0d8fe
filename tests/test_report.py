"""``nkv eval`` then ``nkv report`` on a tiny random model: the table, the markdown and the PNG plot."""

import pytest
from tiny import TINY_NAME, sample_docs, use_tiny_model, write_batch
from typer.testing import CliRunner

from flows.cli import app
from pipeline.config import RunConfig
from pipeline.report import build_report, frontier, markdown_table, write_report
from pipeline.store import Store, StoreError
from pipeline.engine import EngineOptions, make_configs, run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def evaluated(tmp_path, monkeypatch):
    with use_tiny_model(monkeypatch):
        batch = write_batch(tmp_path / "in.parquet", sample_docs(2, 400))
        base = RunConfig(task="qa", model=TINY_NAME, press="no_press", compression_ratio=0.0, max_new_tokens=5,
                         prefill_step_size=128)
        cfgs = (make_configs(base, ["no_press", "nestedkv"], [0.5, 0.9], head_budgets=["uniform", "adaptive"])
                + make_configs(base, ["keydiff", "random"], [0.5, 0.9]))
        db = tmp_path / "eval.duckdb"
        run(batch, cfgs, db, EngineOptions(evaluate=True, batch_decode=True))
        yield db, cfgs


def test_report_table_rows_and_values(evaluated):
    db, cfgs = evaluated
    rep = build_report(db)
    got = [(r["press"], r["head_budget"], r["compression_ratio"]) for r in rep.rows]
    assert got == [
        ("no_press", "uniform", 0.0),
        ("nestedkv", "uniform", 0.5), ("nestedkv", "uniform", 0.9),
        ("nestedkv", "adaptive", 0.5), ("nestedkv", "adaptive", 0.9),
        ("keydiff", "uniform", 0.5), ("keydiff", "uniform", 0.9),
        ("random", "uniform", 0.5), ("random", "uniform", 0.9),
    ]
    ref, rows = rep.rows[0], rep.rows[1:]
    assert ref["n_questions"] == 4 and ref["kept_share"] == pytest.approx(1.0)
    assert ref["agree_exact"] is None and ref["delta_nll"] is None  # the reference is not scored against itself
    for r in rows:
        assert r["n_questions"] == 4 and r["n_docs"] == 2
        assert 0.0 <= r["rouge_l"] <= 1.0 and 0.0 <= r["top1_agreement"] <= 1.0
        # uniform budgets keep floor((1 - r) * N) rows per head; adaptive ones the same total per layer
        assert r["kept_share"] == pytest.approx(1 - r["compression_ratio"], abs=0.02)
        # what is allocated: exactly the kept rows with uniform budgets, padded heads with adaptive ones
        if r["head_budget"] == "uniform":
            assert r["resident_share"] == pytest.approx(r["kept_share"])
        else:
            assert r["resident_share"] >= r["kept_share"]
        # resident MiB per document: the reference's bytes scaled by the resident share
        assert r["resident_mib"] == pytest.approx(ref["resident_mib"] * r["resident_share"], rel=1e-6)
    # the markdown and the display table carry one line per configuration
    md = markdown_table(rep.rows)
    assert md.count("\n") == 1 + len(rep.rows)
    assert rep.table.num_rows == len(rep.rows) and "accuracy" in rep.table.column_names


def test_a_summary_evaluation_reports_where_summaries_draw_from(tmp_path, monkeypatch):
    """Summaries have no gold answer: the report shows source coverage (the uncompressed summary's beside each
    compressed one's) instead of the accuracy columns, and plots it."""
    with use_tiny_model(monkeypatch):
        batch = write_batch(tmp_path / "in.parquet", sample_docs(2, 400))
        base = RunConfig(task="summarize", model=TINY_NAME, press="no_press", compression_ratio=0.0,
                         max_new_tokens=8, prefill_step_size=128)
        db = tmp_path / "sum.duckdb"
        run(batch, make_configs(base, ["no_press", "nestedkv"], [0.5, 0.9]), db, EngineOptions(evaluate=True))
    rep = write_report(db, tmp_path / "out")
    assert [r["press"] for r in rep.rows] == ["no_press", "nestedkv", "nestedkv"]
    for r in rep.rows:
        assert r["accuracy"] is None and 0.0 <= r["source_coverage"] <= 1.0
    assert "source" in rep.table.column_names and "accuracy" not in rep.table.column_names
    text = rep.markdown_path.read_text()
    assert "**source**" in text and "gold answer" not in text and "questions per configuration" not in text
    with Store(str(db), read_only=True) as store:
        got = store.query("SELECT metric, full_value FROM quality_vs_full WHERE metric = 'source_coverage'").to_pylist()
    assert len(got) == 2 and all(0.0 <= g["full_value"] <= 1.0 for g in got)  # the uncompressed summary's
    assert rep.plot_path.read_bytes()[:8] == PNG_MAGIC


def test_write_report_produces_markdown_and_png(evaluated, tmp_path):
    db, _ = evaluated
    out = tmp_path / "reports"
    rep = write_report(db, out)
    assert rep.markdown_path == out / "report.md" and rep.plot_path == out / "quality_vs_ratio.png"
    text = rep.markdown_path.read_text()
    assert text.startswith("# Quality against compression")
    assert "| method | head budget | ratio |" in text and "| nestedkv | adaptive | 0.90 |" in text
    png = rep.plot_path.read_bytes()
    assert png[:8] == PNG_MAGIC and len(png) > 10_000
    assert rep.frontier_path == out / "quality_vs_memory.png" and rep.frontier_path.read_bytes()[:8] == PNG_MAGIC
    assert "## Which configuration at each memory size" in text


def test_frontier_keeps_what_no_smaller_cache_beats():
    def row(name, mib, acc, gold=None):
        return {"press": name, "head_budget": "uniform", "compression_ratio": 0.5, "resident_mib": mib,
                "accuracy": acc, "delta_gold_nll": gold}

    rows = [row("a", 10.0, 0.9), row("b", 2.0, 0.5), row("c", 3.0, 0.4), row("d", 2.0, 0.5, 0.1),
            row("e", 2.0, 0.5, 0.05), row("f", 5.0, 0.9), row("g", 1.0, None), row("h", None, 1.0)]
    # c is beaten by the smaller b/d/e; a by the smaller f; of three equal points, the lowest gold NLL
    assert [r["press"] for r in frontier(rows)] == ["e", "f"]


def test_latest_evaluation_wins_when_a_configuration_is_evaluated_twice(evaluated):
    db, _ = evaluated
    before = {(r["press"], r["head_budget"], r["compression_ratio"]): r for r in build_report(db).rows}
    with Store(db) as s:  # a later run of the same configuration re-scored every nestedkv answer as wrong
        cfg = RunConfig(task="qa", model=TINY_NAME, press="nestedkv", compression_ratio=0.5, max_new_tokens=5,
                        prefill_step_size=128)
        old = s.query("SELECT e.* FROM evaluations e JOIN runs r USING (run_id) WHERE r.config_hash = ?",
                      [cfg.config_hash()]).to_pylist()
        run_id = s.start_run(cfg, "again")
        s.write_evaluations([{**e, "run_id": run_id, "value": 0.0} for e in old if e["metric"] == "correct"])
    after = {(r["press"], r["head_budget"], r["compression_ratio"]): r for r in build_report(db).rows}
    assert after[("nestedkv", "uniform", 0.5)]["accuracy"] == 0.0
    assert after[("nestedkv", "uniform", 0.5)]["n_questions"] == 4  # replaced, not added
    # Float sums may come back in another order: numbers equal up to rounding, the rest exactly.
    a, b = after[("keydiff", "uniform", 0.5)], before[("keydiff", "uniform", 0.5)]
    assert a.keys() == b.keys()
    for key, value in b.items():
        if isinstance(value, float):
            assert a[key] == pytest.approx(value, rel=1e-12), key
        else:
            assert a[key] == value, key


def test_report_on_a_store_without_evaluations_says_so(tmp_path):
    db = tmp_path / "empty.duckdb"
    Store(db).close()
    with pytest.raises(StoreError, match="nkv eval"):
        build_report(db)


@pytest.mark.slow  # an evaluation and a report through the CLI
def test_cli_eval_then_report(tmp_path, monkeypatch):
    with use_tiny_model(monkeypatch):
        batch = write_batch(tmp_path / "in.parquet", sample_docs(2, 300))
        db, out = tmp_path / "cli.duckdb", tmp_path / "out"
        cli = CliRunner()
        res = cli.invoke(app, ["eval", "--input", batch, "--press", "nestedkv,knorm", "--compression-ratio", "0.5,0.75",
                               "--head-budget", "uniform,adaptive", "--db", str(db), "--model", TINY_NAME,
                               "--max-new-tokens", "4"])
        assert res.exit_code == 0, res.output
        with Store(db, read_only=True) as s:
            runs = s.query("SELECT press, head_budget, compression_ratio, max_new_tokens, task FROM runs").to_pylist()
        # every combination: 2 presses x 2 ratios x 2 head budgets, and no_press
        assert len(runs) == 1 + 8 and all(r["task"] == "qa" and r["max_new_tokens"] == 4 for r in runs)
        assert sum(r["head_budget"] == "adaptive" for r in runs) == 4
        res = cli.invoke(app, ["report", "--db", str(db), "--out", str(out)])
        assert res.exit_code == 0, res.output
        assert (out / "report.md").is_file() and (out / "quality_vs_ratio.png").read_bytes()[:8] == PNG_MAGIC
        # a missing store is a one-line error, exit 2
        res = cli.invoke(app, ["report", "--db", str(tmp_path / "nope.duckdb"), "--out", str(out)])
        assert res.exit_code == 2 and "no such database" in " ".join(res.output.split())


def test_the_table_writer_aligns_escapes_and_marks_missing_cells():
    from pipeline.tables import markdown, markdown_dicts

    lines = markdown(["name", "n"], [["a|b", 1], [None, 2]], align="lr")
    assert lines == ["| name | n |", "|---|---:|", "| a\\|b | 1 |", "| - | 2 |"]
    assert markdown_dicts([{"x": None, "y": 3}], missing="") == ["| x | y |", "|---|---|", "|  | 3 |"]
