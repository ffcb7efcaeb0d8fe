"""Scheduled deployments of the batch flows (``nkv serve``).

Serving needs a Prefect server that outlives this process, so unlike a local flow run it never starts
Prefect's temporary one: without ``PREFECT_API_URL`` pointing at a live server it stops with one line.
Scale-out: the same flows run from a process work pool, one worker per Mac (``--limit 1``), writing one
DuckLake store (``--db ducklake:postgres:...``); ``flows.shards`` fans a batch out over such a pool.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import httpx
from prefect import deploy, serve
from prefect.deployments.runner import EntrypointType
from prefect.settings import get_current_settings

from flows.batch import FLOWS
from flows.params import ONE
from pipeline.spec import BatchSpec
from pipeline.store import lake

LOCAL_API = "http://127.0.0.1:4200/api"


class ServerUnavailable(RuntimeError):
    pass


def absolute(path: str) -> str:
    # Flow runs start in their own process, maybe elsewhere: pin paths where they exist, keep model names.
    if lake.is_lake(path):  # a lake's catalog file, not the spec, is the path (conninfo stays as it is)
        return str(lake.LakeSpec.parse(path).absolute())
    p = Path(path).expanduser()
    return str(p.resolve()) if p.exists() or p.parent.exists() and p.suffix else path


def check_server(timeout: float = 3.0, hint: Optional[str] = None) -> str:
    """The configured API URL, once it answers; ``ServerUnavailable`` (one line) otherwise."""
    url = get_current_settings().api.url
    hint = hint or f"start one with `prefect server start` and set PREFECT_API_URL={LOCAL_API}"
    if not url:
        raise ServerUnavailable(f"no Prefect server configured (PREFECT_API_URL is unset): {hint}")
    try:
        httpx.get(url.rstrip("/") + "/health", timeout=timeout)
    except httpx.HTTPError as exc:
        raise ServerUnavailable(f"the Prefect server at PREFECT_API_URL={url} is not answering "
                                f"({type(exc).__name__}): {hint}") from None
    return url


def batch_parameters(spec: BatchSpec) -> dict:
    """A one-configuration spec as a deployment's parameters, its paths pinned (``options`` holds the
    generation, engine and retry settings)."""
    params = ONE.arguments(spec)
    return {**params, "input": absolute(spec.input), "model": absolute(spec.model), "db": absolute(spec.db),
            "options": spec.options.model_dump()}


def deployment(spec: BatchSpec, name: str, cron: Optional[str], flow=None, extra: Optional[dict] = None):
    task = spec.task
    return (flow or FLOWS[task]).to_deployment(
        name=name,
        cron=cron,
        parameters={**batch_parameters(spec), **(extra or {})},
        # Import by module path: the package is installed, so a runner or worker finds it from any directory.
        entrypoint_type=EntrypointType.MODULE_PATH,
        description=f"Scheduled {task} batch with NestedKV KV-cache compression",
        tags=["nestedkv"],
    )


def serve_batch(spec: BatchSpec, *, name: str = "nightly", cron: Optional[str] = "0 2 * * *") -> None:
    """Serve ``summarize-batch/<name>`` (or ``qa-batch/<name>``) on a cron schedule until interrupted.

    One flow run at a time per serving process: each run loads the model and holds the DuckDB writer.
    """
    check_server()
    serve(deployment(spec, name, cron), limit=1)


def deploy_batch(spec: BatchSpec, *, pool: str, name: str = "nightly", cron: Optional[str] = "0 2 * * *") -> str:
    """Register the deployment in a work pool (``prefect work-pool create <pool> --type process``) and return
    its id; workers started with ``prefect worker start --pool <pool> --limit 1`` (one per Mac, each with
    this package installed) run it. Each run writes to ``db`` on the machine that runs it."""
    check_server()
    # ignore_warnings: Prefect suggests .serve for process pools; a pool is the point here (one worker per Mac).
    (deployment_id,) = deploy(deployment(spec, name, cron), work_pool_name=pool, build=False, push=False,
                              print_next_steps_message=False, ignore_warnings=True)
    return str(deployment_id)
