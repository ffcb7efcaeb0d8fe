"""The ``budget-sweep`` flow: presses x ratios (x head-budget modes) from one prefill per document.

Each configuration, and the uncompressed ``no_press`` reference, is stored as its own run, so the
store's ``memory_savings`` and ``quality_vs_full`` views compare them directly. The work is
pipeline.sweep's (open_sweep, process_sweep_document, close_sweep); this module makes each document a
Prefect task with retries, and reports progress and savings as artifacts.
"""


import pipeline  # noqa: F401  (loads OpenBLAS before mlx)

import uuid
from typing import Optional

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from flows import artifacts
from flows.batch import (
    DEFAULT_DB,
    DEFAULT_INPUT,
    BatchOptions,
    Watched,
    document,
    forget,
    hooks,
    open_store,
    remember,
    runner_for,
    store_for,
)
from pipeline.config import DEFAULT_MODEL, HeadBudget, RunConfig, Task
from pipeline.results import OK
from pipeline.sweep import SweepPlan, SweepSummary, close_sweep, open_sweep, process_sweep_document, sweep_configs

FLOW_NAME = "budget-sweep"
_plans: dict[str, SweepPlan] = {}  # the open plans of sweeps running in this process


def configs_for(task: Task, model: str, presses: list[str], compression_ratios: list[float],
                head_budgets: list[str], budgets: Optional[list[int]], options: BatchOptions) -> list[RunConfig]:
    """The reference first, then each press x size; head-budget modes multiply nestedkv (pipeline.sweep)."""
    base = RunConfig(task=task, model=model, **options.config_fields())
    return sweep_configs(base, presses, compression_ratios, head_budgets, budgets or ())


@task(name="sweep-document", task_run_name="{doc_id}", cache_policy=NO_CACHE, persist_result=False)
def sweep_one(plan_id: str, doc_id: str, content_sha256: str, db: str) -> list[tuple[str, str]]:
    """One prefill of one document, then every configuration it still needs from a copy of that cache,
    each stored under its run. Returns (run press label, status) per stored result."""
    plan = _plans[plan_id]
    runner = Watched(runner_for(plan.reference))
    with store_for(db) as store:
        items = process_sweep_document(runner, store, plan, document(plan.input, content_sha256),
                                       on_prefill=hooks().on_prefill)
    if runner.retry_wanted():  # a transient failure was stored as error rows: let Prefect retry over them
        raise runner.error
    return [(_label(it.config), it.result.status) for it in items]


def _label(c: RunConfig) -> str:
    size = f"budget {c.budget}" if c.budget else f"r={c.compression_ratio}"
    return c.press if c.press == "no_press" else f"{c.press} {size} {c.head_budget}"


@flow(name=FLOW_NAME, persist_result=False)
def budget_sweep(
    input: str = DEFAULT_INPUT,
    presses: list[str] = ["nestedkv", "keydiff"],
    compression_ratios: list[float] = [0.5, 0.75, 0.9],
    head_budgets: list[HeadBudget] = ["uniform"],
    budgets: Optional[list[int]] = None,
    task: Task = "summarize",
    model: str = DEFAULT_MODEL,
    db: str = DEFAULT_DB,
    evaluate: bool = True,
    options: BatchOptions = BatchOptions(),
) -> SweepSummary:
    """Compare presses and budgets on the same documents: one prefill per document, one run per
    configuration plus the uncompressed reference. ``budgets`` (tokens per head) replace the ratios when
    given; ``evaluate`` also scores each configuration against the reference (``quality_vs_full``)."""
    log = get_run_logger()
    options = options or BatchOptions()
    configs = configs_for(task, model, presses, compression_ratios, head_budgets, budgets, options)
    with open_store(db) as store:
        plan = open_sweep(store, configs, input, evaluate=evaluate)
        summary = SweepSummary(str(db), [(c, plan.run_id(c)) for c in plan.configs if plan.run_id(c)],
                               n_documents=len(plan.docs), input_errors=plan.errors)
        docs = plan.todo_docs
        log.info("%d configurations + no_press over %d documents: %d need work, %d bad rows", len(plan.configs) - 1,
                 len(plan.docs), len(docs), len(plan.errors))
        for err in plan.errors:
            log.warning("skipped input row: %s", err)
        plan_id = uuid.uuid4().hex
        _plans[plan_id] = plan
        remember(plan.input, docs)
        status = "failed"
        try:
            if docs:
                runner_for(plan.reference)  # load the model once, before the first task
            h = hooks()
            if h.on_start:
                h.on_start(len(docs))
            progress = artifacts.ProgressReport(artifacts.artifact_key(FLOW_NAME, "progress"), len(docs),
                                                f"{FLOW_NAME} over {len(plan.configs)} configurations")
            one = sweep_one.with_options(retries=options.retries, retry_delay_seconds=options.retry_delay_s)
            for i, doc in enumerate(docs, 1):
                state = one(plan_id, doc.doc_id, doc.content_sha256, db, return_state=True)
                if state.is_completed():
                    stored = state.result()
                else:  # the store itself failed; pipeline code already turned model errors into rows
                    stored = [(_label(c), f"error: {state.message}") for c in plan.todo(doc)]
                    log.error("document %s: %s", doc.doc_id, state.message)
                bad = [s for s in stored if s[1] != OK]
                summary.n_swept += 1
                summary.n_results += len(stored)
                summary.n_failed += len(bad)
                note = f"{doc.doc_id}: {len(stored) - len(bad)}/{len(stored)} configurations ok"
                log.info("document %d/%d %s", i, len(docs), note + (f" (failed: {bad})" if bad else ""))
                progress.update(i, note)
                if h.on_document:
                    h.on_document(i, len(docs), doc, stored)
            status = "completed"
        finally:
            close_sweep(store, plan, status)
            _plans.pop(plan_id, None)
            forget(plan.input)
        savings, layers = artifacts.publish_tables(store, FLOW_NAME, summary_run_ids(summary))
        artifacts.publish_report(FLOW_NAME, f"{FLOW_NAME} over {input}", _report(summary, input, savings, layers))
    return summary


def summary_run_ids(summary: SweepSummary) -> list[str]:
    return [run_id for _, run_id in summary.runs]


def _report(summary: SweepSummary, input: str, savings, layers):
    runs = "\n".join(f"- `{run_id}`: {_label(c)}" for c, run_id in summary.runs) or "_all configurations were done_"
    head = (f"- input `{input}`, store `{summary.db}`\n- {summary.n_documents} documents, "
            f"{summary.n_swept} prefilled once each, {summary.n_results} results stored, "
            f"{summary.n_failed} failed, {len(summary.input_errors)} bad input rows")
    return [("Sweep", head), ("Runs", runs), ("Memory savings", artifacts.markdown_table(savings)),
            ("Per layer (last run)", artifacts.markdown_table(layers)),
            ("Compare", '`nkv query "SELECT * FROM quality_vs_full"` puts each run beside its no_press twin.')]
