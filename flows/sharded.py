"""The ``sharded-batch`` flow: one batch fanned out over a process work pool (``flows.shards``), and
serving it on a schedule (``nkv serve --pool``). Apart from ``flows.batch`` and ``flows.deploy``, so that
neither of them needs ``flows.shards``, which deploys the batch flow (no import circle)."""

from __future__ import annotations

from typing import Any, Optional

from prefect import flow, get_run_logger

from flows import artifacts, deploy
from flows.batch import batch_config
from flows.shards import fan_out
from pipeline.config import DEFAULT_DB, DEFAULT_INPUT, DEFAULT_MODEL, BatchOptions, HeadBudget, PrefillMode, Task


@flow(name="sharded-batch", persist_result=False)
def sharded_batch(
    pool: str,
    input: str = DEFAULT_INPUT,
    task: Task = "summarize",
    shards: Optional[int] = None,
    shard_size: Optional[int] = None,
    data_path: Optional[str] = None,
    press: str = "nestedkv",
    compression_ratio: float = 0.75,
    budget: Optional[int] = None,
    head_budget: Optional[HeadBudget] = None,
    prefill: PrefillMode = "whole",
    press_params: Optional[dict[str, Any]] = None,
    model: str = DEFAULT_MODEL,
    db: str = DEFAULT_DB,
    options: BatchOptions = BatchOptions(),
    kv_bits: Optional[int] = None,
    kv_group_size: int = 64,
) -> dict:
    """One batch fanned out over a process work pool (``flows.shards``): a ``<task>-batch/shards`` flow run
    per shard, all writing the lake ``db``. Loads no model itself; fails unless every document ends done."""
    log = get_run_logger()
    options = options or BatchOptions()
    config = batch_config(task, press, compression_ratio, budget, head_budget, prefill, press_params, model, options,
                          kv_bits, kv_group_size)
    seen: dict[int, tuple] = {}

    def on_progress(shard_list) -> None:
        for s in shard_list:
            now = (s.state, s.done, s.attempt, s.skipped)
            if seen.get(s.index) != now:
                seen[s.index] = now
                log.info("%s: %s, %d/%d documents stored", s.label, s.status(), s.done, len(s.docs))

    result = fan_out(input, config, db, pool, options, shards=shards, shard_size=shard_size, data_path=data_path,
                     on_progress=on_progress, log=log.warning)
    for err in result.input_errors:
        log.warning("skipped input row: %s", err)
    line = result.summary()
    log.info(line)
    artifacts.publish_tables("sharded-batch", result.savings, [], result.run_ids)
    if result.n_ok < result.n_documents:
        raise RuntimeError(line)
    return {"shards": len(result.shards), "runs": result.run_ids, "documents": result.n_documents,
            "ok": result.n_ok, "failed": result.n_failed, "bad_rows": len(result.input_errors)}


def serve_sharded(task: str = "summarize", *, pool: str, shards: Optional[int] = None, shard_size: Optional[int] = None,
                  data_path: Optional[str] = None, name: str = "nightly", cron: Optional[str] = "0 2 * * *",
                  **params) -> None:
    """Serve ``sharded-batch/<name>`` on a cron schedule until interrupted: each run splits the batch and
    submits its shards to ``pool`` (``flows.shards``), where the workers load the model; this process
    only waits for them."""
    from prefect import serve

    deploy.check_server()
    extra = {"task": task, "pool": pool, "shards": shards, "shard_size": shard_size,
             "data_path": deploy.absolute(data_path) if data_path else None}
    serve(deploy.deployment(task, name, cron, params, sharded_batch, extra), limit=1)
