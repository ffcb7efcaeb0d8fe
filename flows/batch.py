"""The batch flows ``summarize-batch`` and ``qa-batch``: one Prefect task per document.

Work runs sequentially on the flow's thread: MLX and the single DuckDB writer are not thread-safe,
and one process holds one model. The pieces are pipeline.batch's (open_run, process_document), so the
flow and ``run_batch`` store identical rows.
"""


import pipeline  # noqa: F401  (loads OpenBLAS before mlx)

import inspect
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.context import TaskRunContext
from pydantic import BaseModel, ConfigDict, Field

from flows import artifacts
from pipeline.batch import BatchSummary, make_runner, open_run, process_document
from pipeline.config import DEFAULT_MODEL, QA_INSTRUCTION, SUMMARY_INSTRUCTION, HeadBudget, RunConfig, Task
from pipeline.documents import Document, load_documents
from pipeline.results import ERROR, OK, DocumentResult
from pipeline.store import Store

DEFAULT_INPUT = "data/sample_batch.parquet"
DEFAULT_DB = "runs.duckdb"

# Worth retrying: device memory, I/O and runtime failures. Anything else (a bug, bad data) would fail
# again the same way, so it becomes an error row at once.
TRANSIENT = (RuntimeError, MemoryError, OSError)


class BatchOptions(BaseModel):
    """Settings users rarely change between re-runs (the flat flow parameters are the ones they do)."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = Field(128, ge=1)
    prefill_step_size: int = Field(512, ge=1)
    truncate: bool = False
    summary_instruction: str = SUMMARY_INSTRUCTION
    qa_instruction: str = QA_INSTRUCTION
    repetition_penalty: Optional[float] = Field(None, gt=0)
    retries: int = Field(2, ge=0, description="task retries for transient errors (device memory, I/O)")
    retry_delay_s: float = Field(5.0, ge=0)

    def config_fields(self) -> dict:
        fields = {"max_new_tokens", "prefill_step_size", "truncate", "summary_instruction", "qa_instruction",
                  "repetition_penalty"}
        return self.model_dump(include=fields)


# -- in-process state: one model, one writer, one parsed input per worker process ----------------


@dataclass
class Hooks:
    """Callbacks for an in-process caller (the CLI's progress bars); flows served remotely have none."""

    on_start: Optional[Callable[[int], None]] = None  # number of documents to run
    on_document: Optional[Callable[[int, int, DocumentResult], None]] = None
    on_prefill: Optional[Callable[[int, int], None]] = None


_hooks = Hooks()
_runners: dict[str, object] = {}  # config hash -> Runner (the model itself is cached by pipeline.models)
_stores: dict[str, Store] = {}  # resolved db path -> the open writer of the flow running in this process
_documents: dict[str, dict[str, Document]] = {}  # input -> content sha256 -> Document
_lock = threading.Lock()


@contextmanager
def reporting(**callbacks) -> Iterator[None]:
    """``with reporting(on_document=..., on_prefill=...): summarize_batch(...)``."""
    global _hooks
    before, _hooks = _hooks, Hooks(**callbacks)
    try:
        yield
    finally:
        _hooks = before


def hooks() -> Hooks:
    return _hooks


def runner_for(config: RunConfig):
    key = config.config_hash()
    with _lock:
        if key not in _runners:
            _runners[key] = make_runner(config)
        return _runners[key]


def clear_runners() -> None:
    with _lock:
        _runners.clear()


@contextmanager
def open_store(db: str) -> Iterator[Store]:
    """The flow's writer, registered so its tasks (same process) write through it instead of a second one."""
    key = str(Path(db).resolve())
    with Store(db) as store:
        _stores[key] = store
        try:
            yield store
        finally:
            _stores.pop(key, None)


@contextmanager
def store_for(db: str) -> Iterator[Store]:
    store = _stores.get(str(Path(db).resolve()))
    if store is not None:
        yield store
    else:  # a task run on its own
        with Store(db) as own:
            yield own


def remember(input: str, docs: list[Document]) -> None:
    _documents.setdefault(input, {}).update({d.content_sha256: d for d in docs})


def forget(input: str) -> None:
    _documents.pop(input, None)


def document(input: str, content_sha256: str) -> Document:
    found = _documents.get(input, {}).get(content_sha256)
    if found is None:  # a task in a process that did not open the run: parse the input once here
        docs, _ = load_documents(input)
        remember(input, docs)
        found = _documents[input].get(content_sha256)
    if found is None:
        raise LookupError(f"{input}: no document with content sha256 {content_sha256[:12]}")
    return found


def last_attempt() -> bool:
    ctx = TaskRunContext.get()
    return ctx is None or ctx.task_run.run_count > (ctx.task.retries or 0)


class Watched:
    """The runner as pipeline code sees it, remembering the exception that pipeline code turns into
    an error row, so the task can still hand a transient one to Prefect's retries."""

    def __init__(self, runner):
        self._runner, self.error = runner, None

    def __getattr__(self, name):
        attr = getattr(self._runner, name)
        if not inspect.ismethod(attr):  # data, and the model (callable, but pipeline code needs the object)
            return attr

        def call(*args, **kwargs):
            try:
                return attr(*args, **kwargs)
            except Exception as exc:
                self.error = exc
                raise

        return call

    def retry_wanted(self) -> bool:
        return isinstance(self.error, TRANSIENT) and not last_attempt()


# -- tasks and flows ----------------------------------------------------------------------------


@task(name="document", task_run_name="{doc_id}", cache_policy=NO_CACHE, persist_result=False)
def run_document(input: str, doc_id: str, content_sha256: str, config_json: str, db: str, run_id: str) -> DocumentResult:
    """One document: run, store in one transaction. A transient failure is stored as an error row and
    raised for Prefect to retry (the retry's write replaces that row); on the last attempt it stays."""
    runner = Watched(runner_for(RunConfig.model_validate_json(config_json)))
    with store_for(db) as store:
        result = process_document(runner, store, run_id, document(input, content_sha256), _hooks.on_prefill)
    if runner.retry_wanted():
        raise runner.error
    return result


def error_result(doc: Document, message: str) -> DocumentResult:
    return DocumentResult(doc.doc_id, doc.content_sha256, doc.n_chars, doc.title, status=ERROR, error=message)


def run_tasks(store: Store, config: RunConfig, input: str, db: str, run_id: str, todo: list[Document],
              options: BatchOptions, progress: Optional[artifacts.ProgressReport] = None,
              on_document=None) -> list[DocumentResult]:
    """Each document as a task, in order; a task that still fails after its retries becomes an error row."""
    log = get_run_logger()
    one = run_document.with_options(retries=options.retries, retry_delay_seconds=options.retry_delay_s)
    cfg_json = config.canonical_json()
    results = []
    for i, doc in enumerate(todo, 1):
        state = one(input, doc.doc_id, doc.content_sha256, cfg_json, db, run_id, return_state=True)
        if state.is_completed():
            res = state.result()
        else:  # the store write itself failed (process_document catches the model's errors)
            res = error_result(doc, f"task {state.name}: {state.message}")
            try:
                store.write_document(run_id, res)
            except Exception as exc:
                log.error("document %s: could not record its failure: %s", doc.doc_id, exc)
        results.append(res)
        if res.status == OK:
            log.info("document %s (%d/%d): ok, %d tokens, prefill %.1fs", doc.doc_id, i, len(todo), res.n_tokens,
                     res.prefill_s)
        else:
            log.warning("document %s (%d/%d): %s: %s", doc.doc_id, i, len(todo), res.status, res.error)
        if progress:
            progress.update(i, f"{doc.doc_id}: {res.status}")
        if on_document:
            on_document(i, len(todo), res)
    return results


def _batch(task_name: Task, input: str, press: str, compression_ratio: float, budget: Optional[int],
           head_budget: HeadBudget, model: str, db: str, options: Optional[BatchOptions]) -> BatchSummary:
    options = options or BatchOptions()
    log = get_run_logger()
    flow_name = f"{task_name}-batch"
    config = RunConfig(task=task_name, model=model, press=press, compression_ratio=compression_ratio, budget=budget,
                       head_budget=head_budget, **options.config_fields())
    with open_store(db) as store:
        run_id, todo, skipped, errors = open_run(store, config, input)
        summary = BatchSummary(run_id, db, n_documents=len(todo) + skipped, n_skipped=skipped, input_errors=errors)
        log.info("run %s: %d documents to run, %d already done, %d bad rows", run_id, len(todo), skipped, len(errors))
        for err in errors:
            log.warning("skipped input row: %s", err)
        remember(input, todo)
        status = "failed"
        try:
            if todo:
                runner_for(config)  # load the model before the first task: an unloadable model fails the run once
            if _hooks.on_start:
                _hooks.on_start(len(todo))
            progress = artifacts.ProgressReport(artifacts.artifact_key(flow_name, "progress"), len(todo),
                                                f"{flow_name} {run_id}")
            summary.results = run_tasks(store, config, input, db, run_id, todo, options, progress,
                                        _hooks.on_document)
            summary.n_done = sum(r.status == OK for r in summary.results)
            summary.n_failed = len(summary.results) - summary.n_done
            status = "completed"
        finally:
            store.finish_run(run_id, status)
            forget(input)
        savings, layers = artifacts.publish_tables(store, flow_name, [run_id])
        artifacts.publish_report(flow_name, f"{flow_name} {run_id}", report_sections(config, input, db, summary,
                                                                                      savings, layers))
    return summary


def report_sections(config: RunConfig, input: str, db: str, summary: BatchSummary, savings, layers):
    failed = [r for r in summary.results if r.status != OK]
    counts = (f"- input: `{input}`\n- store: `{db}`, run `{summary.run_id}`\n"
              f"- press `{config.press}`, compression_ratio {config.compression_ratio}, budget {config.budget}, "
              f"head_budget {config.head_budget}, model `{config.model}`\n"
              f"- {summary.n_done} done, {summary.n_failed} failed, {summary.n_skipped} already done, "
              f"{len(summary.input_errors)} bad input rows")
    sections = [("Run", counts), ("Memory savings", artifacts.markdown_table(savings)),
                ("Per layer", artifacts.markdown_table(layers))]
    if failed or summary.input_errors:
        lines = [f"- `{r.doc_id}`: {r.status}: {r.error}" for r in failed]
        lines += [f"- input row {e.row} (`{e.doc_id}`): {e.field}: {e.message}" for e in summary.input_errors]
        sections.append(("Problems", "\n".join(lines)))
    return sections


@flow(name="summarize-batch", persist_result=False)
def summarize_batch(
    input: str = DEFAULT_INPUT,
    press: str = "nestedkv",
    compression_ratio: float = 0.75,
    budget: Optional[int] = None,
    head_budget: HeadBudget = "uniform",
    model: str = DEFAULT_MODEL,
    db: str = DEFAULT_DB,
    options: BatchOptions = BatchOptions(),
) -> BatchSummary:
    """Summarize every document of a Parquet batch with a compressed KV cache; store outputs and KV memory."""
    return _batch("summarize", input, press, compression_ratio, budget, head_budget, model, db, options)


@flow(name="qa-batch", persist_result=False)
def qa_batch(
    input: str = DEFAULT_INPUT,
    press: str = "nestedkv",
    compression_ratio: float = 0.75,
    budget: Optional[int] = None,
    head_budget: HeadBudget = "uniform",
    model: str = DEFAULT_MODEL,
    db: str = DEFAULT_DB,
    options: BatchOptions = BatchOptions(),
) -> BatchSummary:
    """Answer every question of every document of a Parquet batch from one compressed KV cache per document."""
    return _batch("qa", input, press, compression_ratio, budget, head_budget, model, db, options)


FLOWS = {"summarize": summarize_batch, "qa": qa_batch}
