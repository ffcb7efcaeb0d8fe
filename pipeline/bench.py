"""How much of a batch's wall time is not model compute (loading, validation, tokenization, store).

    python -m pipeline.bench [--input data/sample_batch.parquet] [--task qa] [--max-new-tokens 32]

Model compute is what the runner times per document (prefill, compress, question prefill and
decode); everything else in ``engine.run`` (model load included, as in a real first run) is overhead.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import nestedkv
from pipeline.config import RunConfig
from pipeline.engine import run


def timed(fn):
    """(seconds, result) of ``fn()``."""
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main(argv=None) -> dict:
    nestedkv.enable_cpu_fast_path()  # the CPU opt-in, before anything loads mlx
    ap = argparse.ArgumentParser(prog="python -m pipeline.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--input", default="data/sample_batch.parquet")
    ap.add_argument("--task", default="qa", choices=["qa", "summarize"])
    ap.add_argument("--model", default=None)
    ap.add_argument("--press", default="nestedkv")
    ap.add_argument("--compression-ratio", type=float, default=0.75)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--out", default=None, help="also write the figures as JSON")
    a = ap.parse_args(argv)
    cfg = {"task": a.task, "press": a.press, "compression_ratio": a.compression_ratio, "max_new_tokens": a.max_new_tokens}
    if a.model:
        cfg["model"] = a.model
    config = RunConfig(**cfg)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        summary = run(a.input, [config], str(Path(tmp) / "bench.duckdb"))
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
    print(f"{figures['documents']} documents, {figures['context_tokens']} context tokens, "
          f"{figures['generated_tokens']} generated tokens")
    print(f"wall {wall:.1f} s = prefill {prefill:.1f} + compress {compress:.2f} + question/decode {decode:.1f} "
          f"+ other {wall - compute:.1f} s")
    print(f"share of wall time not in model compute: {100 * figures['overhead_share']:.2f}% (target < 5%)")
    if a.out:
        Path(a.out).write_text(json.dumps(figures, indent=2))
    return figures


if __name__ == "__main__":
    main()
