"""What a batch still has to do: the documents, the configurations, what the store holds done under each
(resume), and the runs this batch writes."""

from __future__ import annotations

from typing import Optional, Sequence

from pipeline import models
from pipeline.config import EngineOptions, RunConfig
from pipeline.documents import Document, RowError, check_input, load_documents
from pipeline.spec import check_configs


class Plan:
    """The documents of one input, the configurations, what is done, and the runs this batch writes."""

    def __init__(self, input: str, configs: list[RunConfig], options: EngineOptions, docs: list[Document],
                 errors: list[RowError], done: dict, reference_runs: dict):
        self.input, self.options, self.docs, self.errors = input, options, docs, errors
        self.reference = configs[0].reference() if options.with_reference else None
        # Stored configurations; with a reference, it comes first (the others are scored against it).
        self.configs = check_configs(([self.reference] if self.reference else []) + list(configs))
        self.done = done  # config hash -> {(doc_id, content_sha256)} done under it
        self.reference_runs = reference_runs  # content sha256 -> a stored run holding its no_press answers
        self.run_ids: dict[str, str] = {}  # config hash -> run started by this batch

    def todo(self, doc: Document) -> list[RunConfig]:
        key = (doc.doc_id, doc.content_sha256)
        return [c for c in self.configs if key not in self.done.get(c.config_hash(), ())]

    @property
    def todo_docs(self) -> list[Document]:
        return [d for d in self.docs if self.todo(d)]

    def run_id(self, config: RunConfig) -> Optional[str]:
        return self.run_ids.get(config.config_hash())

    @property
    def runs(self) -> list[tuple[RunConfig, str]]:
        return [(c, self.run_id(c)) for c in self.configs if self.run_id(c)]

    def reference_run_id(self, doc: Document) -> Optional[str]:
        if self.reference is None:
            return None
        if self.reference in self.todo(doc):
            return self.run_id(self.reference)
        return self.reference_runs.get(doc.content_sha256)


def done_documents(store, config: RunConfig, evaluate: bool) -> set[tuple[str, str]]:
    """(doc_id, content sha256) answered ok under ``config``; when evaluating, only those whose evaluation
    rows exist too (a reference of documents without gold answers needs none)."""
    done = store.done_documents(config)
    if not evaluate or not done:
        return done
    rows = store.evaluated_documents(config)
    ok = {(r["doc_id"], r["content_sha256"]) for r in rows if r["scored"] or (config.is_reference and r["no_gold"])}
    return done & ok


def open_plan(store, input: str, configs: Sequence[RunConfig], options: EngineOptions = EngineOptions()) -> Plan:
    """Validate the input, find what is done, and start a run for each configuration with work left
    (bad input rows are recorded in each of those runs)."""
    configs = [models.keyed(c) for c in check_configs(configs)]
    check_input(input)
    docs, errors = load_documents(input)
    probe = Plan(str(input), configs, options, docs, errors, {}, {})
    done = {c.config_hash(): done_documents(store, c, options.evaluate) for c in probe.configs}
    refs = store.latest_ok_runs(probe.reference) if probe.reference else {}
    plan = Plan(str(input), configs, options, docs, errors, done, refs)
    for cfg in plan.configs:
        # An input whose every row is bad still gets its runs: that is where its bad rows are recorded.
        if any(cfg in plan.todo(d) for d in docs) or (errors and not docs):
            run_id = store.start_run(cfg, input)
            plan.run_ids[cfg.config_hash()] = run_id
            store.write_input_errors(run_id, errors)
    return plan


def close_plan(store, plan: Plan, status: str) -> None:
    for run_id in plan.run_ids.values():
        store.finish_run(run_id, status)
