"""Map-reduce over a document longer than the window (``long_docs="map_reduce"``), the conventional way and the
baseline the streaming read is measured against.

The document is split at paragraph boundaries into parts that fit the window with every question (a
paragraph longer than that is cut by tokens). Each part is prefilled, compressed by the run's press and
answered as a document of its own. QA: each question takes the answer of the part under which the question
itself is likeliest (the model's own retrieval: a part that holds what is asked about makes its wording
predictable), the answer's mean log-probability breaking ties. Summaries: the parts' summaries, joined, are
summarized once more.
"""

from __future__ import annotations

import copy
import math
import time
from typing import Optional

from pipeline.documents import Document
from pipeline.evaluate import gold_nll
from pipeline.prompts import encode
from pipeline.results import OK, TOO_LONG, DocumentResult, QuestionResult

JOIN = "\n\n"


def split(runner, doc: Document, room: int) -> list[Document]:
    """``doc`` as documents of whole paragraphs whose contexts fit ``room`` tokens."""
    tok = runner.tokenizer
    overhead = len(runner.prepare(doc.model_copy(update={"text": "."}), fit=False).context_ids)
    budget = room - overhead - 8  # the template around each part, and slack for tokens merging at the joins
    if budget < 16:
        raise ValueError(f"document {doc.doc_id!r}: the window leaves {budget} tokens per part for map-reduce")
    pieces: list[tuple[str, int]] = []
    for para in (p for p in doc.text.split(JOIN) if p.strip()):
        ids = encode(tok, para)
        for i in range(0, len(ids), budget):  # a paragraph longer than a part is cut by tokens
            piece = para if len(ids) <= budget else tok.decode(ids[i : i + budget])
            pieces.append((piece, min(budget, len(ids) - i)))
    parts, cur, n = [], [], 0
    for piece, k in pieces:
        if cur and n + k + 2 > budget:
            parts.append(cur)
            cur, n = [], 0
        cur.append(piece)
        n += k + 2
    parts.append(cur)
    return [doc.model_copy(update={"text": JOIN.join(p)}) for p in parts if p]


def run(runner, prepared, res: DocumentResult, press, on_prefill=None) -> DocumentResult:
    """Answer from every part (compressed by ``press``), then choose or reduce into ``res``."""
    picks = answers_by_part(runner, prepared, res, press, on_prefill)
    if runner.config.task == "summarize":
        return _reduce(runner, res, [q.output for _, q in picks[0]], press, on_prefill)
    for q, answers in zip(res.questions, picks):
        if q.status == TOO_LONG or not answers:
            continue
        best = pick(answers)
        q.output, q.n_generated, q.logprob = best.output, best.n_generated, best.logprob
        q.decode_s = sum(a.decode_s for _, a in answers)
    return res


def answers_by_part(runner, prepared, res: DocumentResult, press, on_prefill=None) -> list[list[tuple]]:
    """For each question, ``(question NLL, answer)`` of every part that answered it; the parts' costs are
    added to ``res``."""
    picks: list[list] = [[] for _ in res.questions]
    total, done = sum(len(p.context_ids) for p in prepared.parts), 0
    qa = runner.config.task != "summarize"
    for part in prepared.parts:
        got = copy.deepcopy(res)
        # progress over the whole document (every part's tokens), not one part at a time
        seen = on_prefill and (lambda n, _, at=done: on_prefill(at + n, total))
        done += len(part.context_ids)
        cache = runner.prefill(part, got, press=press, on_prefill=seen)
        runner.compress(cache, got, part)
        fits = [question_nll(runner, cache, ids) if qa else (0.0, 0.0) for _, ids, _ in part.questions]
        runner.answer_all(cache, part, got)
        _add_costs(res, got)
        for k, q in enumerate(got.questions):
            if q.status == OK:
                q.decode_s += fits[k][1]
                picks[k].append((fits[k][0], q))
    return picks


def pick(answers: list[tuple]) -> QuestionResult:
    """The answer of the part the question is likeliest under; the answer's own likelihood breaks ties."""
    return min(answers, key=lambda a: (a[0], -a[1].logprob))[1]


def question_nll(runner, cache, question_ids: list[int]) -> tuple[float, float]:
    """The question's mean NLL per token (after its first) under a part's compressed cache, and the seconds
    it took; the cache is left as it was."""
    t0 = time.perf_counter()
    try:
        nll = gold_nll(runner.model, cache, question_ids[:1], question_ids[1:]) if len(question_ids) > 1 else 0.0
    except Exception:  # the answer records the failure; this part only ranks last
        nll = math.inf
    return (math.inf if math.isnan(nll) else nll), time.perf_counter() - t0


def _reduce(runner, res: DocumentResult, summaries: list[str], press, on_prefill) -> DocumentResult:
    """The summary of the parts' summaries (read whole: they fit, or are split again)."""
    doc = Document(doc_id=res.doc_id, text=JOIN.join(s for s in summaries if s.strip()) or ".")
    got = copy.deepcopy(res)
    prepared = runner.prepare(doc)
    if prepared.parts:
        got = run(runner, prepared, got, press, on_prefill)
    else:
        runner.finish(runner.prefill(prepared, got, press=press, on_prefill=on_prefill), prepared, got)
    _add_costs(res, got)
    res.questions = got.questions
    return res


def _add_costs(res: DocumentResult, part: DocumentResult) -> None:
    """A part's times add up; its peaks count where they are the largest (parts run one after another)."""
    res.prefill_s += part.prefill_s
    res.prefill_compute_s = None if None in (res.prefill_compute_s, part.prefill_compute_s) else \
        res.prefill_compute_s + part.prefill_compute_s
    res.compress_s += part.compress_s
    for name in ("peak_prefill_bytes", "peak_decode_bytes", "peak_kv_prefill_bytes", "peak_kv_decode_bytes"):
        setattr(res, name, max(getattr(res, name), getattr(part, name)))
    if sum(m.bytes_full for m in part.layers) > sum(m.bytes_full for m in res.layers):
        res.layers = part.layers  # the largest part's accounting
    if part.status != OK and res.status == OK:
        res.status, res.error = part.status, part.error


def parts_of(runner, doc: Document, room: Optional[int]) -> list:
    """The prepared parts of ``doc`` for ``room`` context tokens (none when it fits)."""
    return [runner.prepare(d, fit=False) for d in split(runner, doc, room)] if room else []
