"""The memory plan: before each document's prefill, the way it is read (whole, streaming, parts) is chosen to fit
``--memory-limit``, recorded per document; a document no way fits gets one line, before its prefill."""

import mlx.core as mx
import pytest

from pipeline import engine
from pipeline.runner import memory_plan
from pipeline.config import EngineOptions, RunConfig
from pipeline.documents import Document
from pipeline.engine import make_configs
from pipeline.runner.memory_plan import NoPlan, plan, shape_of
from pipeline.sizes import parse_size
from pipeline.store import Store
from tiny import TINY_NAME, sample_docs, tiny_model, use_tiny_model, write_batch

BASE = RunConfig(task="qa", model=TINY_NAME, max_new_tokens=4, prefill_step_size=64)


@pytest.mark.parametrize("text, n", [("8GiB", 8 * 2**30), ("512MiB", 512 * 2**20), ("16GB", 16 * 10**9),
                                     ("1.5G", int(1.5 * 2**30)), ("4096", 4096), (" 2 kib ", 2048)])
def test_sizes_parse(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("text", ["", "8 parsecs", "-1GiB", "0", "GiB", "1e9"])
def test_bad_sizes_are_refused_naming_the_form(text):
    with pytest.raises(ValueError, match="a memory size is a positive number"):
        parse_size(text)
    with pytest.raises(ValueError, match="memory size"):
        EngineOptions(memory_limit=text)


def limits(model, n, chunk, press):
    """The estimates of reading ``n`` tokens whole and streaming under ``press``."""
    shape = shape_of(model)
    whole = memory_plan.peak(shape, model, n, chunk, n)
    streaming = memory_plan.peak(shape, model, n, chunk, min(n, press.n_keep(n) + 2 * chunk))
    return shape, whole, streaming


def document_limits(model, cfg, chars: int) -> tuple[int, int]:
    """The whole and streaming estimates for a sample document of ``chars`` characters, as the runner reads it."""
    runner = engine.make_runner(cfg)
    n = len(runner.prepare(Document(**sample_docs(1, chars)[0]), fit=False).context_ids)
    return limits(model, n, cfg.prefill_step_size, cfg.make_press())[1:]


def test_the_plan_takes_the_first_way_that_fits():
    model = tiny_model()
    press = BASE.model_copy(update={"compression_ratio": 0.75}).make_press()
    shape, whole, streaming = limits(model, 2000, 64, press)
    assert streaming < whole
    assert plan(shape, model, "d", 2000, 64, [press], whole).way == "whole"
    p = plan(shape, model, "d", 2000, 64, [press], whole - 1)
    assert p.way == "streaming" and p.peak_bytes == streaming
    # a press that cannot stream (the uncompressed reference among them): parts that fit
    p = plan(shape, model, "d", 2000, 64, [press, BASE.reference().make_press()], whole - 1)
    assert p.way == "parts" and 256 <= p.part_tokens < 2000 and p.peak_bytes <= whole - 1
    assert p.label() == f"parts of {p.part_tokens}"
    with pytest.raises(NoPlan, match=r"document 'd': reading its 2,000 tokens needs at least .* GiB"):
        plan(shape, model, "d", 2000, 64, [press], shape.weights)


def test_a_limit_between_streaming_and_whole_streams_every_document_with_its_peak_bounded(tmp_path, monkeypatch,
                                                                                           prefills):
    cfg = BASE.model_copy(update={"compression_ratio": 0.75})
    with use_tiny_model(monkeypatch) as ((model, _), _):
        batch = write_batch(tmp_path / "in.parquet", sample_docs(2, 1400))
        whole, streaming = document_limits(model, cfg, 1400)
        limit = (whole + streaming) // 2
        summary = engine.run(batch, [cfg], tmp_path / "r.duckdb", EngineOptions(memory_limit=str(limit)))
        assert summary.n_ok == 2 and summary.n_failed == 0
        with Store(tmp_path / "r.duckdb", read_only=True) as store:
            rows = store.query("SELECT DISTINCT doc_id, memory_plan, planned_peak_bytes, peak_kv_prefill_bytes, "
                               "n_tokens FROM outputs").to_pylist()
            full = store.query("SELECT doc_id, sum(bytes_full) AS b FROM layer_memory GROUP BY doc_id").to_pylist()
        whole_kv = {r["doc_id"]: int(r["b"]) for r in full}
        for r in rows:
            assert r["memory_plan"] == "streaming" and r["planned_peak_bytes"] <= limit
            assert r["peak_kv_prefill_bytes"] < 0.6 * whole_kv[r["doc_id"]]  # evicted while reading
        # no limit: the default, a share of this machine's memory, reads them whole
        summary = engine.run(batch, [cfg], tmp_path / "w.duckdb")
        with Store(tmp_path / "w.duckdb", read_only=True) as store:
            assert {r["memory_plan"] for r in store.query("SELECT memory_plan FROM outputs").to_pylist()} == {"whole"}


def test_an_evaluation_reads_in_parts_and_a_limit_below_any_way_is_one_line_before_the_prefill(tmp_path, monkeypatch,
                                                                                             prefills):
    cfg = BASE.model_copy(update={"compression_ratio": 0.75})
    with use_tiny_model(monkeypatch) as ((model, _), _):
        batch = write_batch(tmp_path / "in.parquet", sample_docs(1, 1400))
        whole, _ = document_limits(model, cfg, 1400)
        opts = EngineOptions(evaluate=True, memory_limit=str(whole - 1))  # the reference cannot stream
        summary = engine.run(batch, [cfg], tmp_path / "e.duckdb", opts)
        assert summary.n_failed == 0, [o.result.error for o in summary.outcomes]
        with Store(tmp_path / "e.duckdb", read_only=True) as store:
            plans = {r["memory_plan"] for r in store.query("SELECT memory_plan FROM outputs").to_pylist()}
            modes = {r["read_mode"] for r in store.query("SELECT read_mode FROM outputs").to_pylist()}
        assert len(plans) == 1 and next(iter(plans)).startswith("parts of ") and modes == {"map_reduce"}
        prefills.clear()
        summary = engine.run(batch, [cfg], tmp_path / "x.duckdb", EngineOptions(memory_limit="1MiB"))
        assert summary.n_failed == 1 and prefills == []  # refused before any prefill
        error = summary.outcomes[0].result.error
        assert "\n" not in error and "over the memory limit of 0.00 GiB" in error and "--memory-limit" in error
