"""The batch engine: documents x press configurations, one prefill per document, one transaction per document.

Every batch is this one loop. A run is one configuration; a sweep adds the uncompressed ``no_press``
reference as a run of its own; an evaluation also scores every configuration against that reference;
an ablation is an evaluation over press variants. Per document: tokenize once, prefill once (each
streaming configuration prefills on its own, since it evicts while prefilling), compress a copy of the
prefilled cache per configuration, answer (batched across configurations when asked), and write every
configuration's rows in one transaction. Re-running resumes: a (configuration, document) done before is
skipped, and a batch with nothing left loads no model.

The Prefect flows (``flows/``) call exactly this: ``open_plan``, then ``run_batch`` with each document
wrapped in a task; plain Python calls ``run``.

Modules: ``plan`` (what is left to do, resume, the runs), ``document`` (one document's configurations, and
its rows written); here, the batch loop. Every name is importable from ``pipeline.engine``, and the loop
calls ``process_documents`` and ``run`` through this module (callers and tests may replace them here).
"""

from __future__ import annotations

import logging
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import mlx.core as mx
from mlx_lm.utils import maybe_set_recommended_wired_limit

from pipeline import models
from pipeline.config import EngineOptions, RunConfig
from pipeline.runner.memory_plan import default_limit
from pipeline.sizes import parse_size
from pipeline.documents import Document, RowError
from pipeline.engine.document import (NO_HOOKS, Hooks, Outcome, Work, compute, error_result, finish,  # noqa: F401
                                      is_out_of_memory, prefill_full, process_document, process_documents)
from pipeline.engine.plan import Plan, close_plan, done_documents, open_plan  # noqa: F401
from pipeline.models.shape import model_info
from pipeline.results import ERROR, OK
from pipeline.runner import Runner
from pipeline.spec import BatchSpec, check_configs, make_configs
from pipeline.store import Store, StoreError, StoreWriteError

log = logging.getLogger(__name__)


@dataclass
class Summary:
    db: str
    runs: list[tuple[RunConfig, str]] = field(default_factory=list)  # runs started by this batch
    n_documents: int = 0  # valid documents in the input
    n_processed: int = 0  # documents that had work left
    n_results: int = 0  # (document, configuration) results stored
    n_failed: int = 0  # of those, not ok
    n_todo: int = 0  # documents that had work left when the batch started
    write_error: Optional[str] = None  # the write that stopped the batch (the documents after it were not run)
    input_errors: list[RowError] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)
    savings: list[dict] = field(default_factory=list)  # memory_savings rows of this batch's runs
    wall_s: float = 0.0

    @property
    def run_ids(self) -> list[str]:
        return [run_id for _, run_id in self.runs]

    @property
    def n_skipped(self) -> int:
        return self.n_documents - self.n_processed

    @property
    def n_ok(self) -> int:
        return self.n_results - self.n_failed

    @property
    def n_not_stored(self) -> int:
        """Documents with work left that have no rows from this batch (a write failed)."""
        return self.n_todo - self.n_processed

    @property
    def all_done(self) -> bool:
        """Every valid document is done (now or before) and there was at least one: what exit code 0 means."""
        return (self.write_error is None and self.n_failed == 0 and self.n_not_stored == 0
                and self.n_documents > 0)

    def problem(self) -> Optional[str]:
        """Why the batch did not do everything, in one line (None when it did)."""
        if self.write_error:
            return (f"{self.write_error}; the batch stopped: {self.n_processed} of {self.n_todo} documents "
                    f"stored (kept), {self.n_not_stored} not stored")
        if self.n_documents == 0:
            return "no valid document in the input: nothing was done"
        if self.n_failed:
            return f"{self.n_failed} of {self.n_results} results did not end ok (their rows say why)"
        return None


SAVINGS_COLUMNS = ("run_id", "press", "compression_ratio", "head_budget", "budget", "prefill", "kv_bits", "n_documents",
                   "kept_share", "saved_share", "resident_share", "saved_mib", "memory_plans", "planned_peak_mib",
                   "peak_mib")


def make_runner(config: RunConfig):
    """Load the configured model (cached per process) and wrap it for this configuration."""
    model, tokenizer = models.load_model(config.model, dtype=config.dtype)  # through the module: tests replace it
    return Runner(model, tokenizer, config, max_context=model_info(model).get("max_position_embeddings"))


def plan_memory(runner, plan: Plan) -> None:
    """Give the runner the memory limit the batch reads its documents within (``--memory-limit``, else a share of
    what is available now) and every press it runs on a document."""
    shape = runner.memory_shape()
    given = plan.options.memory_limit
    runner.memory_limit = parse_size(given) if given else default_limit(shape)
    runner.presses = [c.make_press() for c in plan.configs]


@contextmanager
def wired(model):
    """On Metal, the recommended wired limit while the batch runs, as mlx-lm's generate sets it (a no-op
    elsewhere)."""
    old = maybe_set_recommended_wired_limit() if mx.metal.is_available() else None
    try:
        yield
    finally:
        if old is not None:
            mx.synchronize()
            mx.set_wired_limit(old)


def run_batch(store, plan: Plan, *, hooks: Hooks = NO_HOOKS, runner=None,
              each: Optional[Callable[[Any, list[Document]], list[list[Outcome]]]] = None) -> Summary:
    """The batch loop: every document with work left, in input order and in groups of the options'
    ``batch_size`` (decoded together), then the runs are closed. ``each(runner, docs)`` replaces
    ``process_documents`` (the flows wrap it in a task); the model is loaded only when some document has
    work left."""
    t0 = time.perf_counter()
    docs = plan.todo_docs
    summary = Summary(str(store.path), plan.runs, n_documents=len(plan.docs), n_todo=len(docs),
                      input_errors=plan.errors)
    if hooks.on_start:
        hooks.on_start(plan)
    status = "failed"

    def count(first: int, group, per_doc) -> None:
        for j, (doc, outcomes) in enumerate(zip(group, per_doc), first):
            summary.n_processed += 1
            summary.n_results += len(outcomes)
            summary.n_failed += sum(not o.result.all_ok for o in outcomes)
            summary.outcomes.extend(outcomes)
            if hooks.on_document:
                hooks.on_document(j, len(docs), doc, outcomes)

    held = ExitStack()
    try:
        if docs and runner is None:
            runner = make_runner(plan.configs[0])
        if docs:
            plan_memory(runner, plan)
            held.enter_context(wired(runner.model))
        size = plan.options.batch_size
        for g in range(0, len(docs), size):
            group = docs[g : g + size]
            try:
                per_doc = each(runner, group) if each else process_documents(runner, store, plan, group, hooks=hooks)
            except StoreWriteError as exc:
                count(g + 1, group, getattr(exc, "stored", []))
                summary.write_error = str(exc)
                break
            count(g + 1, group, per_doc)
            mx.clear_cache()  # the next documents' buffers come from memory, not from what these kept cached
        else:
            status = "completed"
    finally:
        held.close()
        try:
            close_plan(store, plan, status)
        except StoreError as exc:
            if status == "completed":
                raise
            # the store that failed a write may refuse this one too: the next writer marks the runs interrupted
            log.warning("could not close the runs as %s (%s)", status, exc)
    if summary.write_error is None:
        summary.savings = store.memory_savings(summary.run_ids, SAVINGS_COLUMNS)
    summary.wall_s = time.perf_counter() - t0
    return summary


def run(input: str, configs: Sequence[RunConfig], db: str, options: EngineOptions = EngineOptions(), *,
        hooks: Hooks = NO_HOOKS, runner=None, wait_s: float = 0.0) -> Summary:
    """A whole batch without an orchestrator: plan, every document, close, with resume. ``wait_s``: how
    long to wait for another writer to release the store."""
    with Store(db, wait_s=wait_s) as store:
        plan = open_plan(store, input, configs, options)
        return run_batch(store, plan, hooks=hooks, runner=runner)


def run_spec(spec: BatchSpec, *, hooks: Hooks = NO_HOOKS, runner=None) -> Summary:
    """``run`` for a batch spec: its input, configurations, store and engine options."""
    return run(spec.input, spec.configs(), spec.db, spec.engine_options(), hooks=hooks, runner=runner,
               wait_s=spec.options.wait)


__all__ = ["ERROR", "OK", "EngineOptions", "Hooks", "Outcome", "Plan", "Summary", "check_configs", "close_plan",
           "compute", "make_configs", "make_runner", "open_plan", "process_document", "process_documents", "run",
           "run_batch", "run_spec"]
