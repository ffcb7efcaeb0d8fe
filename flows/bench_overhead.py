"""Prefect's overhead per document: the batch flow against ``pipeline.batch.run_batch`` on the same input.

    nkv bench prefect [--input data/sample_batch.parquet] [--model smollm2-135m] [--max-new-tokens 16]

Every timed run writes a fresh DuckDB file (no resume), with the model already loaded. Two measurements:
the real model (what a user pays, noisy by the model's own run-to-run variation), and a no-op runner that
returns at once (Prefect's cost alone: task runs, state changes, logs and artifacts per document). The
first flow call of a process also starts Prefect's temporary local server; that one-off cost is reported
apart from the per-document figure.
"""

import json
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Callable

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import Field

from bench.overhead import timed as _timed
from flows.batch import FLOWS
from pipeline import engine
from pipeline.config import DEFAULT_INPUT, DEFAULT_MODEL, BatchOptions, RunConfig
from pipeline.documents import load_documents
from pipeline.engine import document, make_runner
from pipeline.results import DocumentResult


@contextmanager
def _noop_runner():
    """Each document's work returns empty ok results at once (no prefill, no decode): what remains is
    orchestration and the store."""
    real = document.Work.start

    def start(work):
        d = work.doc
        work.results = {c: DocumentResult(d.doc_id, d.content_sha256, d.n_chars, d.title) for c in work.todo}
        return work

    document.Work.start = start
    try:
        yield
    finally:
        document.Work.start = real


def _replicated(input: str, copies: int, workdir: Path) -> str:
    """The input's documents ``copies`` times under new ids and hashes: enough tasks to see a per-task cost."""
    docs, _ = load_documents(input)
    rows = [{"doc_id": f"{d.doc_id}-{j}", "text": f"copy {j}\n{d.text}"} for j in range(copies) for d in docs]
    path = workdir / "replicated.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def measure(input: str, model: str, max_new_tokens: int, repeats: int, workdir: Path,
            with_model: bool = True) -> dict:
    docs, _ = load_documents(input)
    n = len(docs)
    config = RunConfig(model=model, max_new_tokens=max_new_tokens)
    options = BatchOptions(max_new_tokens=max_new_tokens)
    counter = iter(range(10_000))

    def fresh_db() -> str:
        return str(workdir / f"bench-{next(counter)}.duckdb")

    def direct(db=None):
        return _timed(lambda: engine.run(input, [config], db or fresh_db()))[0]

    def flow(db=None):
        return _timed(lambda: FLOWS["summarize"](input=input, model=model, db=db or fresh_db(), options=options))[0]

    t_load, _ = _timed(lambda: make_runner(config))  # the model stays loaded for every timed run below
    with _noop_runner():  # Prefect's own costs, free of the model's run-to-run noise
        cold = flow()  # the first flow call of the process starts the temporary server
        noop_flow = min(flow() for _ in range(repeats + 1))
        noop_direct = min(direct() for _ in range(repeats + 1))
        done = fresh_db()
        direct(done)
        fixed = min(flow(done) for _ in range(repeats + 1)) - min(direct(done) for _ in range(repeats + 1))
        many = _replicated(input, 20, workdir)
        n_many = 20 * n
        t_many = min(_timed(lambda: FLOWS["summarize"](input=many, model=model, db=fresh_db(), options=options))[0]
                     - _timed(lambda: engine.run(many, [config], fresh_db()))[0] for _ in range(repeats))
    real_direct, real_flow = [], []
    for _ in range(repeats if with_model else 0):  # interleaved, so load drift hits both alike
        real_direct.append(direct())
        real_flow.append(flow())
    return {
        "input": input, "model": model, "documents": n, "max_new_tokens": max_new_tokens, "repeats": repeats,
        "model_load_s": round(t_load, 2),
        "prefect_server_start_s": round(cold - noop_flow, 2),
        "noop_direct_s": round(noop_direct, 3),
        "noop_flow_s": round(noop_flow, 3),
        "flow_fixed_s": round(fixed, 3),
        "noop_overhead_per_doc_s": round((noop_flow - noop_direct) / n, 3),
        "noop_task_overhead_per_doc_s": round((t_many - fixed) / n_many, 4),
        "noop_task_overhead_docs": n_many,
        "direct_s": [round(t, 2) for t in real_direct],
        "flow_s": [round(t, 2) for t in real_flow],
        "overhead_per_doc_s": round((min(real_flow) - min(real_direct)) / n, 3) if real_flow else None,
    }


def run(input: Annotated[str, Field(description="the batch")] = DEFAULT_INPUT, model: str = DEFAULT_MODEL,
        max_new_tokens: Annotated[int, Field(description="tokens per output at most")] = 16,
        repeats: Annotated[int, Field(description="timed runs of each kind, the fastest counts")] = 1,
        model_runs: Annotated[bool, Field(description="also the runs with the model (else the no-op runner "
                                                      "only)")] = True,
        as_json: Annotated[bool, Field(description="print one JSON object instead of a table",
                                       json_schema_extra={"flags": ["--json"]})] = False,
        log: Callable[[str], None] = print) -> dict:
    """``measure`` in a temporary folder, through ``log`` as a table with its reading (or one JSON object).
    ``repeats``: timed runs of each kind, the fastest counts; ``model_runs`` False: the no-op runner only."""
    with tempfile.TemporaryDirectory(prefix="nkv-bench-") as tmp:
        out = measure(input, model, max_new_tokens, repeats, Path(tmp), with_model=model_runs)
    if as_json:
        log(json.dumps(out))
        return out
    width = max(map(len, out))
    for k, v in out.items():
        log(f"{k:<{width}}  {v}")
    log(f"\nPrefect's cost without model work: {out['noop_overhead_per_doc_s'] * 1000:.0f} ms per document "
        f"({out['noop_task_overhead_per_doc_s'] * 1000:.0f} ms per task, measured over "
        f"{out['noop_task_overhead_docs']} documents, + {out['flow_fixed_s']:.2f} s per flow run / {out['documents']}), and {out['prefect_server_start_s']:.1f} s once per process for the "
        f"temporary server.")
    if out["overhead_per_doc_s"] is not None:
        log(f"With the model: {out['overhead_per_doc_s'] * 1000:.0f} ms per document (flow minus direct, fastest "
            f"of {out['repeats']} each; compare with the spread of the direct runs).")
    return out
