"""A whole batch without an orchestrator: validate, resume, run each document, store each result.

The Prefect flows call the same pieces (``open_run``, ``process_document``) per task.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from pipeline.config import RunConfig
from pipeline.documents import Document, RowError, check_input, load_documents
from pipeline.results import ERROR, OK, DocumentResult
from pipeline.store import Store


@dataclass
class BatchSummary:
    run_id: str
    db: str
    n_documents: int = 0
    n_done: int = 0
    n_skipped: int = 0
    n_failed: int = 0
    input_errors: list[RowError] = field(default_factory=list)
    results: list[DocumentResult] = field(default_factory=list)


def open_run(store: Store, config: RunConfig, input: str):
    """Validate the input, start a run and record bad rows; returns (run_id, todo, skipped, errors)."""
    check_input(input)
    docs, errors = load_documents(input)
    run_id = store.start_run(config, input)
    store.write_input_errors(run_id, errors)
    done = store.done_content_hashes(config)
    todo = [d for d in docs if d.content_sha256 not in done]
    return run_id, todo, len(docs) - len(todo), errors


def process_document(runner, store: Store, run_id: str, doc: Document, on_prefill=None) -> DocumentResult:
    """Run one document and store it in one transaction; a failure becomes an error row."""
    try:
        result = runner.run(doc, on_prefill=on_prefill)
    except Exception as exc:  # never lose the batch to one document
        result = DocumentResult(doc.doc_id, doc.content_sha256, doc.n_chars, doc.title, status=ERROR,
                                error=f"{type(exc).__name__}: {exc}")
    store.write_document(run_id, result)
    return result


def make_runner(config: RunConfig):
    """Load the configured model (once per process) and wrap it for this configuration."""
    from pipeline.models import load_model, model_info
    from pipeline.runner import Runner

    model, tokenizer = load_model(config.model)
    return Runner(model, tokenizer, config, max_context=model_info(model).get("max_position_embeddings"))


def run_batch(
    input: str,
    config: RunConfig,
    db: str,
    *,
    on_document: Optional[Callable[[int, int, DocumentResult], None]] = None,
    on_prefill: Optional[Callable[[int, int], None]] = None,
) -> BatchSummary:
    with Store(db) as store:
        run_id, todo, skipped, errors = open_run(store, config, input)
        summary = BatchSummary(run_id, db, n_documents=len(todo) + skipped, n_skipped=skipped, input_errors=errors)
        status = "failed"
        try:
            runner = make_runner(config) if todo else None  # finished batches do no model work
            for i, doc in enumerate(todo):
                res = process_document(runner, store, run_id, doc, on_prefill)
                summary.results.append(res)
                if res.status == OK:
                    summary.n_done += 1
                else:
                    summary.n_failed += 1
                if on_document:
                    on_document(i + 1, len(todo), res)
            status = "completed"
        finally:
            store.finish_run(run_id, status)
    return summary
