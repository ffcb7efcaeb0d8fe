"""One document under its configurations: tokenize, prefill once (each streaming configuration on its own),
compress a copy per configuration, answer (batched across configurations and documents when asked), score
against the reference when evaluating, and write each document's rows in one transaction."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import mlx.core as mx

import nestedkv
from pipeline import models
from pipeline.runner import map_reduce
from pipeline.config import EngineOptions, RunConfig
from pipeline.documents import Document
from pipeline.evaluate import METRIC_HOOKS, Reference, evaluation_rows, source_scores
from pipeline.runner.prefill_cache import open_cache
from pipeline.results import TOO_LONG, DocumentResult
from pipeline.runner import Entry
from pipeline.spec import check_configs
from pipeline.store import StoreWriteError

if TYPE_CHECKING:
    from pipeline.engine.plan import Plan

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
        self.batch = (options.batch_decode or options.batch_size > 1) and runner.can_batch
        self.results: dict[RunConfig, Optional[DocumentResult]] = {cfg: None for cfg in todo}
        self.scores: dict[RunConfig, list[dict]] = {}
        self.extra: dict[RunConfig, list[dict]] = {}
        self.together: dict[RunConfig, list] = {}
        self.ref = None  # pipeline.evaluate.Reference, once the reference answered
        self.scored: dict = {}  # model scores by press.scoring_key(): one pass for a sweep's budgets
        self.prepared = None
        self._reported = 0

    def report(self, cfg: RunConfig) -> None:
        self._reported += 1
        if self.hooks.on_config:
            self.hooks.on_config(self._reported, len(self.todo), cfg, self.results[cfg])

    def outcomes(self) -> list[Outcome]:
        for cfg, more in self.extra.items():
            self.scores[cfg] = _merge(self.scores.get(cfg), more)
        if self.evaluate:
            for cfg, res in self.results.items():
                if cfg.task == "summarize" and res is not None:  # past the window too: it needs no reference
                    self.scores[cfg] = _merge(self.scores.get(cfg), source_scores(res, self.doc.text))
        return [Outcome(cfg, self.results[cfg], self.scores.get(cfg)) for cfg in self.todo]

    def answer(self, cfg: RunConfig, cache, res: DocumentResult, full) -> None:
        """Compress ``cache`` and answer from it now, or leave it in ``together`` for ``finish``."""
        runner = self.runner
        if full is not None:
            for name in self.options.metrics:
                self.extra[cfg] = _merge(self.extra.get(cfg), METRIC_HOOKS[name](runner, self.prepared, full,
                                                                                 nestedkv.press_of(cache)))
        runner.compress(cache, res, self.prepared, self.scored)
        if self.batch and not cfg.is_reference:
            self.together[cfg] = cache
            return
        runner.answer_all(cache, self.prepared, res)
        if self.evaluate and cfg == self.reference:
            self.ref = Reference.build(runner, self.prepared, res, cache)
            self.scores[cfg] = self.ref.own_scores(res)
        elif self.evaluate:
            if self.ref is None:
                if self.prepared.positions:  # past the window the reference cannot read it: answers, no scores
                    self.report(cfg)
                    return
                raise RuntimeError("the no_press reference failed: nothing to score this configuration against")
            self.scores[cfg] = self.ref.score(runner, self.prepared, res, cache)
        self.report(cfg)

    def streamed(self, configs: list[RunConfig], shell: DocumentResult, exc: Optional[BaseException]) -> dict:
        """``configs`` as streaming presses; the uncompressed reference cannot stream and ends with ``exc``
        (or, past the window, as too long)."""
        out = {}
        for cfg in configs:
            if not cfg.is_reference:
                out[cfg] = replace(cfg.make_press(), prefill="streaming")
                continue
            self.results[cfg] = res = copy.deepcopy(shell)
            if exc is not None:
                res.fail(exc)
            else:
                res.status = TOO_LONG
                res.error = (f"document {self.doc.doc_id!r}: {len(self.prepared.context_ids)} tokens, longer than "
                             f"the model window of {self.runner.max_context}; the uncompressed reference cannot "
                             "read it (it keeps every row)")
                for q in res.questions:
                    q.status, q.error = TOO_LONG, res.error
            self.report(cfg)
        return out

    def start(self) -> "Work":
        """Tokenize, prefill (once for the whole-context configurations), compress each configuration."""
        runner, options, hooks, todo = self.runner, self.options, self.hooks, self.todo
        shell, self.prepared = runner.start(self.doc)
        if self.prepared is None:  # the document cannot run (no questions, too long): every configuration says so
            for cfg in todo:
                self.results[cfg] = copy.deepcopy(shell)
                self.report(cfg)
            return self
        if self.prepared.parts:  # in parts (map-reduce): each configuration reads them one by one
            for cfg in todo:
                self.results[cfg] = res = copy.deepcopy(shell)
                try:
                    map_reduce.run(runner, self.prepared, res, cfg.make_press(), hooks.on_prefill)
                except Exception as exc:
                    res.fail(exc)
                self.report(cfg)
            return self
        whole = [c for c in todo if c.prefill == "whole"]
        streaming = {c: c.make_press() for c in todo if c.prefill != "whole"}
        fallback = None
        if self.prepared.positions or self.prepared.stream_to_fit:  # read only while evicting (past the window, or
            # whole would not fit the memory limit), by every compressing configuration
            streaming = {**self.streamed(whole, shell, None), **streaming}
            whole = []
        if whole:
            base = copy.deepcopy(shell)
            try:
                full = prefill_full(runner, self.prepared, base, options, hooks)
            except Exception as exc:
                if options.on_oom != "streaming" or not is_out_of_memory(exc):
                    raise
                # The whole context does not fit: evict while prefilling instead, for every compressing configuration.
                fallback = f"whole-context prefill ran out of memory ({type(exc).__name__}: {exc}); prefilled streaming"
                streaming = {**self.streamed(whole, shell, exc), **streaming}
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
    when one is configured and holds it (``prefill_s`` is then the load time, ``prefill_compute_s`` the
    seconds the entry took to compute), else computed (and stored with its seconds)."""
    if not options.prefill_cache:
        return runner.prefill(prepared, res, press=nestedkv.NoPress(), on_prefill=hooks.on_prefill)
    store = open_cache(options.prefill_cache, options.prefill_cache_gb)
    n = len(prepared.context_ids)
    cfg = runner.config
    key = store.key(cfg.model_key or models.model_key(cfg.model, cfg.dtype), prepared.context_ids,
                    cfg.prefill_step_size)
    t0 = time.perf_counter()
    mx.reset_peak_memory()
    entry = store.load(key, n)
    if entry is None:
        cache = runner.prefill(prepared, res, press=nestedkv.NoPress(), on_prefill=hooks.on_prefill)
        store.put(key, cache, res.prefill_s)
        return cache
    cache = entry.cache
    nestedkv.reset_peak(cache)
    res.prefill_s, res.prefill_compute_s = time.perf_counter() - t0, entry.prefill_s
    res.peak_prefill_bytes = mx.get_peak_memory()
    if hooks.on_prefill:
        hooks.on_prefill(n, n)
    return cache


# What MLX's allocators raise when memory runs out: Metal's malloc past the largest buffer or the device's
# memory, the CPU's malloc, CUDA's; and the messages other devices give.
OUT_OF_MEMORY = ("out of memory", "insufficient memory", "[metal::malloc]", "[malloc]", "unable to allocate",
                 "maximum allowed buffer size", "[cuda::malloc]", "cudaerrormemoryallocation")


def is_out_of_memory(exc: BaseException) -> bool:
    """MemoryError, or a device's allocation error (MLX raises RuntimeError, e.g. "[metal::malloc] Attempting to
    allocate ... greater than the maximum allowed buffer size", "[malloc] Unable to allocate ...")."""
    text = str(exc).lower()
    return isinstance(exc, MemoryError) or (isinstance(exc, RuntimeError) and any(m in text for m in OUT_OF_MEMORY))


def _merge(a: Optional[list[dict]], b: list[dict]) -> list[dict]:
    return [{**x, **y} for x, y in zip(a or [{}] * len(b), b)]


def process_documents(runner, store, plan: Plan, docs: Sequence[Document], *, hooks: Hooks = NO_HOOKS,
                      retry_if: Optional[Callable[[BaseException], bool]] = None) -> list[list[Outcome]]:
    """Run the configurations each of ``docs`` still needs (their answers decoded together when the
    options batch them) and write each document's rows (and evaluation rows) in one transaction of its own.
    A failure is stored as error rows; then, if ``retry_if(exception)`` holds, it is raised so the caller
    can retry (the retry's write replaces those rows)."""
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
