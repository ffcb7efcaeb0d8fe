"""One document end to end: tokenize, chunked prefill, compress once, answer each question, trim back."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Optional

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors

import nestedkv
from nestedkv import introspect
from nestedkv.layer_kinds import is_hybrid
from pipeline.config import REPETITION_CONTEXT, RunConfig
from pipeline.documents import Document
from pipeline.evaluate import score_answer, score_logits
from pipeline.prompts import build_prompt, encode, question_text, repeat_instruction
from pipeline.runner import map_reduce, memory_plan, window
from pipeline.results import ERROR, OK, TOO_LONG, DocumentResult, QuestionResult
from pipeline.runner.feed import Progress, asked, prefill
from pipeline.runner.window import PreparedDocument

def penalize_repeats(logits: mx.array, histories: list[list[int]], penalty: float,
                     context: int = REPETITION_CONTEXT) -> mx.array:
    """mlx-lm's repetition penalty (``make_repetition_penalty``) on every row of ``logits`` [B, vocab] at once,
    each row with the last ``context`` tokens of its own history; the same values, row by row."""
    recent = [h[-context:] for h in histories]
    if not all(recent):
        raise ValueError("every row needs a history (its question's tokens at least)")
    width = max(map(len, recent))
    # A repeated token takes the same penalized value again, so rows are padded with their first token.
    idx = mx.array([r + r[:1] * (width - len(r)) for r in recent], dtype=mx.int32)
    picked = mx.take_along_axis(logits, idx, axis=-1)
    picked = mx.where(picked < 0, picked * penalty, picked / penalty)
    return mx.put_along_axis(logits, idx, picked, axis=-1)


class Runner:
    """Runs documents for one configuration on one loaded model."""

    def __init__(self, model, tokenizer, config: RunConfig, max_context: Optional[int] = None):
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.press = config.make_press()
        self.max_context = max_context
        # Set by the engine: the memory a run may use (None: no plan, every document read as its settings say),
        # and every press the batch runs on a document (what it can be read by).
        self.memory_limit: Optional[int] = None
        self.presses = [self.press]
        # Sliding-window and state layers cannot be stacked, nor rows padded for layers whose attention does not
        # mask them (nestedkv.introspect): such a model answers one document at a time.
        self.can_batch = not is_hybrid(model) and all(f.routed for f in introspect.probe(model))
        eos = getattr(tokenizer, "eos_token_ids", None) or {getattr(tokenizer, "eos_token_id", None)}
        self.eos = {int(t) for t in eos if t is not None}
        self.penalty = config.penalty()  # (penalty, context) or None
        self.logits_processors = (
            make_logits_processors(repetition_penalty=self.penalty[0], repetition_context_size=self.penalty[1])
            if self.penalty
            else None
        )

    # -- preparation ------------------------------------------------------------------------
    def prepare(self, doc: Document, fit: bool = True) -> PreparedDocument:
        """The document's token ids; ``fit``: made to meet the window as ``long_docs`` says (``window.fit``)."""
        cfg = self.config
        if cfg.task == "qa":
            if not doc.questions:
                raise ValueError(f"document {doc.doc_id!r}: task 'qa' needs questions, field 'questions' is empty")
            asked = doc.questions
        else:
            asked = [None]
        window.check_size(doc.doc_id, doc.n_chars, None, cfg)
        # gold answers belong to questions: a summary has none (a document's first answer is not its summary)
        golds = (list(doc.answers or []) if cfg.task == "qa" else []) + [None] * len(asked)
        parts = [build_prompt(self.tokenizer, doc.text, question_text(cfg, q), **cfg.template_args()) for q in asked]
        context_ids = encode(self.tokenizer, parts[0].context)
        window.check_size(doc.doc_id, doc.n_chars, len(context_ids), cfg)
        questions = [
            (q if q is not None else cfg.summary_instruction, encode(self.tokenizer, p.question), g)
            for q, p, g in zip(asked, parts, golds)
        ]
        prepared = PreparedDocument(context_ids, questions)
        if not fit:
            return prepared
        prepared = window.fit(prepared, cfg, self.max_context)
        if self.memory_limit is not None:
            self.plan_memory(doc, prepared)
        prepared.parts = map_reduce.parts_of(self, doc, prepared.split_room)
        return prepared

    def plan_memory(self, doc: Document, prepared: PreparedDocument) -> None:
        """Choose how the document is read within ``memory_limit`` (``pipeline.runner.memory_plan``): whole, streaming,
        or parts sized to fit; parts past the window are made smaller when one would not fit. Raises
        ``memory_plan.NoPlan`` (one line, before the prefill) when no way fits."""
        shape, chunk = self.memory_shape(), self.config.prefill_step_size
        if prepared.split_room:  # past the window, in parts: the largest part must fit
            part = memory_plan.plan(shape, self.model, doc.doc_id, prepared.split_room, chunk, [], self.memory_limit)
            if part.way == memory_plan.PARTS:
                prepared.split_room = part.part_tokens
            prepared.memory = memory_plan.MemoryPlan(memory_plan.PARTS, part.peak_bytes, self.memory_limit,
                                                     prepared.split_room)
            return
        streaming = bool(prepared.positions) or all(p.prefill == "streaming" for p in self.presses)
        prepared.memory = memory_plan.plan(shape, self.model, doc.doc_id, len(prepared.context_ids), chunk,
                                           self.presses, self.memory_limit, streaming=streaming)
        if prepared.memory.way == memory_plan.PARTS:
            prepared.split_room = prepared.memory.part_tokens

    def memory_shape(self) -> memory_plan.Shape:
        if not hasattr(self, "_shape"):
            self._shape = memory_plan.shape_of(self.model)
        return self._shape

    def _over(self, prepared: PreparedDocument, n_question: int) -> Optional[str]:
        return window.over(prepared, n_question, self.config, self.max_context)

    def too_long(self, prepared: PreparedDocument) -> Optional[str]:
        """Why the document cannot run at all (no question fits the window with the context), or None."""
        if len(self.too_long_questions(prepared)) < len(prepared.questions):
            return None
        return self._over(prepared, max(len(q[1]) for q in prepared.questions))

    def too_long_questions(self, prepared: PreparedDocument) -> dict[int, str]:
        """question index -> why that question with the context and its answer exceeds the window."""
        over = {k: self._over(prepared, len(ids)) for k, (_, ids, _) in enumerate(prepared.questions)}
        return {k: why for k, why in over.items() if why}

    # -- one document -----------------------------------------------------------------------
    def start(self, doc: Document) -> tuple[DocumentResult, Optional[PreparedDocument]]:
        """Tokenize and check the window; returns the result shell and the token ids (None when
        the document cannot run: the result then carries the error)."""
        res = DocumentResult(doc.doc_id, doc.content_sha256, doc.n_chars, doc.title)
        try:
            prepared = self.prepare(doc)
        except window.OverLimit as exc:
            res.status, res.error = TOO_LONG, str(exc)
            return res, None
        except ValueError as exc:
            res.status, res.error = ERROR, str(exc)
            return res, None
        res.n_tokens = len(prepared.context_ids)
        res.questions = [
            QuestionResult(i, q, gold=g, n_question_tokens=len(ids)) for i, (q, ids, g) in enumerate(prepared.questions)
        ]
        reason = self.too_long(prepared)
        if reason:
            res.status, res.error = TOO_LONG, reason
            for q in res.questions:
                q.status, q.error = TOO_LONG, reason
            return res, None
        # Only some questions are too long: the others are answered; these are marked on their own rows.
        for k, why in self.too_long_questions(prepared).items():
            res.questions[k].status = TOO_LONG
            res.questions[k].error = f"document {doc.doc_id!r} question {k}: {why}"
        res.read_mode = prepared.read_mode
        if prepared.memory is not None:
            res.memory_plan, res.planned_peak_bytes = prepared.memory.label(), prepared.memory.peak_bytes
        if prepared.truncated_from:
            res.n_tokens_full = prepared.truncated_from
            res.error = f"truncated from {prepared.truncated_from} to {res.n_tokens} context tokens"
        return res, prepared

    def prefill(self, prepared: PreparedDocument, res: DocumentResult, press=None, on_prefill=None):
        """Prefill the context into a fresh cache under ``press`` (default: this run's press). A streaming
        press evicts while it prefills, so it is told the context length its ratio applies to."""
        press = press or self.press
        n = len(prepared.context_ids)
        if (prepared.positions or prepared.stream_to_fit) and press.prefill != "streaming":  # only while evicting
            if isinstance(press, nestedkv.NoPress):
                raise ValueError(f"a document of {n} tokens, longer than the model window of {self.max_context}, "
                                 f"is read whole only while evicting: press {press.name!r} keeps every row "
                                 "(--long-docs truncate cuts its middle instead)")
            press = replace(press, prefill="streaming")
        kw = {"context_len": n} if press.prefill == "streaming" else {}
        if prepared.positions:
            kw["positions"] = prepared.positions
        cache = nestedkv.make_cache(self.model, press, **kw)
        mx.reset_peak_memory()
        nestedkv.reset_peak(cache)
        t0 = time.perf_counter()
        prefill(self.model, cache, prepared.context_ids, self.config.prefill_step_size, on_prefill,
                asked(prepared, res))
        res.prefill_s = res.prefill_compute_s = time.perf_counter() - t0
        res.peak_prefill_bytes = mx.get_peak_memory()
        return cache

    def compress(self, cache, res: DocumentResult, prepared: Optional[PreparedDocument] = None,
                 scored: Optional[dict] = None) -> None:
        """Compress a prefilled cache once; time it and account for its memory (peaks include the prefill's).
        ``prepared``: the document, whose context presses that score with the model read (their passes count
        as compression), and whose questions (each one's suffix: the instruction of a summary) a
        question-aware press reads. ``scored``: one document's model scores by ``scoring_key``, shared by its
        configurations; each still records the scoring pass's seconds and peak, what it costs a run alone."""
        t0 = time.perf_counter()
        tokens = prepared.context_ids if prepared is not None else None
        questions = asked(prepared, res) if prepared is not None else []
        press = nestedkv.press_of(cache)
        scores, shared_s, shared_peak = None, 0.0, 0
        if press.needs_model and press.prefill == "whole" and scored is not None and tokens is not None:
            key = press.scoring_key()
            if key in scored:
                scores, shared_s, shared_peak = scored[key]
            else:
                scores = nestedkv.model_scores(cache, self.model, tokens, self.repeat_prompt(), questions)
                scored[key] = (scores, time.perf_counter() - t0, mx.get_peak_memory())
        nestedkv.compress(cache, model=self.model, tokens=tokens, prompt=self.repeat_prompt(), scores=scores,
                          questions=questions)
        res.compress_s = time.perf_counter() - t0 + shared_s
        res.peak_prefill_bytes = max(res.peak_prefill_bytes, mx.get_peak_memory(), shared_peak)
        peaks = nestedkv.peak_kv_bytes(cache)
        res.peak_kv_prefill_bytes = sum(peaks)
        res.layers = [replace(m, peak_prefill_kv_bytes=p) for m, p in zip(nestedkv.layer_stats(cache), peaks)]

    def repeat_prompt(self) -> nestedkv.Instruction:
        """KVzip's reconstruction instruction, in this model's tokens (encoded once)."""
        if not hasattr(self, "_repeat"):
            self._repeat = repeat_instruction(self.tokenizer, **self.config.template_args())
        return self._repeat

    def answer_all(self, cache, prepared: PreparedDocument, res: DocumentResult) -> DocumentResult:
        """Answer every question from the compressed cache, one at a time, rewinding after each."""
        mx.reset_peak_memory()
        nestedkv.reset_peak(cache)
        for q, (_, ids, _) in zip(res.questions, prepared.questions):
            if q.status == TOO_LONG:  # never fed: it would run past the model's window
                continue
            self.answer(cache, ids, q)
            nestedkv.rewind(cache)
        res.peak_decode_bytes = mx.get_peak_memory()
        record_decode_peaks(res, cache)
        return res.close_questions()

    def finish(self, cache, prepared: PreparedDocument, res: DocumentResult) -> DocumentResult:
        """Compress the prefilled cache once, then answer every question from it."""
        self.compress(cache, res, prepared)
        return self.answer_all(cache, prepared, res)

    def run(self, doc: Document, on_prefill: Optional[Progress] = None) -> DocumentResult:
        res, prepared = self.start(doc)
        if prepared is None:
            return res
        if prepared.parts:
            return map_reduce.run(self, prepared, res, self.press, on_prefill)
        cache = self.prefill(prepared, res, on_prefill=on_prefill)
        return self.finish(cache, prepared, res)

    def answer(self, cache, question_ids: list[int], out: QuestionResult) -> None:
        """Greedy answer after the compressed context; the cache is left for the caller to rewind."""
        t0 = time.perf_counter()
        tokens: list[int] = []
        logprob, scored = 0.0, 0  # the answer's tokens and its end-of-sequence token
        try:
            for token, logprobs in generate_step(
                mx.array(question_ids, dtype=mx.int32),
                self.model,
                max_tokens=self.config.max_new_tokens,
                prompt_cache=cache,
                prefill_step_size=self.config.prefill_step_size,
                logits_processors=self.logits_processors,
            ):
                token = int(token)
                logprob, scored = logprob + float(logprobs[token].item()), scored + 1
                if token in self.eos:
                    break
                tokens.append(token)
        except Exception as exc:  # one failing question must not lose the others
            out.status, out.error = ERROR, f"{type(exc).__name__}: {exc}"
        out.decode_s = time.perf_counter() - t0
        out.n_generated = len(tokens)
        out.logprob = logprob / max(1, scored)
        out.output = self.tokenizer.decode(tokens).strip()

    # -- several compressed caches at once (configurations of a document, and documents) -------------
    def answer_entries(self, entries: list["Entry"]) -> dict:
        """Answer the questions of every entry (a compressed cache with its document and result), the k-th
        question of all entries together, and return key -> per-question scores for entries with a
        reference. Entries may come from different documents (different lengths and questions).

        Per entry, one forward pass appends the question (and, when scoring, the reference answer for
        teacher forcing, trimmed off right after) and gives the first answer token; then all entries
        decode greedily together from one stacked batch cache, each with its own logits processors'
        history. Greedy answers equal one-at-a-time ones up to floating-point summation order.
        """
        nestedkv.install_attention_hook(self.model)  # the stack pads each entry's rows: masked per entry
        scores = {e.key: [] for e in entries if e.reference is not None}
        mx.reset_peak_memory()
        for e in entries:
            nestedkv.reset_peak(e.cache)
        for k in range(max(len(e.prepared.questions) for e in entries)):
            live, first, histories, teacher = [], [], [], {}
            for e in entries:
                if k >= len(e.prepared.questions):
                    continue
                q_ids = e.prepared.questions[k][1]
                q = e.result.questions[k]
                if q.status == TOO_LONG:  # never fed: it would run past the model's window
                    continue
                ref = e.reference
                targets = ref.targets[k] if ref is not None and ref.logits[k] is not None else []
                extra = list(targets[:-1])
                t0 = time.perf_counter()
                try:
                    logits = self.model(mx.array(list(q_ids) + extra, dtype=mx.int32)[None], cache=e.cache)[0]
                    tail = logits[len(q_ids) - 1 :].astype(mx.float32)
                    nxt = self._greedy([list(q_ids)], tail[:1])[0]
                    mx.eval(tail)
                    for c in e.cache:
                        c.trim(len(extra))  # keep only the question appended
                    live.append(e)
                    first.append(nxt)
                    histories.append(list(q_ids))
                    if targets:
                        teacher[e.key] = score_logits(np.array(tail), ref.logits[k], targets)
                except Exception as exc:
                    q.status, q.error = ERROR, f"{type(exc).__name__}: {exc}"
                    nestedkv.rewind(e.cache)
                q.decode_s = time.perf_counter() - t0
            if live:
                decoded = self._decode_by_kv_width([e.cache for e in live], first, histories)
                for e, (ids, seconds) in zip(live, decoded):
                    q = e.result.questions[k]
                    q.output = self.tokenizer.decode(ids).strip()
                    q.n_generated = len(ids)
                    q.decode_s += seconds
            for e in entries:
                if k >= len(e.prepared.questions):
                    continue
                nestedkv.rewind(e.cache)
                q = e.result.questions[k]
                if e.reference is not None:
                    s = {} if q.status != OK else score_answer(q.output, gold=q.gold, reference=e.reference.answers[k])
                    s.update(teacher.get(e.key, {}))
                    if q.status == OK:
                        s.update(e.reference.gold_scores(self.model, e.cache, k, e.prepared.questions[k][1]))
                    scores[e.key].append(s)
        peak = mx.get_peak_memory()
        for e in entries:
            e.result.peak_decode_bytes = peak
            record_decode_peaks(e.result, e.cache)
            e.result.close_questions()
        return scores

    def _greedy(self, histories: list[list[int]], logits) -> list[int]:
        """The greedy next token of each row of ``logits`` [B, vocab] after its history (question and
        generated tokens), penalized as mlx-lm's generate_step does with ``self.logits_processors``."""
        if self.penalty:
            logits = penalize_repeats(logits, histories, *self.penalty)
        nxt = mx.argmax(logits, axis=-1)
        mx.eval(nxt)
        return [int(t) for t in nxt.tolist()]

    def _decode_by_kv_width(self, caches: list, first: list[int], histories: list[list[int]]) -> list:
        """``_decode_together`` per quantization (bits, group size, key rotation): one batch cannot mix them."""
        groups: dict = {}
        for i, c in enumerate(caches):
            groups.setdefault(c[0].quant, []).append(i)
        out = [None] * len(caches)
        for idx in groups.values():
            got = self._decode_together([caches[i] for i in idx], [first[i] for i in idx], [histories[i] for i in idx])
            for i, d in zip(idx, got):
                out[i] = d
        return out

    def _decode_together(self, caches: list, first: list[int], histories: list[list[int]]) -> list[tuple[list[int], float]]:
        """Greedy decode for a batch whose first tokens are known; per entry (token ids, its share of time).
        Like ``answer``: at most ``max_new_tokens`` tokens, stopping before an EOS token."""
        t0 = time.perf_counter()
        stacked = nestedkv.stack(caches)
        out: list[list[int]] = [[] for _ in first]
        live = list(range(len(first)))  # entries still decoding, in batch order
        tokens = list(first)  # each live entry's next token
        max_new = self.config.max_new_tokens
        for step in range(max_new):
            going = [i for i, t in enumerate(tokens) if t not in self.eos]
            for i in going:
                out[live[i]].append(tokens[i])
            if not going or step == max_new - 1:
                break
            if len(going) < len(live):  # finished entries leave the batch
                stacked = nestedkv.take(stacked, going)
                live, tokens = [live[i] for i in going], [tokens[i] for i in going]
            logits = self.model(mx.array(tokens, dtype=mx.int32)[:, None], cache=stacked)[:, -1, :]
            rows = [histories[b] for b in live]
            for h, t in zip(rows, tokens):
                h.append(t)
            tokens = self._greedy(rows, logits)
        share = (time.perf_counter() - t0) / len(first)
        return [(ids, share) for ids in out]


@dataclass(eq=False)
class Entry:
    """One compressed cache to answer from: its document's questions, the result to fill, and the
    reference to score against (None: no scores)."""

    key: object
    cache: list
    prepared: PreparedDocument
    result: DocumentResult
    reference: object = None


def record_decode_peaks(res: DocumentResult, cache) -> None:
    peaks = nestedkv.peak_kv_bytes(cache)
    res.peak_kv_decode_bytes = sum(peaks)
    res.layers = [replace(m, peak_decode_kv_bytes=p) for m, p in zip(res.layers, peaks)]

