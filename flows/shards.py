"""Fan-out: one batch split into shards, one flow run per shard on a process work pool, one lake store.

``nkv run --pool POOL --shards N`` (or ``--shard-size K``) writes each shard's documents as a Parquet
file beside the lake's data (``<data path>/shards/<batch key>/``), registers the batch deployment in the
pool, and submits one flow run per shard with ``run_deployment`` and an idempotency key per shard and
attempt. Workers (``prefect worker start --pool POOL --limit 1``, one per machine) pick them up; every flow
run writes its documents into the same DuckLake, one transaction each. No coordinator of ours: Prefect
queues and hands out the shards, DuckLake orders the commits.

Re-submitting the same batch (same input, settings and shard count) asks for the same keys: a shard whose
flow run completed is not run again, a running one is waited for, a failed, crashed or cancelled one (or
one whose process is gone: see ``stale``) gets a new attempt, and within a shard the store's resume skips
the documents already done, so nothing is written twice.

Why a loop of ours and not the flow's own ``retries``: Prefect retries a flow run that fails in its own
process, not one that crashed or whose worker died (PrefectHQ/prefect#10211, open), and a process worker
that goes down leaves its run "Running" (#16746): those are the cases this loop exists for. A shard's flow
run still retries in place what fails inside it (``BatchOptions.retries``, the flow's task retries).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import socket
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Callable, Optional
from uuid import UUID

import pyarrow as pa
import pyarrow.parquet as pq
from prefect import get_client
from prefect.deployments import run_deployment
from prefect.events.filters import EventAnyResourceFilter, EventFilter, EventNameFilter, EventOccurredFilter
from prefect.settings import get_current_settings
from prefect.states import Crashed

from flows.deploy import batch_parameters, check_server, deploy_batch
from pipeline import models
from pipeline.config import RunConfig
from pipeline.documents import Document, RowError, load_documents
from pipeline.spec import BatchSpec
from pipeline.store import Store, lake, process_is_the_run

DEPLOYMENT = "shards"  # <flow>/shards: the deployment the shards are submitted to
MAX_ATTEMPTS = 20  # attempts per shard over all re-submissions (each a new idempotency key)
POLL_S = 2.0
HEARTBEAT_MISSES = 3  # a running flow run with no heartbeat for this many heartbeat periods is gone
SHARD_SCHEMA = pa.schema([("doc_id", pa.string()), ("text", pa.string()), ("title", pa.string()),
                          ("questions", pa.list_(pa.string())), ("answers", pa.list_(pa.string()))])


class ShardError(RuntimeError):
    """A fan-out problem a user can act on; one line."""


@dataclass
class Shard:
    index: int
    count: int
    path: Path
    docs: list[Document]
    key: str  # idempotency key prefix: batch key + shard
    attempt: int = 0
    flow_run_id: Optional[str] = None
    state: str = "PENDING"
    skipped: bool = False  # completed before this submission
    done: int = 0  # documents stored ok under the configuration

    @property
    def label(self) -> str:
        return f"shard {self.index + 1}/{self.count}"

    def idempotency_key(self) -> str:
        return f"{self.key}-a{self.attempt}"

    def status(self) -> str:
        """For progress lines: "done before", or the flow run's state and, after a retry, the attempt."""
        if self.skipped:
            return "done before"
        return self.state.lower() + (f", attempt {self.attempt}" if self.attempt else "")


@dataclass
class FanOut:
    """What the parent prints at the end: the shards, the runs they wrote, and the store's totals."""

    shards: list[Shard]
    input_errors: list[RowError]
    run_ids: list[str] = field(default_factory=list)
    savings: list[dict] = field(default_factory=list)
    n_documents: int = 0
    n_ok: int = 0
    n_failed: int = 0
    wall_s: float = 0.0

    def summary(self) -> str:
        before = sum(s.skipped for s in self.shards)
        return (f"{len(self.shards)} shards ({before} done before), {len(self.run_ids)} runs, {self.n_ok} of "
                f"{self.n_documents} documents done, {self.n_failed} failed, {len(self.input_errors)} bad rows, "
                f"{self.wall_s:.0f} s")


def shard_counts(n_docs: int, shards: Optional[int], shard_size: Optional[int]) -> list[int]:
    """Documents per shard, contiguous and as even as possible; exactly one of ``shards``/``shard_size``."""
    if (shards is None) == (shard_size is None):
        raise ShardError("give --shards N or --shard-size K (one of them)")
    for flag, value in (("--shards", shards), ("--shard-size", shard_size)):
        if value is not None and value < 1:
            raise ShardError(f"{flag} must be at least 1, got {value}")
    if n_docs == 0:
        return []
    n = min(shards, n_docs) if shards is not None else -(-n_docs // shard_size)
    base, extra = divmod(n_docs, n)
    return [base + (i < extra) for i in range(n)]


def batch_key(config: RunConfig, docs: list[Document], counts: list[int], deployment: str) -> str:
    """Same documents, settings, split and deployment -> same key: a re-submission finds its shards."""
    h = hashlib.sha256()
    h.update(json.dumps([config.config_hash(), deployment, counts]).encode())
    for d in docs:
        h.update(f"{d.doc_id}\0{d.content_sha256}\0".encode())
    return h.hexdigest()[:16]


def require_lake(db: str) -> None:
    if not lake.is_lake(db):
        raise ShardError(f"--pool needs a lake store (--db ducklake:sqlite:PATH or ducklake:postgres:CONNINFO "
                         f"with --data-path): {db} is a DuckDB file, which takes one writer")


def shard_folder(db: str, data_path: Optional[str]) -> Path:
    """Shards live beside the lake's Parquet data, on the path every worker already reads."""
    require_lake(db)
    if data_path is None:
        with Store(db) as store:  # creates nothing new: the lake must know its data path
            data_path = store.data_path()
    if not data_path or "://" in data_path:
        raise ShardError(f"shard files need a shared folder every worker reads; the lake's data path is "
                         f"{data_path!r}: give --data-path on a shared volume")
    return Path(data_path).expanduser().resolve() / "shards"


def write_shards(input: str, config: RunConfig, folder: Path, deployment: str, shards: Optional[int] = None,
                 shard_size: Optional[int] = None) -> tuple[list[Shard], list[RowError]]:
    """Validate the input once, split its documents, and write each shard as Parquet (once: the files are
    named by the batch key, so a re-submission reuses them)."""
    docs, errors = load_documents(input)
    counts = shard_counts(len(docs), shards, shard_size)
    key = batch_key(config, docs, counts, deployment)
    out, start = [], 0
    for i, n in enumerate(counts):
        part = docs[start:start + n]
        start += n
        path = folder / key / f"shard-{i + 1:03d}-of-{len(counts):03d}.parquet"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            table = pa.Table.from_pylist([{c: getattr(d, c) for c in SHARD_SCHEMA.names} for d in part],
                                         schema=SHARD_SCHEMA)
            tmp = path.with_suffix(".tmp")
            pq.write_table(table, tmp)
            tmp.replace(path)  # whole or absent: a worker never reads half a shard
        out.append(Shard(i, len(counts), path, part, f"nkv-{key}-s{i + 1}of{len(counts)}"))
    return out, errors


def record_input_errors(db: str, config: RunConfig, input: str, errors: list[RowError]) -> Optional[str]:
    """The batch's bad rows, in a run of their own over the original input (the shards hold only valid
    documents), as a single-machine run records them; once per batch, not on every re-submission."""
    if not errors:
        return None
    with Store(db) as store:
        if store.input_error_count(config, input) >= len(errors):
            return None
        run_id = store.start_run(config, str(input))
        store.write_input_errors(run_id, errors)
        store.finish_run(run_id, "completed")
    return run_id


# -- Prefect ------------------------------------------------------------------------------------------
def _state(flow_run) -> str:
    return flow_run.state.type.value if flow_run.state else "PENDING"


FINAL_BAD = {"FAILED", "CRASHED", "CANCELLED"}


def last_heartbeat(client, flow_run) -> Optional[datetime]:
    """The newest heartbeat event of a flow run (Prefect sends one every PREFECT_FLOWS_HEARTBEAT_FREQUENCY
    seconds while it runs), or None."""
    since = (flow_run.start_time or datetime.now(timezone.utc)) - timedelta(minutes=1)
    try:
        page = client.read_events(EventFilter(
            event=EventNameFilter(name=["prefect.flow-run.heartbeat"]),
            any_resource=EventAnyResourceFilter(id=[f"prefect.flow-run.{flow_run.id}"]),
            occurred=EventOccurredFilter(since=since), order="DESC"), limit=1)
    except Exception:  # an API without events: no heartbeat known, so nothing is judged gone by it
        return None
    return page.events[0].occurred if page.events else None


def stale(client, flow_run, store: Optional[Store], shard: Shard, stale_after_s: float) -> Optional[str]:
    """Why a RUNNING flow run is gone (its process died with its machine or worker), or None.

    On this host the store tells at once: the run the shard started records its pid. Elsewhere, a flow
    run whose heartbeats stopped ``stale_after_s`` ago is taken as gone (one that never sent any is not:
    heartbeats may be off).
    """
    if store is not None and flow_run.start_time is not None:
        # Only runs this flow run started: an earlier attempt's dead run may still read 'running'. Another
        # writer on this host may already have marked ours 'interrupted' (its process was gone).
        since = (flow_run.start_time - timedelta(seconds=5)).astimezone(timezone.utc).replace(tzinfo=None)
        rows = store.runs_of_input(shard.path, since)
        if any(r["status"] == "interrupted" for r in rows):
            return "its run was marked interrupted (its process is gone)"
        here = [r for r in rows if r["status"] == "running" and r["host"] == socket.gethostname()]
        if here and not any(process_is_the_run(r["pid"], r["pid_started_at"]) for r in here):
            return f"its process (pid {here[-1]['pid']} on this host) is gone"
    beat = last_heartbeat(client, flow_run)
    if beat is not None and (datetime.now(timezone.utc) - beat).total_seconds() > stale_after_s:
        return f"no heartbeat for {stale_after_s:.0f} s"
    return None


def submit(client, shard: Shard, deployment: str, parameters: dict, log: Callable[[str], None]) -> None:
    """Find or create the shard's flow run: completed -> skipped; failed/crashed/cancelled -> next attempt."""
    while shard.attempt < MAX_ATTEMPTS:
        fr = run_deployment(deployment, parameters={**parameters, "input": str(shard.path)}, timeout=0,
                            idempotency_key=shard.idempotency_key(), as_subflow=False,
                            flow_run_name=f"{shard.key}-a{shard.attempt}", client=client)
        shard.flow_run_id, shard.state = str(fr.id), _state(fr)
        if shard.state == "COMPLETED":  # a new flow run is never born completed: this key ran before
            shard.skipped = True
            return
        if shard.state not in FINAL_BAD:
            return
        log(f"{shard.label}: attempt {shard.attempt} ended {shard.state}; submitting attempt {shard.attempt + 1}")
        shard.attempt += 1
    raise ShardError(f"{shard.label}: {MAX_ATTEMPTS} attempts used; see `prefect flow-run ls`")


def abandon(client, shard: Shard, why: str) -> None:
    """Mark a flow run whose process is gone as crashed, so its key is never waited on again."""
    client.set_flow_run_state(UUID(shard.flow_run_id), Crashed(message=f"nkv: {why}"), force=True)


def fan_out(spec: BatchSpec, pool: str, *, shards: Optional[int] = None,
            shard_size: Optional[int] = None, data_path: Optional[str] = None, name: str = DEPLOYMENT,
            retries: int = 1, stale_after_s: Optional[float] = None,
            on_progress: Optional[Callable[[list[Shard]], None]] = None,
            log: Callable[[str], None] = print) -> FanOut:
    """Split the spec's input into shards, submit one flow run per shard to ``<flow>/<name>`` in ``pool``
    (each the spec with the shard as its input), wait for all of them, and read the merged totals from the
    store. The spec has one configuration. ``retries``: new attempts for
    a shard whose flow run fails or crashes while we wait. ``stale_after_s``: a running flow run without a heartbeat for this long is taken as gone (default:
    3 heartbeat periods).
    """
    # The workers key their runs by the model as they load it (revision, dtype, device): so does the progress
    # read here, for workers on a device like this one (a fleet of mixed devices resumes per device).
    input, db, config = spec.input, spec.db, models.keyed(spec.config())
    start = time.monotonic()
    check_server()
    folder = shard_folder(db, data_path)
    flow_name = f"{config.task}-batch"
    deployment = f"{flow_name}/{name}"
    shard_list, errors = write_shards(input, config, folder, deployment, shards, shard_size)
    record_input_errors(db, config, input, errors)
    if not shard_list:
        raise ShardError(f"{input}: no valid documents to run")
    with contextlib.redirect_stdout(io.StringIO()):  # Prefect prints a table of deployments
        deploy_batch(spec, pool=pool, name=name, cron=None)
    parameters = batch_parameters(spec)
    beat = get_current_settings().flows.heartbeat_frequency or 180
    stale_after_s = stale_after_s if stale_after_s is not None else HEARTBEAT_MISSES * beat
    keys = {(d.doc_id, d.content_sha256) for s in shard_list for d in s.docs}
    with get_client(sync_client=True) as client, Store(db, read_only=True) as store:
        for s in shard_list:
            submit(client, s, deployment, parameters, log)
        left = {s.index: retries for s in shard_list}
        while True:
            done = store.done_documents(config) & keys
            for s in shard_list:
                s.done = sum((d.doc_id, d.content_sha256) in done for d in s.docs)
                if s.skipped or s.state == "COMPLETED":
                    continue
                fr = client.read_flow_run(UUID(s.flow_run_id))
                s.state = _state(fr)
                why = stale(client, fr, store, s, stale_after_s) if s.state == "RUNNING" else None
                if why:
                    log(f"{s.label}: flow run {s.flow_run_id} {why}; marking it crashed")
                    abandon(client, s, why)
                    s.state = "CRASHED"
                if s.state in FINAL_BAD:
                    if left[s.index] <= 0:
                        continue
                    left[s.index] -= 1
                    s.attempt += 1
                    log(f"{s.label}: {s.state}; submitting attempt {s.attempt}")
                    submit(client, s, deployment, parameters, log)
            if on_progress:
                on_progress(shard_list)
            if all(s.skipped or s.state == "COMPLETED" or (s.state in FINAL_BAD and left[s.index] <= 0)
                   for s in shard_list):
                break
            time.sleep(POLL_S)
        result = FanOut(shard_list, errors)
        merge_summary(store, config, shard_list, result)
    result.wall_s = time.monotonic() - start
    bad = [s.label for s in shard_list if s.state in FINAL_BAD]
    if bad:
        log(f"{len(bad)} shards did not complete: {', '.join(bad)}; re-submit the same command to resume them")
    return result


def merge_summary(store: Store, config: RunConfig, shard_list: list[Shard], out: FanOut) -> None:
    """The batch's totals, read from the store: every run any attempt of any shard wrote."""
    out.run_ids = store.run_ids(config, [str(s.path) for s in shard_list])
    docs = [(d.doc_id, d.content_sha256) for s in shard_list for d in s.docs]
    answered, out.n_ok = store.document_outcomes(config, docs)
    out.n_documents, out.n_failed = len(docs), answered - out.n_ok
    out.savings = store.memory_savings(out.run_ids)
