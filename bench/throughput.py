"""Documents per hour: one document at a time, documents decoded together, and a re-run with a new budget
from a warm prefill cache, on the same batch in one process (the model is loaded before timing).

    nkv bench throughput [--input data/sample_batch.parquet] [--batch-size 5] [--compression-ratio 0.75]

Also checks that the batched answers equal the one-at-a-time ones (greedy), and says where they differ. The
re-run (at ``--rerun-ratio``) is timed four ways: without and with the warm prefill cache, one document at a
time and decoded together. ``--no-rerun`` measures only the first two (e.g. to check answers on a larger set).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Annotated, Optional

from pydantic import Field

from bench.overhead import timed as _timed
from nestedkv.run_defaults import COMPRESSION_RATIO
from pipeline.config import DEFAULT_INPUT, DEFAULT_MODEL, RunConfig, Task
from pipeline.engine import EngineOptions, make_runner, run
from pipeline.store import Store

def _answers(db: Path, ratio: float) -> list[dict]:
    with Store(db, read_only=True) as s:
        return s.answers_at_ratio(ratio)


def measure(input: str, task: str, model: str, batch_size: int, max_new_tokens: int, ratio: float,
            rerun_ratio: float, workdir: Path, rerun: bool = True) -> dict:
    config = RunConfig(task=task, model=model, compression_ratio=ratio, max_new_tokens=max_new_tokens)
    runner = make_runner(config)  # loaded once; every timing below is batch work only
    one_db, many_db = workdir / "one.duckdb", workdir / "many.duckdb"
    t_one, s_one = _timed(lambda: run(input, [config], one_db, runner=runner))
    t_many, _ = _timed(lambda: run(input, [config], many_db, EngineOptions(batch_size=batch_size), runner=runner))
    a, b = _answers(one_db, ratio), _answers(many_db, ratio)
    batched = {(y["doc_id"], y["question_idx"]): y["output"] for y in b}
    differ = [(x["doc_id"], x["question_idx"]) for x in a if batched.get((x["doc_id"], x["question_idx"])) != x["output"]]
    n = s_one.n_processed
    per_hour = lambda t: round(3600 * n / t, 1)  # noqa: E731
    figures = {
        "input": input, "task": task, "model": model, "documents": n, "max_new_tokens": max_new_tokens,
        "compression_ratio": ratio, "batch_size": batch_size,
        "one_at_a_time_s": round(t_one, 1), "batched_s": round(t_many, 1),
        "docs_per_hour_one": per_hour(t_one), "docs_per_hour_batched": per_hour(t_many),
        "batched_speedup": round(t_one / t_many, 2),
        "answers_compared": len(a), "answers_differing": differ,
    }
    if rerun:
        figures.update(measure_rerun(input, config, rerun_ratio, batch_size, runner, workdir))
    return figures


def measure_rerun(input: str, config: RunConfig, rerun_ratio: float, batch_size: int, runner, workdir: Path) -> dict:
    """A re-run with a new budget, without the prefill cache and from a warm one, one document at a time and
    decoded together: each pair like for like (same budget, same decoding), each into a store of its own."""
    store = workdir / "prefills"
    t_fill, _ = _timed(lambda: run(input, [config], workdir / "fill.duckdb", EngineOptions(prefill_cache=str(store)),
                                   runner=runner))
    rerun = config.model_copy(update={"compression_ratio": rerun_ratio})
    times = {}
    for name, options in {
        "cold_one": EngineOptions(),
        "warm_one": EngineOptions(prefill_cache=str(store)),
        "cold_batched": EngineOptions(batch_size=batch_size),
        "warm_batched": EngineOptions(prefill_cache=str(store), batch_size=batch_size),
    }.items():
        times[name], _ = _timed(lambda: run(input, [rerun], workdir / f"{name}.duckdb", options, runner=runner))
    return {
        "prefill_cache_fill_s": round(t_fill, 1),
        "rerun_ratio": rerun_ratio,
        **{f"rerun_{name}_s": round(t, 1) for name, t in times.items()},
        "rerun_speedup_one_at_a_time": round(times["cold_one"] / times["warm_one"], 2),
        "rerun_speedup_batched": round(times["cold_batched"] / times["warm_batched"], 2),
        "rerun_warm_batched_vs_cold_one": round(times["cold_one"] / times["warm_batched"], 2),
    }


def run_benchmark(input: Annotated[str, Field(description="the batch")] = DEFAULT_INPUT,
                  task: Annotated[Task, Field(description="the batch's task")] = "summarize",
                  model: str = DEFAULT_MODEL,
                  batch_size: Annotated[int, Field(description="documents decoded together")] = 5,
                  max_new_tokens: Annotated[int, Field(description="tokens per output at most")] = 128,
                  compression_ratio: Annotated[float, Field(description="fraction of the context removed")] = COMPRESSION_RATIO,
                  rerun_ratio: Annotated[float, Field(description="the re-run's ratio")] = 0.9,
                  rerun: Annotated[bool, Field(description="also time a re-run with a new ratio, with and without "
                                                  "the prefill cache")] = True,
                  out: Annotated[Optional[str], Field(description="also write the figures here (JSON)")] = None) -> dict:
    """``measure`` in a temporary folder, printed (and written to ``out`` as JSON)."""
    with tempfile.TemporaryDirectory(prefix="nkv-throughput-") as tmp:
        figures = measure(input, task, model, batch_size, max_new_tokens, compression_ratio, rerun_ratio, Path(tmp), rerun=rerun)
    width = max(map(len, figures))
    for k, v in figures.items():
        print(f"{k:<{width}}  {v}")
    if out:
        Path(out).write_text(json.dumps(figures, indent=2))
    return figures
