"""The Prefect flows: ``summarize-batch`` and ``qa-batch`` (one configuration) and ``budget-sweep`` (many,
plus the no_press reference). All three are ``pipeline.engine`` with each document as a task.

What the flows add is orchestration only: a task per document with retries for transient errors, a
progress artifact, and tables and a report at the end. Work runs on the flow's thread: MLX and the single
DuckDB writer are not thread-safe, and one process holds one model. The tasks get the runner, the store
and the plan as arguments (``quote``d: Prefect neither serializes nor walks them).
"""


from typing import Optional

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.context import TaskRunContext
from prefect.states import Failed
from prefect.utilities.annotations import quote

from flows import artifacts
from pipeline import engine
from flows.params import ONE, SWEEP, hooks_parameter, keyword, spec_function
from pipeline.config import Task
from pipeline.documents import Document
from pipeline.engine import Hooks, Outcome, Summary
from pipeline.quality import compared
from pipeline.spec import BatchSpec
from pipeline.store import Store, StoreWriteError
from pipeline.store.errors import one_line

# Worth retrying: device memory, I/O and runtime failures. Anything else (a bug, bad data) would fail
# again the same way, so it stays an error row at once.
TRANSIENT = (RuntimeError, MemoryError, OSError)


def last_attempt() -> bool:
    ctx = TaskRunContext.get()
    return ctx is None or ctx.task_run.run_count > (ctx.task.retries or 0)


def should_retry(exc: BaseException) -> bool:
    return isinstance(exc, TRANSIENT) and not last_attempt()


@task(name="documents", task_run_name="{label}", cache_policy=NO_CACHE, persist_result=False)
def documents_task(runner, store: Store, plan: engine.Plan, label: str, docs: list[Document],
                   hooks: Hooks) -> list[list[Outcome]]:
    """Documents (one, or a group decoded together) under every configuration each still needs, each
    stored in one transaction. A transient failure is stored as error rows and raised for Prefect to
    retry; on the last attempt the rows stay. A failed write is returned, not raised: retrying the model
    work would not make the disk larger, and the batch stops on it (``engine.run_batch``)."""
    try:
        return engine.process_documents(runner, store, plan, docs, hooks=hooks, retry_if=should_retry)
    except StoreWriteError as exc:
        return exc


def run_flow(flow_name: str, spec: BatchSpec, hooks: Optional[Hooks]) -> Summary:
    """``spec`` through the engine, each document (or group decoded together) a task with retries."""
    log = get_run_logger()
    hooks = hooks or engine.NO_HOOKS
    options, input = spec.options, spec.input
    one = documents_task.with_options(retries=options.retries, retry_delay_seconds=options.retry_delay_s)
    with Store(spec.db, wait_s=options.wait) as store:
        plan = engine.open_plan(store, input, spec.configs(), spec.engine_options())
        todo = plan.todo_docs
        log.info("%d configurations over %d documents: %d need work, %d bad rows", len(plan.configs),
                 len(plan.docs), len(todo), len(plan.errors))
        for err in plan.errors:
            log.warning("skipped input row: %s", err)
        progress = artifacts.ProgressReport(artifacts.artifact_key(flow_name, "progress"), len(todo),
                                            f"{flow_name} over {len(plan.configs)} configurations")
        done = [0]

        def each(runner, docs: list[Document]) -> list[list[Outcome]]:
            label = docs[0].doc_id + (f" +{len(docs) - 1}" if len(docs) > 1 else "")
            state = one(quote(runner), quote(store), quote(plan), label, quote(docs), quote(hooks), return_state=True)
            if state.is_completed():
                per_doc = state.result()
                if isinstance(per_doc, StoreWriteError):
                    raise per_doc  # the batch stops and says so (Summary.problem)
            else:  # the store write itself failed: the engine already turned model errors into rows
                log.error("documents %s: %s", label, state.message)
                # Their rows are not (all) in the store: the batch stops as on any failed write, not counting
                # them done or failed (a run whose documents were not all stored is not completed).
                exc = state.result(raise_on_failure=False)
                why = (f"{type(exc).__name__}: {exc}" if isinstance(exc, BaseException) else str(state.message))
                stop = StoreWriteError(f"documents {label}: not stored ({one_line(why)})")
                stop.stored = []
                raise stop
            for doc, outcomes in zip(docs, per_doc):
                bad = [o.config.label() for o in outcomes if not o.result.all_ok]
                note = f"{doc.doc_id}: {len(outcomes) - len(bad)}/{len(outcomes)} configurations ok"
                done[0] += 1
                log.info("document %d/%d %s", done[0], len(todo), note + (f" (failed: {bad})" if bad else ""))
                progress.update(done[0], note)
            return per_doc

        summary = engine.run_batch(store, plan, hooks=hooks, each=each)
        layers = artifacts.layer_rows(store, summary.run_ids[-1]) if summary.run_ids else []
        quality = artifacts.quality_rows(store, summary) if spec.evaluate else []
    artifacts.publish_tables(flow_name, summary.savings, layers, summary.run_ids)
    artifacts.publish_report(flow_name, f"{flow_name} over {input}",
                             report_sections(input, summary, layers, quality))
    return final_state(summary)


class BatchNotStored(Exception):
    """What a flow run that stopped before storing every document ends with (its Failed state's data):
    the message is ``Summary.problem()``, one line; ``summary`` is what the batch did. Calling the flow in
    this process raises it, so the caller (``nkv run``) still reports the summary."""

    def __init__(self, summary: Summary):
        super().__init__(summary.problem())
        self.summary = summary


def final_state(summary: Summary):
    """The flow run's result: the summary (state Completed) when every document with work left was stored,
    ok or as an error row; otherwise state Failed with the one-line reason, as ``nkv run`` closes the runs
    (``failed``). A served or deployed run thus never reads Completed with documents missing from the store,
    and a fan-out retries such a shard. What was stored stays."""
    if summary.write_error is None and summary.n_not_stored == 0:
        return summary
    return Failed(message=summary.problem(), data=BatchNotStored(summary))


def report_sections(input: str, summary: Summary, layers: list[dict],
                    quality: list[dict] = ()) -> list[tuple[str, str]]:
    runs = "\n".join(f"- `{run_id}`: {c.label()}" for c, run_id in summary.runs) or "_all work was done before_"
    head = (f"- input `{input}`, store `{summary.db}`\n- {summary.n_documents} documents, {summary.n_processed} "
            f"prefilled, {summary.n_skipped} already done; {summary.n_ok} done, {summary.n_failed} failed; "
            f"{len(summary.input_errors)} bad input rows")
    sections = [("Batch", head), ("Runs", runs), ("Memory savings", artifacts.markdown_table(summary.savings)),
                ("Per layer (last run)", artifacts.markdown_table(layers))]
    if compared(quality):
        sections.append(("Quality against the uncompressed run", artifacts.markdown_table(quality) +
                         "\ndelta NLL: of the uncompressed answer or summary, lower is closer; source: the share of "
                         "the document's tenths a summary draws on, middle 30-70% and ends (docs/summaries.md)\n"))
    if summary.write_error:
        sections.append(("Stopped", summary.problem()))
    failed = [o for o in summary.outcomes if not o.result.all_ok]
    if failed or summary.input_errors:
        lines = [f"- `{o.result.doc_id}` ({o.config.label()}): {o.result.status}: {o.result.problems}" for o in failed]
        lines += [f"- input row {e.row} (`{e.doc_id}`): {e.field}: {e.message}" for e in summary.input_errors]
        sections.append(("Problems", "\n".join(lines)))
    return sections


def _batch_flow(task_name: Task, doc: str):
    """The ``<task>-batch`` flow: one press configuration over a batch (flat parameters are the ones users
    change on a re-run; the rest live in ``options``)."""

    def body(kwargs: dict, hooks: Optional[Hooks] = None) -> Summary:
        return run_flow(f"{task_name}-batch", ONE.spec(kwargs, task=task_name), hooks)

    fn = spec_function(f"{task_name}_batch", doc, ONE, body, after=(hooks_parameter(),))
    return flow(name=f"{task_name}-batch", persist_result=False)(fn)


summarize_batch = _batch_flow(
    "summarize", "Summarize every document of a Parquet batch with a compressed KV cache; store outputs and KV memory.")
qa_batch = _batch_flow(
    "qa", "Answer every question of every document of a Parquet batch from one compressed KV cache per document.")


def _sweep(kwargs: dict, task: Task = "summarize", hooks: Optional[Hooks] = None) -> Summary:
    return run_flow("budget-sweep", SWEEP.spec(kwargs, task=task), hooks)


budget_sweep = flow(name="budget-sweep", persist_result=False)(spec_function(
    "budget_sweep", """Compare presses and budgets on the same documents: one prefill per document, one run per
    configuration plus the uncompressed reference (unless ``reference`` and ``evaluate`` are off).
    ``budgets`` (tokens per head) replace the ratios when given; ``evaluate`` also scores each configuration
    against the reference (``quality_vs_full``).""", SWEEP, _sweep,
    after=(keyword("task", Task, "summarize"), hooks_parameter())))


def run_spec(spec: BatchSpec, hooks: Optional[Hooks] = None) -> Summary:
    """A spec through the flow that fits it: ``<task>-batch`` for one configuration of a plain batch, else
    ``budget-sweep``."""
    if spec.reference or spec.evaluate or len(spec.configs()) > 1:
        return budget_sweep(**SWEEP.arguments(spec), task=spec.task, hooks=hooks)
    return FLOWS[spec.task](**ONE.arguments(spec), hooks=hooks)


FLOWS = {"summarize": summarize_batch, "qa": qa_batch}
