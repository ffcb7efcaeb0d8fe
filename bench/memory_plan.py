"""The memory plan at work: a document whose whole prefill does not fit the limit, read within it.

    nkv bench memory-plan [--model smollm2-135m] [--tokens 5500] [--compression-ratio 0.75]

Builds one document of about ``--tokens`` tokens from the bundled novels, estimates its peaks (whole, streaming)
and sets the limit to the weights, plus half the document's whole KV, plus 150 MiB of working buffers (unless
``--limit`` is given). It then runs ``nkv run``'s engine on it (questions: one) three ways: under that limit with
the key-only press, under it with the uncompressed reference alongside (an evaluation: parts), and under a limit
below any way. Per way: the plan chosen, the planned peak, the measured process peak (``mx.get_peak_memory``:
weights, KV and buffers) and the peak K/V while prefilling against the document's whole K/V.
"""

from __future__ import annotations

import json
import resource
import tempfile
from pathlib import Path
from typing import Annotated, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from pydantic import Field

from nestedkv.run_defaults import COMPRESSION_RATIO
from pipeline.runner import memory_plan
from pipeline.config import DEFAULT_MODEL, EngineOptions, RunConfig
from pipeline.documents import load_documents
from pipeline.engine import make_runner, run
from pipeline.sizes import parse_size
from pipeline.store import Store
from pipeline.tasks import summary_documents, token_counter

MIB = 2**20
BUFFERS = 150 * MIB


def measure(model_ref: str, tokens: int, ratio: float, chunk: int, limit: Optional[int], workdir: Path,
            log=print) -> dict:
    cfg = RunConfig(task="qa", model=model_ref, compression_ratio=ratio, prefill_step_size=chunk, max_new_tokens=8)
    runner = make_runner(cfg)
    doc = summary_documents(token_counter(runner.tokenizer), [tokens], 1, seed=0)[0]
    batch = workdir / "doc.parquet"
    pq.write_table(pa.Table.from_pylist([{"doc_id": doc["doc_id"], "text": doc["text"],
                                          "questions": ["Who is mentioned first?"]}]), batch)
    n = len(runner.prepare(load_documents(str(batch))[0][0], fit=False).context_ids)
    shape = memory_plan.shape_of(runner.model)
    whole = memory_plan.peak(shape, runner.model, n, chunk, n)
    streaming = memory_plan.peak(shape, runner.model, n, chunk, min(n, cfg.make_press().n_keep(n) + 2 * chunk))
    limit = limit or shape.weights + n * shape.row_bytes // 2 + BUFFERS
    out = {"model": model_ref, "context_tokens": n, "weights_mib": shape.weights / MIB,
           "whole_kv_mib": n * shape.row_bytes / MIB, "planned_whole_mib": whole / MIB,
           "planned_streaming_mib": streaming / MIB, "limit_mib": limit / MIB, "ways": {}}
    log(f"{n} context tokens; weights {out['weights_mib']:.0f} MiB, whole KV {out['whole_kv_mib']:.0f} MiB; "
        f"planned peak whole {out['planned_whole_mib']:.0f} MiB, streaming {out['planned_streaming_mib']:.0f} MiB; "
        f"limit {out['limit_mib']:.0f} MiB")
    for name, options in (("run", EngineOptions(memory_limit=str(limit))),
                          ("eval", EngineOptions(evaluate=True, memory_limit=str(limit))),
                          ("below any way", EngineOptions(memory_limit=str(shape.weights)))):
        db = workdir / f"{name.replace(' ', '-')}.duckdb"
        summary = run(str(batch), [cfg], str(db), options, runner=runner)
        with Store(str(db), read_only=True) as store:
            rows = store.query("SELECT r.press, o.status, o.error, o.memory_plan, o.planned_peak_bytes, "
                               "o.peak_prefill_bytes, o.peak_kv_prefill_bytes FROM outputs o JOIN runs r USING "
                               "(run_id)").to_pylist()
        out["ways"][name] = rows
        for r in rows:
            if r["status"] != "ok":
                log(f"  {name:<14} {r['press']:<9} {r['status']}: {r['error']}")
                continue
            log(f"  {name:<14} {r['press']:<9} plan {r['memory_plan']:<14} planned {r['planned_peak_bytes'] / MIB:6.0f} "
                f"MiB, measured {r['peak_prefill_bytes'] / MIB:6.0f} MiB, peak KV {r['peak_kv_prefill_bytes'] / MIB:5.0f} "
                f"MiB = {r['peak_kv_prefill_bytes'] / (n * shape.row_bytes):.2f} of the whole KV")
        out["ways"][name + " summary"] = {"ok": summary.n_ok, "failed": summary.n_failed}
    out["max_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    log(f"process peak RSS {out['max_rss_mib']:.0f} MiB")
    return out


def run_benchmark(model: str = DEFAULT_MODEL,
                  tokens: Annotated[int, Field(description="the document's length in tokens (about)")] = 5500,
                  compression_ratio: Annotated[float, Field(description="fraction of the context removed")] = COMPRESSION_RATIO,
                  chunk: Annotated[int, Field(description="prefill chunk size")] = 512,
                  limit: Annotated[Optional[str], Field(description="the memory limit (default: the weights, half "
                                                        "the document's whole KV and 150 MiB)")] = None,
                  out: Annotated[Optional[str], Field(description="also write the figures here (JSON)")] = None) -> dict:
    with tempfile.TemporaryDirectory(prefix="nkv-memory-plan-") as tmp:
        figures = measure(model, tokens, compression_ratio, chunk, parse_size(limit) if limit else None, Path(tmp))
    if out:
        Path(out).write_text(json.dumps(figures, indent=2, default=str))
    return figures
