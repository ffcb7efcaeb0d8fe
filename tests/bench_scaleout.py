"""Throughput of ``nkv run --pool``: documents per hour with one worker, then two, on this machine.

    python tests/bench_scaleout.py [--model smollm2-135m] [--docs 16] [--shards 4] [--chars 1500] [--tokens 32]

Same setup as tests/test_scaleout.py (throwaway PostgreSQL catalog, Prefect server, process work pool on
loopback). Each measurement is one batch from submission to the merged summary, so it includes every
shard's process start and model load. The second batch uses another compression ratio: nothing is skipped.
Not collected by pytest (timings are figures to quote, not assertions).
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_scaleout import Postgres, pg_bindir  # noqa: E402
from test_serve import NKV, PREFECT, clean_env, free_port, get, start, stop, wait_for  # noqa: E402
from tiny import sample_docs, write_batch  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--chars", type=int, default=1500)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="nkv-bench-"))
    pg = Postgres(pg_bindir())
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = clean_env(tmp, api)
    env.pop("NKV_CACHE_DIR")  # the real model's converted copy in the user's cache, converted once before
    env.update(PREFECT_WORKER_QUERY_SECONDS="1", PREFECT_WORKER_PREFETCH_SECONDS="1")
    inp = write_batch(tmp / "batch.parquet", sample_docs(args.docs, chars=args.chars))
    procs, workers, out = [], [], {"model": args.model, "docs": args.docs, "shards": args.shards,
                                   "chars": args.chars, "max_new_tokens": args.tokens, "cpus": os.cpu_count()}
    try:
        db = "ducklake:postgres:" + pg.start()
        procs.append(start(PREFECT + ["server", "start", "--host", "127.0.0.1", "--port", str(port), "--no-ui"],
                           env, tmp / "server.log"))
        wait_for("the Prefect server", lambda: get(f"{api}/health"), 150)
        subprocess.run(PREFECT + ["work-pool", "create", "bench", "--type", "process"], env=env, check=True,
                       capture_output=True, timeout=120)
        for n_workers, ratio in ((1, "0.75"), (2, "0.5")):
            while len(workers) < n_workers:
                log = tmp / f"worker{len(workers)}.log"
                workers.append(log)
                procs.append(start(PREFECT + ["worker", "start", "--pool", "bench", "--limit", "1"], env, log))
            time.sleep(5)  # the workers poll before the batch is submitted
            t = time.monotonic()
            res = subprocess.run(NKV + ["run", "--pool", "bench", "--shards", str(args.shards), "--input", inp,
                                        "--model", args.model, "--db", db, "--data-path", str(tmp / "data"),
                                        "--max-new-tokens", str(args.tokens), "--compression-ratio", ratio],
                                 env=env, capture_output=True, text=True, timeout=1800)
            wall = time.monotonic() - t
            if res.returncode != 0:
                raise SystemExit(res.stderr[-3000:])
            out[f"workers_{n_workers}"] = {"wall_s": round(wall, 1), "docs_per_hour": round(args.docs * 3600 / wall)}
            print(json.dumps(out[f"workers_{n_workers}"]), file=sys.stderr)
        out["speedup"] = round(out["workers_2"]["docs_per_hour"] / out["workers_1"]["docs_per_hour"], 2)
        out["commit_retries"] = sum(int(n) for log in workers
                                    for n in re.findall(r"(\d+) commits lost a race", log.read_text()))
    finally:
        for p in reversed(procs):
            stop(p)
        pg.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
