"""The ``sharded-batch`` flow: one batch fanned out over a process work pool (``flows.shards``), and
serving it on a schedule (``nkv serve --pool``). Apart from ``flows.batch`` and ``flows.deploy``, so that
neither of them needs ``flows.shards``, which deploys the batch flow (no import circle)."""

from __future__ import annotations

from typing import Optional

from prefect import flow, get_run_logger, serve

from flows import artifacts, deploy
from flows.params import ONE, keyword, spec_function
from flows.shards import fan_out
from pipeline.config import Task
from pipeline.spec import BatchSpec


def _sharded(kwargs: dict, pool: str, task: Task = "summarize", shards: Optional[int] = None,
             shard_size: Optional[int] = None, data_path: Optional[str] = None) -> dict:
    log = get_run_logger()
    spec = ONE.spec(kwargs, task=task)
    seen: dict[int, tuple] = {}

    def on_progress(shard_list) -> None:
        for s in shard_list:
            now = (s.state, s.done, s.attempt, s.skipped)
            if seen.get(s.index) != now:
                seen[s.index] = now
                log.info("%s: %s, %d/%d documents stored", s.label, s.status(), s.done, len(s.docs))

    result = fan_out(spec, pool, shards=shards, shard_size=shard_size, data_path=data_path,
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


FAN_OUT = (keyword("task", Task, "summarize"), keyword("shards", Optional[int], None),
           keyword("shard_size", Optional[int], None), keyword("data_path", Optional[str], None))
sharded_batch = flow(name="sharded-batch", persist_result=False)(spec_function(
    "sharded_batch", """One batch fanned out over a process work pool (``flows.shards``): a ``<task>-batch/shards``
    flow run per shard, all writing the lake ``db``. Loads no model itself; fails unless every document ends
    done.""", ONE, _sharded, before=(keyword("pool", str),), after=FAN_OUT))


def serve_sharded(spec: BatchSpec, *, pool: str, shards: Optional[int] = None, shard_size: Optional[int] = None,
                  data_path: Optional[str] = None, name: str = "nightly", cron: Optional[str] = "0 2 * * *") -> None:
    """Serve ``sharded-batch/<name>`` on a cron schedule until interrupted: each run splits the batch and
    submits its shards to ``pool`` (``flows.shards``), where the workers load the model; this process
    only waits for them."""
    deploy.check_server()
    extra = {"task": spec.task, "pool": pool, "shards": shards, "shard_size": shard_size,
             "data_path": deploy.absolute(data_path) if data_path else None}
    serve(deploy.deployment(spec, name, cron, sharded_batch, extra), limit=1)
