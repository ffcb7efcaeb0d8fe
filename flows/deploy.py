"""Scheduled deployments of the batch flows (``nkv serve``).

Serving needs a Prefect server that outlives this process, so unlike a local flow run it never starts
Prefect's temporary one: without ``PREFECT_API_URL`` pointing at a live server it stops with one line.
Scale-out: the same flows run from a process work pool, one worker per Mac (``--limit 1``), writing one
DuckLake store (``--db ducklake:postgres:...``); ``flows.shards`` fans a batch out over such a pool.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from flows.batch import FLOWS
from pipeline.config import BatchOptions, RunConfig
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
    import httpx
    from prefect.settings import get_current_settings

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


def batch_parameters(input: str, press: str, compression_ratio: float, budget: Optional[int], head_budget: str,
                     prefill: str, press_params: Optional[dict], model: str, db: str,
                     options: Optional[BatchOptions] = None, kv_bits: Optional[int] = None,
                     kv_group_size: int = 64) -> dict:
    """Every setting as a deployment parameter (``options`` holds the generation settings and retries)."""
    return {
        "input": absolute(input), "press": press, "compression_ratio": compression_ratio, "budget": budget,
        "head_budget": head_budget, "prefill": prefill, "press_params": press_params or {},
        "kv_bits": kv_bits, "kv_group_size": kv_group_size,
        "model": absolute(model), "db": absolute(db), "options": (options or BatchOptions()).model_dump(),
    }


def config_settings(config: RunConfig, input: str, db: str, options: Optional[BatchOptions] = None) -> dict:
    """``batch_parameters``' arguments for one configuration."""
    return dict(input=input, press=config.press, compression_ratio=config.compression_ratio, budget=config.budget,
                head_budget=config.head_budget, prefill=config.prefill, press_params=config.press_params,
                model=config.model, db=db, options=options, kv_bits=config.kv_bits,
                kv_group_size=config.kv_group_size)


def deployment(task: str, name: str, cron: Optional[str], params: dict, flow=None, extra: Optional[dict] = None):
    from prefect.deployments.runner import EntrypointType

    return (flow or FLOWS[task]).to_deployment(
        name=name,
        cron=cron,
        parameters={**batch_parameters(**params), **(extra or {})},
        # Import by module path: the package is installed, so a runner or worker finds it from any directory.
        entrypoint_type=EntrypointType.MODULE_PATH,
        description=f"Scheduled {task} batch with NestedKV KV-cache compression",
        tags=["nestedkv"],
    )


def serve_batch(task: str = "summarize", *, name: str = "nightly", cron: Optional[str] = "0 2 * * *",
                **params) -> None:
    """Serve ``summarize-batch/<name>`` (or ``qa-batch/<name>``) on a cron schedule until interrupted.

    One flow run at a time per serving process: each run loads the model and holds the DuckDB writer.
    """
    from prefect import serve

    check_server()
    serve(deployment(task, name, cron, params), limit=1)


def deploy_batch(task: str = "summarize", *, pool: str, name: str = "nightly", cron: Optional[str] = "0 2 * * *",
                 **params) -> str:
    """Register the deployment in a work pool (``prefect work-pool create <pool> --type process``) and return
    its id; workers started with ``prefect worker start --pool <pool> --limit 1`` (one per Mac, each with
    this package installed) run it. Each run writes to ``db`` on the machine that runs it."""
    from prefect import deploy

    check_server()
    # ignore_warnings: Prefect suggests .serve for process pools; a pool is the point here (one worker per Mac).
    (deployment_id,) = deploy(deployment(task, name, cron, params), work_pool_name=pool, build=False, push=False,
                              print_next_steps_message=False, ignore_warnings=True)
    return str(deployment_id)
