"""One document end to end: tokenize, chunked prefill, compress once, answer each question, trim back."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors

import nestedkv
from pipeline.config import RunConfig
from pipeline.documents import Document
from pipeline.prompts import build_prompt, encode, question_text
from pipeline.results import ERROR, OK, TOO_LONG, DocumentResult, QuestionResult

Progress = Callable[[int, int], None]


@dataclass
class PreparedDocument:
    """A document's token ids: one context, one question suffix per question."""

    context_ids: list[int]
    questions: list[tuple[str, list[int], Optional[str]]]  # (question, suffix ids, gold)
    truncated_from: Optional[int] = None


def _backbone(model):
    # The transformer without the LM head: context chunks need only the cache, and the head is
    # ~20% of a small model's prefill FLOPs.
    inner = getattr(model, "model", None)
    return inner if callable(inner) else model


def prefill(model, cache, ids: list[int], step: int, on_progress: Optional[Progress] = None) -> None:
    """Feed the context in chunks of ``step`` tokens into ``cache`` (evaluated chunk by chunk)."""
    body = _backbone(model)
    tokens = mx.array(ids, dtype=mx.int32)[None]
    n = len(ids)
    for start in range(0, n, step):
        body(tokens[:, start : start + step], cache=cache)
        mx.eval([c.state for c in cache])
        if on_progress:
            on_progress(min(start + step, n), n)


def rewind(cache) -> None:
    for c in cache:
        c.rewind()


class Runner:
    """Runs documents for one configuration on one loaded model."""

    def __init__(self, model, tokenizer, config: RunConfig, max_context: Optional[int] = None):
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.press = config.make_press()
        self.max_context = max_context
        eos = getattr(tokenizer, "eos_token_ids", None) or {getattr(tokenizer, "eos_token_id", None)}
        self.eos = {int(t) for t in eos if t is not None}
        penalty = config.repetition_penalty
        self.logits_processors = (
            make_logits_processors(repetition_penalty=penalty, repetition_context_size=64)
            if penalty and penalty != 1.0
            else None
        )

    # -- preparation ------------------------------------------------------------------------
    def prepare(self, doc: Document) -> PreparedDocument:
        cfg = self.config
        if cfg.task == "qa":
            if not doc.questions:
                raise ValueError(f"document {doc.doc_id!r}: task 'qa' needs questions, field 'questions' is empty")
            asked = doc.questions
        else:
            asked = [None]
        golds = list(doc.answers or []) + [None] * len(asked)
        parts = [build_prompt(self.tokenizer, doc.text, question_text(cfg, q)) for q in asked]
        context_ids = encode(self.tokenizer, parts[0].context)
        questions = [
            (q if q is not None else cfg.summary_instruction, encode(self.tokenizer, p.question), g)
            for q, p, g in zip(asked, parts, golds)
        ]
        prepared = PreparedDocument(context_ids, questions)
        if self.max_context:
            longest_q = max(len(q[1]) for q in questions)
            room = self.max_context - longest_q - cfg.max_new_tokens
            if len(context_ids) > room and cfg.truncate and room > 0:
                # Keep the head (template + start) and the tail (end of the document) of the context.
                half = room // 2
                prepared.truncated_from = len(context_ids)
                prepared.context_ids = context_ids[:half] + context_ids[len(context_ids) - (room - half) :]
        return prepared

    def too_long(self, prepared: PreparedDocument) -> Optional[str]:
        if not self.max_context:
            return None
        longest_q = max(len(q[1]) for q in prepared.questions)
        need = len(prepared.context_ids) + longest_q + self.config.max_new_tokens
        if need <= self.max_context:
            return None
        return (
            f"context {len(prepared.context_ids)} + question {longest_q} + max_new_tokens "
            f"{self.config.max_new_tokens} = {need} tokens exceeds the model window of {self.max_context}; "
            "pass --truncate to cut the middle of the document"
        )

    # -- one document -----------------------------------------------------------------------
    def start(self, doc: Document) -> tuple[DocumentResult, Optional[PreparedDocument]]:
        """Tokenize and check the window; returns the result shell and the token ids (None when
        the document cannot run: the result then carries the error)."""
        res = DocumentResult(doc.doc_id, doc.content_sha256, doc.n_chars, doc.title)
        try:
            prepared = self.prepare(doc)
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
        if prepared.truncated_from:
            res.error = f"truncated from {prepared.truncated_from} to {res.n_tokens} context tokens"
        return res, prepared

    def prefill(self, prepared: PreparedDocument, res: DocumentResult, press=None, on_prefill=None):
        """Prefill the context into a fresh cache under ``press`` (default: this run's press)."""
        cache = nestedkv.make_cache(self.model, press or self.press)
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        prefill(self.model, cache, prepared.context_ids, self.config.prefill_step_size, on_prefill)
        res.prefill_s = time.perf_counter() - t0
        res.peak_prefill_bytes = mx.get_peak_memory()
        return cache

    def finish(self, cache, prepared: PreparedDocument, res: DocumentResult) -> DocumentResult:
        """Compress the prefilled cache once, then answer every question from it."""
        t0 = time.perf_counter()
        nestedkv.compress(cache)
        res.compress_s = time.perf_counter() - t0
        res.peak_prefill_bytes = max(res.peak_prefill_bytes, mx.get_peak_memory())
        res.layers = nestedkv.layer_stats(cache)
        mx.reset_peak_memory()
        for q, (_, ids, _) in zip(res.questions, prepared.questions):
            self.answer(cache, ids, q)
            rewind(cache)
        res.peak_decode_bytes = mx.get_peak_memory()
        if any(q.status != OK for q in res.questions):
            res.status = ERROR
            res.error = "; ".join(f"question {q.question_idx}: {q.error}" for q in res.questions if q.error)
        return res

    def run(self, doc: Document, on_prefill: Optional[Progress] = None) -> DocumentResult:
        res, prepared = self.start(doc)
        if prepared is None:
            return res
        cache = self.prefill(prepared, res, on_prefill=on_prefill)
        return self.finish(cache, prepared, res)

    def answer(self, cache, question_ids: list[int], out: QuestionResult) -> None:
        """Greedy answer after the compressed context; the cache is left for the caller to rewind."""
        t0 = time.perf_counter()
        tokens: list[int] = []
        try:
            for token, _ in generate_step(
                mx.array(question_ids, dtype=mx.int32),
                self.model,
                max_tokens=self.config.max_new_tokens,
                prompt_cache=cache,
                prefill_step_size=self.config.prefill_step_size,
                logits_processors=self.logits_processors,
            ):
                token = int(token)
                if token in self.eos:
                    break
                tokens.append(token)
        except Exception as exc:  # one failing question must not lose the others
            out.status, out.error = ERROR, f"{type(exc).__name__}: {exc}"
        out.decode_s = time.perf_counter() - t0
        out.n_generated = len(tokens)
        out.output = self.tokenizer.decode(tokens).strip()
