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
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Sequence

from pipeline.config import EngineOptions, RunConfig
from pipeline.documents import Document, RowError, check_input, load_documents
from pipeline.results import ERROR, OK, DocumentResult
from pipeline.spec import BatchSpec, check_configs, make_configs
from pipeline.store import StoreError, StoreWriteError

log = logging.getLogger(__name__)
Progress = Callable[[int, int], None]


@dataclass
class Hooks:
    """Progress callbacks for an in-process caller (the CLI's bars); any may be None."""

    on_start: Optional[Callable[["Plan"], None]] = None
    on_prefill: Optional[Progress] = None  # (tokens done, tokens in the context)
    on_config: Optional[Callable[[int, int, RunConfig, DocumentResult], None]] = None
    on_document: Optional[Callable[[int, int, Document, list["Outcome"]], None]] = None


NO_HOOKS = Hooks()


@dataclass
class Outcome:
    """One configuration's result on one document, and its per-question scores when evaluating."""

    config: RunConfig
    result: DocumentResult
    scores: Optional[list[dict]] = None


# -- what a batch still has to do ---------------------------------------------------------------------
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
    configs = check_configs(configs)
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


# -- one document --------------------------------------------------------------------------------------
def error_result(doc: Document, exc: BaseException) -> DocumentResult:
    return DocumentResult(doc.doc_id, doc.content_sha256, doc.n_chars, doc.title).fail(exc)


class Work:
    """One document's configurations on their way: prefilled and compressed by ``start``, the ones to
    decode together waiting in ``together`` until ``finish`` answers them (with other documents' ones)."""

    def __init__(self, runner, doc: Document, todo: list[RunConfig], reference: Optional[RunConfig],
                 options: EngineOptions, hooks: Hooks):
        self.runner, self.doc, self.todo, self.reference, self.options, self.hooks = \
            runner, doc, todo, reference, options, hooks
        self.evaluate = options.evaluate and reference is not None
        self.batch = options.batch_decode or options.batch_size > 1
        self.results: dict[RunConfig, Optional[DocumentResult]] = {cfg: None for cfg in todo}
        self.scores: dict[RunConfig, list[dict]] = {}
        self.extra: dict[RunConfig, list[dict]] = {}
        self.together: dict[RunConfig, list] = {}
        self.ref = None  # pipeline.evaluate.Reference, once the reference answered
        self.prepared = None
        self._reported = 0

    def report(self, cfg: RunConfig) -> None:
        self._reported += 1
        if self.hooks.on_config:
            self.hooks.on_config(self._reported, len(self.todo), cfg, self.results[cfg])

    def outcomes(self) -> list[Outcome]:
        for cfg, more in self.extra.items():
            self.scores[cfg] = _merge(self.scores.get(cfg), more)
        return [Outcome(cfg, self.results[cfg], self.scores.get(cfg)) for cfg in self.todo]

    def answer(self, cfg: RunConfig, cache, res: DocumentResult, full) -> None:
        """Compress ``cache`` and answer from it now, or leave it in ``together`` for ``finish``."""
        from pipeline.evaluate import METRIC_HOOKS, Reference

        runner = self.runner
        if full is not None:
            for name in self.options.metrics:
                self.extra[cfg] = _merge(self.extra.get(cfg), METRIC_HOOKS[name](runner, self.prepared, full,
                                                                                 cache[0].press))
        runner.compress(cache, res)
        if self.batch and not cfg.is_reference:
            self.together[cfg] = cache
            return
        runner.answer_all(cache, self.prepared, res)
        if self.evaluate and cfg == self.reference:
            self.ref = Reference.build(runner, self.prepared, res, cache)
            self.scores[cfg] = self.ref.own_scores(res)
        elif self.evaluate:
            if self.ref is None:
                raise RuntimeError("the no_press reference failed: nothing to score this configuration against")
            self.scores[cfg] = self.ref.score(runner, self.prepared, res, cache)
        self.report(cfg)

    def start(self) -> "Work":
        """Tokenize, prefill (once for the whole-context configurations), compress each configuration."""
        import mlx.core as mx

        import nestedkv

        runner, options, hooks, todo = self.runner, self.options, self.hooks, self.todo
        shell, self.prepared = runner.start(self.doc)
        if self.prepared is None:  # the document cannot run (no questions, too long): every configuration says so
            for cfg in todo:
                self.results[cfg] = copy.deepcopy(shell)
                self.report(cfg)
            return self
        whole = [c for c in todo if c.prefill == "whole"]
        streaming = {c: c.make_press() for c in todo if c.prefill != "whole"}
        fallback = None
        if whole:
            base = copy.deepcopy(shell)
            try:
                full = prefill_full(runner, self.prepared, base, options, hooks)
            except Exception as exc:
                if options.on_oom != "streaming" or not is_out_of_memory(exc):
                    raise
                # The whole context does not fit: evict while prefilling instead, for every compressing configuration.
                fallback = f"whole-context prefill ran out of memory ({type(exc).__name__}: {exc}); prefilled streaming"
                streaming = {**{c: replace(c.make_press(), prefill="streaming") for c in whole if not c.is_reference},
                             **streaming}
                for cfg in (c for c in whole if c.is_reference):
                    self.results[cfg] = copy.deepcopy(shell).fail(exc)
                    self.report(cfg)
                full, whole = None, []
            for cfg in whole:
                self.results[cfg] = res = copy.deepcopy(base)
                try:
                    mx.reset_peak_memory()  # this configuration's compress peak, not the previous one's decode
                    self.answer(cfg, nestedkv.clone(full, cfg.make_press(), model=runner.model), res, full)
                except Exception as exc:
                    res.fail(exc)
                    self.report(cfg)
            del full
        for cfg, press in streaming.items():
            self.results[cfg] = res = copy.deepcopy(shell)
            try:
                cache = runner.prefill(self.prepared, res, press=press, on_prefill=hooks.on_prefill)
                if fallback and cfg.prefill == "whole":
                    res.error = fallback if res.error is None else f"{res.error}; {fallback}"
                self.answer(cfg, cache, res, None)
            except Exception as exc:
                res.fail(exc)
                self.report(cfg)
        return self


def finish(runner, works: list[Work]) -> list[list[Outcome]]:
    """Answer every configuration left in ``together``, of all ``works`` at once, then their outcomes."""
    from pipeline.runner import Entry

    entries = [Entry((i, cfg), cache, w.prepared, w.results[cfg], w.ref if w.evaluate else None)
               for i, w in enumerate(works) for cfg, cache in w.together.items()]
    if entries:
        try:
            for (i, cfg), got in runner.answer_entries(entries).items():
                works[i].scores[cfg] = got
        except Exception as exc:  # the batch failed as a whole: every configuration in it says so
            for e in entries:
                e.result.fail(exc)
        for w in works:
            for cfg in w.together:
                w.report(cfg)
            w.together.clear()  # the compressed caches are no longer needed
    return [w.outcomes() for w in works]


def compute(runner, doc: Document, configs: Sequence[RunConfig], *, reference: Optional[RunConfig] = None,
            options: EngineOptions = EngineOptions(), hooks: Hooks = NO_HOOKS) -> list[Outcome]:
    """Run ``doc`` under every configuration (no store). ``reference`` (scored against when
    ``options.evaluate``) runs first, whether or not it is in ``configs``; outcomes follow that order.
    A configuration that raises becomes an error result; the others still run."""
    todo = check_configs(([reference] if reference is not None else []) + list(configs))
    return finish(runner, [Work(runner, doc, todo, reference, options, hooks).start()])[0]


def prefill_full(runner, prepared, res: DocumentResult, options: EngineOptions, hooks: Hooks):
    """The uncompressed prefill every whole-context configuration starts from: from the prefill cache
    when one is configured and holds it (``prefill_s`` is then the load time), else computed (and stored)."""
    import mlx.core as mx

    import nestedkv

    if not options.prefill_cache:
        return runner.prefill(prepared, res, press=nestedkv.NoPress(), on_prefill=hooks.on_prefill)
    from pipeline.prefill_cache import PrefillCache

    store = PrefillCache(options.prefill_cache, options.prefill_cache_gb)
    n = len(prepared.context_ids)
    key = store.key(runner.config.model, prepared.context_ids, runner.config.prefill_step_size)
    t0 = time.perf_counter()
    mx.reset_peak_memory()
    cache = store.get(key, n)
    if cache is None:
        cache = runner.prefill(prepared, res, press=nestedkv.NoPress(), on_prefill=hooks.on_prefill)
        store.put(key, cache)
        return cache
    nestedkv.reset_peak(cache)
    res.prefill_s = time.perf_counter() - t0
    res.peak_prefill_bytes = mx.get_peak_memory()
    if hooks.on_prefill:
        hooks.on_prefill(n, n)
    return cache


def is_out_of_memory(exc: BaseException) -> bool:
    """MemoryError, or a device's out-of-memory error (Metal and CUDA raise RuntimeError)."""
    text = str(exc).lower()
    return isinstance(exc, MemoryError) or (isinstance(exc, RuntimeError) and ("out of memory" in text or
                                                                             "insufficient memory" in text))


def _merge(a: Optional[list[dict]], b: list[dict]) -> list[dict]:
    return [{**x, **y} for x, y in zip(a or [{}] * len(b), b)]


def process_documents(runner, store, plan: Plan, docs: Sequence[Document], *, hooks: Hooks = NO_HOOKS,
                      retry_if: Optional[Callable[[BaseException], bool]] = None) -> list[list[Outcome]]:
    """Run the configurations each of ``docs`` still needs (their answers decoded together when the
    options batch them) and write each document's rows (and evaluation rows) in one transaction of its own.
    A failure is stored as error rows; then, if ``retry_if(exception)`` holds, it is raised so the caller
    can retry (the retry's write replaces those rows)."""
    from pipeline.evaluate import evaluation_rows

    reference = plan.reference if plan.options.evaluate else None
    works, failed = [], {}
    for doc in docs:
        todo = plan.todo(doc)
        try:
            # the reference runs first when evaluating: the others are scored against it
            ordered = check_configs(([reference] if reference is not None else []) + todo)
            works.append(Work(runner, doc, ordered, reference, plan.options, hooks).start())
        except Exception as exc:  # never lose the batch to one document
            failed[doc.doc_id] = [Outcome(cfg, error_result(doc, exc)) for cfg in todo]
    try:
        done = dict(zip((w.doc.doc_id for w in works), finish(runner, works)))
    except Exception as exc:
        done = {w.doc.doc_id: [Outcome(cfg, error_result(w.doc, exc)) for cfg in w.todo] for w in works}
    out, failure = [], None
    for doc in docs:
        todo = plan.todo(doc)
        outcomes = failed.get(doc.doc_id) or done.get(doc.doc_id, [])
        ref_run = plan.reference_run_id(doc)
        stored = [o for o in outcomes if o.config in todo and plan.run_id(o.config)]
        try:
            store.write_results([
                (plan.run_id(o.config), o.result,
                 evaluation_rows(plan.run_id(o.config), o.result, o.scores, ref_run) if o.scores else [])
                for o in stored
            ])
        except StoreWriteError as exc:
            exc.stored = out  # the documents of this group written before it (the batch counts them)
            raise
        failure = failure or next((o.result.exception for o in stored if o.result.exception is not None), None)
        out.append(stored)
    if failure is not None and retry_if is not None and retry_if(failure):
        raise failure
    return out


def process_document(runner, store, plan: Plan, doc: Document, *, hooks: Hooks = NO_HOOKS,
                     retry_if: Optional[Callable[[BaseException], bool]] = None) -> list[Outcome]:
    """``process_documents`` for one document."""
    return process_documents(runner, store, plan, [doc], hooks=hooks, retry_if=retry_if)[0]


# -- a batch ------------------------------------------------------------------------------------------
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
                   "kept_share", "saved_share", "resident_share", "saved_mib")


def make_runner(config: RunConfig):
    """Load the configured model (cached per process) and wrap it for this configuration."""
    from pipeline.models import load_model, model_info
    from pipeline.runner import Runner

    model, tokenizer = load_model(config.model)
    return Runner(model, tokenizer, config, max_context=model_info(model).get("max_position_embeddings"))


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

    try:
        if docs and runner is None:
            runner = make_runner(plan.configs[0])
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
        else:
            status = "completed"
    finally:
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
    from pipeline.store import Store

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
