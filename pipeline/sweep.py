"""Many configurations from one prefill: a budget sweep of one document, and of a whole batch.

The expensive part of a document is its prefill. Compression only chooses which rows of the prefilled
cache survive, so every (press, ratio, budget, head budget) configuration can start from a cheap copy of
one uncompressed cache (``nestedkv.clone``: MLX arrays are immutable, the copies share the prefilled keys
and values until compression writes new, smaller ones). The uncompressed reference (``no_press``) always
runs too: it is what quality is measured against.

``sweep_document`` is the per-document step (used by the Prefect ``budget-sweep`` flow and by
``nkv eval``); ``open_sweep`` / ``process_sweep_document`` / ``close_sweep`` / ``run_sweep`` are the
batch driver without an orchestrator, with resume: a (configuration, document) already done is skipped.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from itertools import product
from typing import Callable, Iterable, Optional, Sequence

import mlx.core as mx
import numpy as np

import nestedkv
from nestedkv.cache import install_attention_hook, stack
from pipeline.config import RunConfig
from pipeline.documents import Document, RowError, check_input, load_documents
from pipeline.evaluate import (
    QuestionScores,
    evaluation_rows,
    score_answer,
    score_logits,
    teacher_force,
)
from pipeline.prompts import encode
from pipeline.results import ERROR, OK, DocumentResult
from pipeline.runner import rewind

# What may differ between the configurations of one sweep; everything else (task, model, prompts,
# prefill chunking, max_new_tokens) must match, or one prefill could not serve them all.
PRESS_FIELDS = ("press", "compression_ratio", "budget", "head_budget")
REFERENCE_PRESS = "no_press"

Progress = Callable[[int, int], None]


class SweepResult(tuple):
    """``(config, result)``: unpacks as a pair; ``scores`` holds one ``QuestionScores`` per question of
    ``result`` in ``evaluate`` mode (None otherwise, or when the document could not run)."""

    def __new__(cls, config: RunConfig, result: DocumentResult, scores: Optional[list[QuestionScores]] = None):
        self = super().__new__(cls, (config, result))
        self.scores = scores
        return self

    @property
    def config(self) -> RunConfig:
        return self[0]

    @property
    def result(self) -> DocumentResult:
        return self[1]


# -- configurations -----------------------------------------------------------------------------------
def shared_fields(config: RunConfig) -> dict:
    return config.model_dump(exclude=set(PRESS_FIELDS))


def is_reference(config: RunConfig) -> bool:
    return config.press == REFERENCE_PRESS


def check_configs(base: RunConfig, configs: Iterable[RunConfig]) -> list[RunConfig]:
    """Raise ``ValueError`` unless every configuration differs from ``base`` only in its press settings."""
    configs = list(configs)
    want = shared_fields(base)
    for cfg in configs:
        if not isinstance(cfg, RunConfig):
            raise TypeError(f"configs must be RunConfig objects, got {type(cfg).__name__}")
        got = shared_fields(cfg)
        diff = sorted(k for k in want if want[k] != got[k])
        if diff:
            detail = ", ".join(f"{k}={got[k]!r} (runner: {want[k]!r})" for k in diff)
            raise ValueError(
                f"a sweep prefills each document once, so its configurations may differ only in "
                f"{', '.join(PRESS_FIELDS)}; {cfg.press} r={cfg.compression_ratio} differs in {detail}"
            )
    return configs


def with_reference(configs: Sequence[RunConfig]) -> list[RunConfig]:
    """The configurations, deduplicated, with the uncompressed reference first (added when missing)."""
    if not configs:
        raise ValueError("a sweep needs at least one configuration")
    out = [configs[0].reference()]
    for cfg in configs:
        if is_reference(cfg):
            cfg = cfg.reference()  # one canonical reference whatever ratio/budget it was given
        if cfg not in out:
            out.append(cfg)
    return out


def sweep_configs(
    base: RunConfig,
    presses: Sequence[str],
    compression_ratios: Sequence[float] = (),
    head_budgets: Sequence[str] = ("uniform",),
    budgets: Sequence[int] = (),
    head_budget_presses: Optional[Sequence[str]] = ("nestedkv",),
) -> list[RunConfig]:
    """The reference first, then each press x size (ratios, or absolute ``budgets`` when given).

    ``head_budgets`` multiply only the presses in ``head_budget_presses`` (default: nestedkv, whose
    head-wise competition is part of the method); the other presses run ``uniform``. Pass
    ``head_budget_presses=None`` to multiply every press.
    """
    sizes = [{"budget": int(b), "compression_ratio": 0.0} for b in budgets] if budgets else [
        {"compression_ratio": float(r), "budget": None} for r in compression_ratios
    ]
    if not sizes and any(p != REFERENCE_PRESS for p in presses):
        raise ValueError("give at least one compression ratio or budget")
    out: list[RunConfig] = []
    for press in presses:
        if press == REFERENCE_PRESS:
            continue
        modes = head_budgets if head_budget_presses is None or press in head_budget_presses else ["uniform"]
        for hb, size in product(modes, sizes):
            # model_validate, not model_copy: the new press/ratio must be validated.
            out.append(RunConfig.model_validate({**base.model_dump(), "press": press, "head_budget": hb, **size}))
    return with_reference(out or [base])


# -- one document ---------------------------------------------------------------------------------------
def sweep_document(
    runner,
    doc: Document,
    configs: Sequence[RunConfig],
    *,
    evaluate: bool = False,
    batch_decode: bool = False,
    on_prefill: Optional[Progress] = None,
    on_prefilled: Optional[Callable[[DocumentResult], None]] = None,
    on_config: Optional[Callable[[int, int, RunConfig, DocumentResult], None]] = None,
) -> list[SweepResult]:
    """Prefill ``doc`` ONCE into an uncompressed cache, then compress a copy of it per configuration
    and answer every question from that copy.

    Returns one ``SweepResult`` (a ``(config, result)`` pair) per entry of ``configs``, in the same
    order; the ``no_press`` reference always runs (first), and when ``configs`` lacks it, its result is
    appended at the end. Prefill timings and peak memory are shared by all results.

    ``evaluate=True`` also scores each configuration against the reference (``pipeline.evaluate``):
    text metrics on its answers, and teacher-forced log-likelihood metrics of the reference answers
    under its compressed cache versus the full cache; the scores are in ``SweepResult.scores``.

    ``batch_decode=False`` (default): each configuration runs ``Runner.finish`` on its copy, exactly
    what ``nkv run`` does for one configuration. ``batch_decode=True``: the compressed configurations
    answer each question together, as one batch of greedy decodes (see ``_answer_together``); on CPU,
    where one-token decode steps are bound by reading the weights, this is several times faster.
    Greedy answers are the same up to floating-point summation order (a near-tie can flip a token).
    A runner with logits processors (a repetition penalty: summaries by default) always decodes one
    configuration at a time. Batching holds every configuration's compressed cache at once, plus
    one stacked copy of them.

    Callbacks: ``on_prefill(done, total)`` per prefill chunk; ``on_prefilled(shell)`` once per prefill
    (so callers and tests can count prefills); ``on_config(i, n, config, result)`` per finished
    configuration (with ``batch_decode``, the compressed ones all finish at the end).
    A configuration that raises becomes an error result; the others still run.
    """
    configs = check_configs(runner.config, configs)
    todo = with_reference(configs)  # reference first: the others are scored against it
    if getattr(runner, "logits_processors", None):
        batch_decode = False  # the batched greedy loop has no logits processors (repetition penalty)
    shell, prepared = runner.start(doc)
    if prepared is None:  # bad document (no questions, too long): every configuration reports it
        results = {cfg: copy.deepcopy(shell) for cfg in todo}
        for i, cfg in enumerate(todo, 1):
            if on_config:
                on_config(i, len(todo), cfg, results[cfg])
        return _in_order(configs, todo, results, {})

    full = runner.prefill(prepared, shell, press=nestedkv.NoPress(), on_prefill=on_prefill)
    if on_prefilled:
        on_prefilled(shell)
    results: dict[RunConfig, DocumentResult] = {}
    scores: dict[RunConfig, list[QuestionScores]] = {}
    reference: Optional[_Reference] = None
    together: dict[RunConfig, list] = {}  # batch_decode: config -> compressed cache
    for i, cfg in enumerate(todo, 1):
        res = copy.deepcopy(shell)
        results[cfg] = res
        try:
            cache = _compressed_copy(runner, full, cfg)
            if batch_decode and not is_reference(cfg):
                _compress(cache, res)
                together[cfg] = cache
                continue  # answered below, with the others
            mx.reset_peak_memory()  # this configuration's compress peak, not the previous one's decode
            runner.finish(cache, prepared, res)
            if evaluate and is_reference(cfg):
                reference = _Reference.build(runner, prepared, res, cache)
                scores[cfg] = reference.own_scores(res)
            elif evaluate:
                scores[cfg] = _need(reference).score(runner, prepared, res, cache)
            del cache
        except Exception as exc:  # one configuration must not lose the others
            res.status, res.error = ERROR, f"{type(exc).__name__}: {exc}"
        if on_config:
            on_config(i, len(todo), cfg, res)
    if together:
        try:
            batch_scores = _answer_together(runner, prepared, together, results, _need(reference) if evaluate else None)
            if evaluate:
                scores.update(batch_scores)
        except Exception as exc:  # the batch failed as a whole: every configuration in it reports it
            for cfg in together:
                results[cfg].status, results[cfg].error = ERROR, f"{type(exc).__name__}: {exc}"
        for i, cfg in enumerate(todo, 1):
            if cfg in together and on_config:
                on_config(i, len(todo), cfg, results[cfg])
    return _in_order(configs, todo, results, scores)


def _need(reference):
    if reference is None:
        raise RuntimeError("the no_press reference failed: nothing to score this configuration against")
    return reference


def _compressed_copy(runner, full, cfg: RunConfig):
    press = cfg.make_press()
    if press.head_budget == "adaptive":
        # make_cache hooks attention for adaptive caches; a clone of a NoPress cache must be hooked too.
        install_attention_hook(runner.model)
    return nestedkv.clone(full, press)


def _compress(cache, res: DocumentResult) -> None:
    """The first half of ``Runner.finish``: compress once, time it, account for memory."""
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    nestedkv.compress(cache)
    res.compress_s = time.perf_counter() - t0
    res.peak_prefill_bytes = max(res.peak_prefill_bytes, mx.get_peak_memory())
    res.layers = nestedkv.layer_stats(cache)


def _in_order(configs, todo, results, scores) -> list[SweepResult]:
    order = [cfg.reference() if is_reference(cfg) else cfg for cfg in configs]
    if todo[0] not in order:
        order.append(todo[0])
    return [SweepResult(cfg, results[cfg], scores.get(cfg)) for cfg in order]


# -- batched answering ----------------------------------------------------------------------------------
def _answer_together(runner, prepared, caches: dict, results: dict, reference) -> dict:
    """Answer each question from every compressed cache at once; returns per-config scores (evaluate).

    Per configuration, one forward pass appends the question (and, when evaluating, the reference answer
    for teacher forcing, trimmed off again right after) and gives the first answer token; then all
    configurations decode greedily together from a stacked batch cache, one token per step for all.
    """
    model, eos, max_new = runner.model, runner.eos, runner.config.max_new_tokens
    install_attention_hook(model)  # the stacked cache pads each entry's context: masked like adaptive heads
    scores = {cfg: [] for cfg in caches}
    mx.reset_peak_memory()
    for k, (_, q_ids, _) in enumerate(prepared.questions):
        targets = reference.targets[k] if reference is not None and reference.logits[k] is not None else []
        extra = list(targets[:-1])
        first, logit_scores = {}, {}
        for cfg, cache in caches.items():
            q = results[cfg].questions[k]
            t0 = time.perf_counter()
            try:
                logits = model(mx.array(list(q_ids) + extra, dtype=mx.int32)[None], cache=cache)[0]
                tail = logits[len(q_ids) - 1 :].astype(mx.float32)
                nxt = mx.argmax(tail[0])
                mx.eval(tail, nxt)
                first[cfg] = int(nxt.item())
                if targets:
                    logit_scores[cfg] = score_logits(np.array(tail), reference.logits[k], targets)
                for c in cache:
                    c.trim(len(extra))  # keep only the question appended
            except Exception as exc:
                q.status, q.error = ERROR, f"{type(exc).__name__}: {exc}"
                rewind(cache)
            q.decode_s = time.perf_counter() - t0
        live = list(first)
        if live:
            tokens = _decode_together(model, [caches[c] for c in live], [first[c] for c in live], eos, max_new)
            for cfg, (ids, seconds) in zip(live, tokens):
                q = results[cfg].questions[k]
                q.output = runner.tokenizer.decode(ids).strip()
                q.n_generated = len(ids)
                q.decode_s += seconds
        for cfg, cache in caches.items():
            rewind(cache)
            q = results[cfg].questions[k]
            if reference is not None:
                s = {} if q.status != OK else score_answer(q.output, gold=q.gold, reference=reference.answers[k])
                s.update(logit_scores.get(cfg, {}))
                scores[cfg].append(s)
    peak = mx.get_peak_memory()
    for cfg in caches:
        res = results[cfg]
        res.peak_decode_bytes = peak
        if any(q.status != OK for q in res.questions):
            res.status = ERROR
            res.error = "; ".join(f"question {q.question_idx}: {q.error}" for q in res.questions if q.error)
    return scores


def _decode_together(model, caches: list, first: list[int], eos: set, max_new: int) -> list[tuple[list[int], float]]:
    """Greedy decode for a batch whose first tokens are known; per entry (token ids, its share of time).
    Like ``Runner.answer``: at most ``max_new`` tokens, stopping before an EOS token."""
    t0 = time.perf_counter()
    stacked = stack(caches)
    out: list[list[int]] = [[] for _ in first]
    done = [False] * len(first)
    tokens = list(first)
    for step in range(max_new):
        for b, t in enumerate(tokens):
            if not done[b]:
                if t in eos:
                    done[b] = True
                else:
                    out[b].append(t)
        if all(done) or step == max_new - 1:
            break
        logits = model(mx.array(tokens, dtype=mx.int32)[:, None], cache=stacked)
        nxt = mx.argmax(logits[:, -1, :], axis=-1)
        mx.eval(nxt)
        tokens = [int(t) for t in nxt.tolist()]
    share = (time.perf_counter() - t0) / len(first)
    return [(ids, share) for ids in out]


@dataclass
class _Reference:
    """The uncompressed answers of one document, and the full cache's logits along each of them."""

    answers: list[Optional[str]]  # None where the reference question failed
    targets: list[list[int]]  # the reference answers' token ids
    logits: list[Optional[object]]  # [len(target), vocab] per question, None when there is nothing to score

    @classmethod
    def build(cls, runner, prepared, res: DocumentResult, cache) -> "_Reference":
        answers, targets, logits = [], [], []
        for q, (_, q_ids, _) in zip(res.questions, prepared.questions):
            ok = q.status == OK
            answers.append(q.output if ok else None)
            ids = encode(runner.tokenizer, q.output) if ok else []
            targets.append(ids)
            logits.append(teacher_force(runner.model, cache, q_ids, ids) if ids else None)
        return cls(answers, targets, logits)

    @staticmethod
    def own_scores(res: DocumentResult) -> list[QuestionScores]:
        """The reference against gold only: agreeing with itself would be trivially perfect."""
        return [score_answer(q.output, gold=q.gold) if q.status == OK else {} for q in res.questions]

    def score(self, runner, prepared, res: DocumentResult, cache) -> list[QuestionScores]:
        out = []
        for k, (q, (_, q_ids, _)) in enumerate(zip(res.questions, prepared.questions)):
            if q.status != OK:
                out.append({})
                continue
            s = score_answer(q.output, gold=q.gold, reference=self.answers[k])
            if self.logits[k] is not None:
                s.update(score_logits(teacher_force(runner.model, cache, q_ids, self.targets[k]),
                                      self.logits[k], self.targets[k]))
            out.append(s)
        return out


# -- a batch, with resume -------------------------------------------------------------------------------
@dataclass
class SweepPlan:
    """What a sweep over one input still has to do, and the runs it writes into."""

    input: str
    configs: list[RunConfig]  # the reference first
    evaluate: bool
    docs: list[Document]
    errors: list[RowError]
    done: dict[str, set[str]]  # config hash -> content hashes already done under that configuration
    reference_runs: dict[str, str]  # content hash -> run holding its stored no_press answers
    run_ids: dict[str, str] = field(default_factory=dict)  # config hash -> run started by this sweep

    @property
    def reference(self) -> RunConfig:
        return self.configs[0]

    def todo(self, doc: Document) -> list[RunConfig]:
        return [c for c in self.configs if doc.content_sha256 not in self.done[c.config_hash()]]

    @property
    def todo_docs(self) -> list[Document]:
        return [d for d in self.docs if self.todo(d)]

    def run_id(self, config: RunConfig) -> Optional[str]:
        return self.run_ids.get(config.config_hash())

    def reference_run_id(self, doc: Document) -> Optional[str]:
        return self.run_id(self.reference) if self.reference in self.todo(doc) else \
            self.reference_runs.get(doc.content_sha256)


def done_documents(store, config: RunConfig, evaluate: bool = False) -> set[str]:
    """Content hashes answered ok (every question) under ``config``; with ``evaluate``, only those
    whose evaluation rows were written too (documents without gold answers need none as reference)."""
    done = store.done_content_hashes(config)
    if not evaluate or not done:
        return done
    rows = store.query(
        """
        SELECT DISTINCT o.content_sha256, bool_or(e.run_id IS NOT NULL) AS scored, bool_and(o.gold IS NULL) AS no_gold
        FROM outputs o JOIN runs r ON r.run_id = o.run_id
        LEFT JOIN evaluations e ON e.run_id = o.run_id AND e.doc_id = o.doc_id
        WHERE r.config_hash = $h AND o.status = 'ok'
        GROUP BY o.run_id, o.content_sha256, o.doc_id
        """,
        {"h": config.config_hash()},
    ).to_pylist()
    ok = {r["content_sha256"] for r in rows if r["scored"] or (is_reference(config) and r["no_gold"])}
    return done & ok


def stored_reference_runs(store, reference: RunConfig) -> dict[str, str]:
    """content hash -> the latest run holding ok no_press answers for it under ``reference``."""
    rows = store.query(
        """
        SELECT content_sha256, arg_max(run_id, created_at) AS run_id FROM (
            SELECT o.content_sha256, o.run_id, any_value(r.created_at) AS created_at
            FROM outputs o JOIN runs r ON r.run_id = o.run_id
            WHERE r.config_hash = $h
            GROUP BY o.run_id, o.content_sha256, o.doc_id HAVING bool_and(o.status = 'ok')
        ) GROUP BY content_sha256
        """,
        {"h": reference.config_hash()},
    ).to_pylist()
    return {r["content_sha256"]: r["run_id"] for r in rows}


def open_sweep(store, configs: Sequence[RunConfig], input: str, *, evaluate: bool = False) -> SweepPlan:
    """Validate the input, find what is done, and start one run per configuration that has work left
    (bad input rows are recorded in each of those runs)."""
    configs = with_reference(configs)
    check_configs(configs[0], configs)
    check_input(input)
    docs, errors = load_documents(input)
    done = {c.config_hash(): done_documents(store, c, evaluate) for c in configs}
    plan = SweepPlan(str(input), configs, evaluate, docs, errors, done, stored_reference_runs(store, configs[0]))
    for cfg in configs:
        if any(d.content_sha256 not in done[cfg.config_hash()] for d in docs):
            run_id = store.start_run(cfg, input)
            plan.run_ids[cfg.config_hash()] = run_id
            store.write_input_errors(run_id, errors)
    return plan


def process_sweep_document(
    runner,
    store,
    plan: SweepPlan,
    doc: Document,
    *,
    batch_decode: bool = False,
    on_prefill: Optional[Progress] = None,
    on_config: Optional[Callable[[int, int, RunConfig, DocumentResult], None]] = None,
) -> list[SweepResult]:
    """Sweep one document over the configurations it still needs and store each result (and its
    evaluation rows) under that configuration's run. The reference always runs in memory; it is
    stored only when it was not done before. A failing document becomes error rows, not an exception."""
    todo = plan.todo(doc)
    if not todo:
        return []
    try:
        items = sweep_document(runner, doc, todo, evaluate=plan.evaluate, batch_decode=batch_decode,
                               on_prefill=on_prefill, on_config=on_config)
    except Exception as exc:  # never lose the batch to one document
        err = DocumentResult(doc.doc_id, doc.content_sha256, doc.n_chars, doc.title, status=ERROR,
                             error=f"{type(exc).__name__}: {exc}")
        items = [SweepResult(cfg, copy.deepcopy(err)) for cfg in todo]
    reference_run = plan.reference_run_id(doc)
    stored = []
    for item in items:
        run_id = plan.run_id(item.config)
        if item.config not in todo or run_id is None:
            continue  # the reference, recomputed only to score the others against
        store.write_document(run_id, item.result)
        if item.scores:
            store.write_evaluations(evaluation_rows(run_id, item.result, item.scores, reference_run))
        stored.append(item)
    return stored


def close_sweep(store, plan: SweepPlan, status: str) -> None:
    for run_id in plan.run_ids.values():
        store.finish_run(run_id, status)


@dataclass
class SweepSummary:
    db: str
    runs: list[tuple[RunConfig, str]] = field(default_factory=list)  # runs started by this sweep
    n_documents: int = 0
    n_swept: int = 0  # documents prefilled (had at least one configuration to run)
    n_results: int = 0  # (document, configuration) results stored
    n_failed: int = 0
    input_errors: list[RowError] = field(default_factory=list)
    wall_s: float = 0.0


def run_sweep(
    input: str,
    configs: Sequence[RunConfig],
    db: str,
    *,
    evaluate: bool = False,
    batch_decode: bool = False,
    on_start: Optional[Callable[[SweepPlan], None]] = None,
    on_document: Optional[Callable[[int, int, Document, list[SweepResult]], None]] = None,
    on_config: Optional[Callable[[int, int, RunConfig, DocumentResult], None]] = None,
    on_prefill: Optional[Progress] = None,
) -> SweepSummary:
    """The whole input through every configuration, one prefill per document, resuming finished work."""
    from pipeline.batch import make_runner
    from pipeline.store import Store

    t0 = time.perf_counter()
    with Store(db) as store:
        plan = open_sweep(store, configs, input, evaluate=evaluate)
        summary = SweepSummary(str(db), [(c, plan.run_id(c)) for c in plan.configs if plan.run_id(c)],
                               n_documents=len(plan.docs), input_errors=plan.errors)
        docs = plan.todo_docs
        if on_start:
            on_start(plan)
        status = "failed"
        try:
            runner = make_runner(plan.reference) if docs else None  # finished sweeps do no model work
            for i, doc in enumerate(docs, 1):
                items = process_sweep_document(runner, store, plan, doc, batch_decode=batch_decode,
                                               on_prefill=on_prefill, on_config=on_config)
                summary.n_swept += 1
                summary.n_results += len(items)
                summary.n_failed += sum(1 for it in items if it.result.status != OK)
                if on_document:
                    on_document(i, len(docs), doc, items)
            status = "completed"
        finally:
            close_sweep(store, plan, status)
    summary.wall_s = time.perf_counter() - t0
    return summary
