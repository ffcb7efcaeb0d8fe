"""How much of a batch's wall time is not model compute (loading, validation, tokenization, store).

    nkv bench overhead [--input data/sample_batch.parquet] [--task qa] [--max-new-tokens 32]

Model compute is what the runner times per document (prefill, compress, question prefill and
decode); everything else in ``engine.run`` (model load included, as in a real first run) is overhead.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Annotated, Callable, Optional

from pydantic import Field

from nestedkv.run_defaults import COMPRESSION_RATIO
from pipeline.config import DEFAULT_INPUT, RunConfig, Task
from pipeline.engine import run


def timed(fn):
    """(seconds, result) of ``fn()``."""
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def run_overhead(input: Annotated[str, Field(description="the batch")] = DEFAULT_INPUT,
                 task: Annotated[Task, Field(description="the batch's task")] = "qa", model: Optional[str] = None,
                 press: Annotated[str, Field(description="the press")] = "nestedkv",
                 compression_ratio: Annotated[float, Field(description="fraction of the context removed")] = COMPRESSION_RATIO,
                 max_new_tokens: Annotated[int, Field(description="tokens per output at most")] = 32,
                 out: Annotated[Optional[str], Field(description="also write the figures here (JSON)")] = None, log: Callable[[str], None] = print) -> dict:
    """One batch through ``engine.run`` into a temporary store, its wall time split into model compute and the
    rest; the figures through ``log`` (and to ``out`` as JSON). ``model`` None: the configuration's default."""
    cfg = {"task": task, "press": press, "compression_ratio": compression_ratio, "max_new_tokens": max_new_tokens}
    if model:
        cfg["model"] = model
    config = RunConfig(**cfg)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        summary = run(input, [config], str(Path(tmp) / "bench.duckdb"))
        results = [o.result for o in summary.outcomes]
        wall = time.perf_counter() - t0
    prefill = sum(r.prefill_s for r in results)
    compress = sum(r.compress_s for r in results)
    decode = sum(r.decode_s for r in results)
    compute = prefill + compress + decode
    figures = {
        "documents": len(results),
        "context_tokens": sum(r.n_tokens for r in results),
        "generated_tokens": sum(q.n_generated for r in results for q in r.questions),
        "wall_s": round(wall, 2),
        "prefill_s": round(prefill, 2),
        "compress_s": round(compress, 3),
        "decode_s": round(decode, 2),
        "overhead_s": round(wall - compute, 2),
        "overhead_share": round((wall - compute) / wall, 4),
    }
    log(f"{figures['documents']} documents, {figures['context_tokens']} context tokens, "
        f"{figures['generated_tokens']} generated tokens")
    log(f"wall {wall:.1f} s = prefill {prefill:.1f} + compress {compress:.2f} + question/decode {decode:.1f} "
        f"+ other {wall - compute:.1f} s")
    log(f"share of wall time not in model compute: {100 * figures['overhead_share']:.2f}% (target < 5%)")
    if out:
        Path(out).write_text(json.dumps(figures, indent=2))
    return figures
