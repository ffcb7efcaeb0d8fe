"""Quality of a compressed run against the uncompressed run of the same document.

Metrics, per (document, question, configuration), stored in the ``evaluations`` table under these names:

- ``correct`` (0/1): the gold answer occurs in the model's answer, after folding case, punctuation and
  whitespace (``contains_gold``). Scored for the reference too; ``reference_run_id`` is NULL (it is a
  score against gold, and the store's ``quality_vs_full`` view puts the reference's value beside it).
- ``agree_exact`` (0/1): the answer equals the ``no_press`` answer after the same folding.
- ``rouge_l``: ROUGE-L F-measure of the answer against the ``no_press`` answer (``rouge-score``).
- ``delta_nll``: teacher-forced mean negative log-likelihood per token of the ``no_press`` answer under
  the compressed cache minus the same under the full cache (0 = compression changed nothing the model
  believes about the reference answer; higher = worse).
- ``top1_agreement``: along the ``no_press`` answer, the share of positions where the compressed cache's
  argmax next token equals the full cache's argmax.
- ``gold_nll``: teacher-forced mean negative log-likelihood per token of the gold answer after the
  question, under this run's cache (the reference's too; ``reference_run_id`` NULL). Unlike ``correct``
  it still separates methods when greedy answers are all wrong: it asks how much the cache still
  supports the right answer, with one forward pass and no decoding.
- ``delta_gold_nll``: ``gold_nll`` under the compressed cache minus ``gold_nll`` under the full cache
  of the same document (with the ``no_press`` run as reference).
- ``gold_kept`` (opt-in, ``gold_kept`` metric hook): the share of (layer, KV head, gold-answer context
  token) triples the press keeps; a diagnosis of why an answer was lost.

The agreement metrics carry ``reference_run_id`` = the ``no_press`` run. The numerical parts are pure
functions of strings and logits; ``teacher_force`` is the only one that runs the model.
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections import Counter
from functools import lru_cache
from typing import Any, Optional, Sequence

import mlx.core as mx
import numpy as np
from rouge_score import rouge_scorer

import nestedkv
from nestedkv.cache import full_layers, layer_press
from pipeline.metrics import (AGREE_EXACT, CORRECT, COVERAGE, COVERAGE_ENDS, COVERAGE_MIDDLE,  # noqa: F401
                              DELTA_GOLD_NLL, DELTA_NLL, GOLD_KEPT, GOLD_METRICS, GOLD_NLL, METRICS, MIDDLE,
                              REFERENCE_METRICS, ROUGE_L, SOURCE, SOURCE_ENDS, SOURCE_MIDDLE, TOP1, UNREFERENCED)
from pipeline.prompts import encode
from pipeline.results import TOO_LONG

QuestionScores = dict  # metric name -> value, for one question


# -- text -----------------------------------------------------------------------------------------------
def normalize_answer(text: Optional[str]) -> str:
    """Fold case (Unicode casefold after NFKC), delete punctuation, collapse whitespace to single spaces.

    Punctuation is deleted rather than replaced by a space so that ``4,719`` matches ``4719`` and
    ``K7-Q2`` matches ``k7q2``; the price is that ``K7 Q2`` (a space instead of the dash) does not.
    """
    if not text:
        return ""
    text = unicodedata.normalize("NFKC", text).casefold()
    kept = (" " if ch.isspace() else ch for ch in text if not unicodedata.category(ch).startswith("P"))
    return " ".join("".join(kept).split())


def contains_gold(answer: Optional[str], gold: Optional[str]) -> bool:
    """The normalized gold occurs in the normalized answer as whole words (``381`` is not in ``1381``).
    An empty gold is never contained."""
    g = normalize_answer(gold)
    if not g:
        return False
    return f" {g} " in f" {normalize_answer(answer)} "


def exact_match(answer: Optional[str], reference: Optional[str]) -> bool:
    return normalize_answer(answer) == normalize_answer(reference)


@lru_cache(maxsize=1)
def _rouge_scorer():
    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)


def rouge_l(answer: Optional[str], reference: Optional[str]) -> float:
    """ROUGE-L F-measure of ``answer`` against ``reference`` with the ``rouge-score`` package.
    Two answers equal after ``normalize_answer`` (two empty ones included) score 1."""
    if exact_match(answer, reference):
        return 1.0
    return float(_rouge_scorer().score(reference or "", answer or "")["rougeL"].fmeasure)


def coverage(summary: Optional[str], parts: Sequence[Sequence[str]], depths: Sequence[float],
             middle: tuple[float, float] = MIDDLE) -> dict:
    """The share of planted events a summary names (an event counts when any of its ``parts``, the names of its
    person and place, occurs as a whole word in any case, a possessive too), over all of them, those planted in
    ``middle`` and those outside it (NaN where a group has none)."""
    found = [any(re.search(rf"\b{re.escape(p)}\b", summary or "", re.IGNORECASE) for p in names) for names in parts]
    inside = [middle[0] <= d < middle[1] for d in depths]

    def share(pick) -> float:
        xs = [f for f, i in zip(found, inside) if pick(i)]
        return sum(xs) / len(xs) if xs else math.nan

    return {COVERAGE: share(lambda i: True), COVERAGE_MIDDLE: share(lambda i: i),
            COVERAGE_ENDS: share(lambda i: not i)}


def summary_coverage(summary: Optional[str], doc: dict) -> dict:
    """Both measures for a summary of a suite summary document (``tasks.summary_documents``): the planted
    events it names (``coverage``) and where it draws its words from (``source_coverage``; a middle cut's
    summary against the whole document it was cut from, so that the middle it never saw counts)."""
    return {**coverage(summary, doc["parts"], doc["depths"]),
            **source_coverage(summary, doc.get("whole_text") or doc["text"])}


def source_scores(result, text: str) -> list[QuestionScores]:
    """``source_coverage`` of each ok answer of ``result`` (a summary) against the document's ``text``."""
    return [source_coverage(q.output, text) if q.status == "ok" else {} for q in result.questions]


BANDS = 10  # tenths of a document: four of them make the middle 30-70%
_WORD = re.compile(r"[^\W\d_]{4,}")  # letters only, four or more: names and content words, few function words


def band_words(text: str, bands: int = BANDS) -> list[set[str]]:
    """Each of ``bands`` equal shares of ``text`` (by characters, a word in the share its first letter is in):
    the words, lower-cased, that occur in it and in no other share."""
    per: list[set[str]] = [set() for _ in range(bands)]
    for m in _WORD.finditer(text):
        per[min(bands - 1, m.start() * bands // max(len(text), 1))].add(m.group().lower())
    seen = Counter(w for own in per for w in own)
    return [{w for w in own if seen[w] == 1} for own in per]


def source_coverage(summary: Optional[str], text: str, middle: tuple[float, float] = MIDDLE,
                    bands: int = BANDS) -> dict:
    """Where a summary draws from: the share of the document's tenths (``band_words``) whose own words the
    summary uses, over all tenths, those in ``middle`` and the others (a tenth with no word of its own is
    left out; NaN where a group has none). No plant needed: any document, the summary's own words."""
    said = {w.lower() for w in _WORD.findall(summary or "")}
    own = band_words(text, bands)
    inside = [middle[0] <= (i + 0.5) / bands < middle[1] for i in range(bands)]

    def share(pick) -> float:
        xs = [bool(said & words) for words, i in zip(own, inside) if words and pick(i)]
        return sum(xs) / len(xs) if xs else math.nan

    return {SOURCE: share(lambda i: True), SOURCE_MIDDLE: share(lambda i: i), SOURCE_ENDS: share(lambda i: not i)}


# -- logits ---------------------------------------------------------------------------------------------
def _logits(x: Any) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64)
    if a.ndim != 2:
        raise ValueError(f"logits must be [positions, vocab], got shape {a.shape}")
    return a


def token_nll(logits: Any, targets: Sequence[int]) -> np.ndarray:
    """Negative log-likelihood of each target token: ``logits[i]`` predicts ``targets[i]``."""
    a = _logits(logits)
    t = np.asarray(targets, dtype=np.int64)
    if t.shape != (a.shape[0],):
        raise ValueError(f"{a.shape[0]} logit rows but {t.shape} targets")
    if t.size and (t.min() < 0 or t.max() >= a.shape[1]):
        raise ValueError(f"target ids must be in [0, {a.shape[1]})")
    m = a.max(axis=1, keepdims=True)
    logz = (m + np.log(np.exp(a - m).sum(axis=1, keepdims=True)))[:, 0]
    return logz - a[np.arange(t.size), t]


def nll_per_token(logits: Any, targets: Sequence[int]) -> float:
    """Mean negative log-likelihood per target token (nats); NaN for no targets."""
    nll = token_nll(logits, targets)
    return float(nll.mean()) if nll.size else math.nan


def top1_agreement(logits_a: Any, logits_b: Any) -> float:
    """Share of positions whose argmax token is the same under both logits (ties: lowest id); NaN if empty."""
    a, b = _logits(logits_a), _logits(logits_b)
    if a.shape != b.shape:
        raise ValueError(f"logits differ in shape: {a.shape} vs {b.shape}")
    if a.shape[0] == 0:
        return math.nan
    return float(np.mean(a.argmax(axis=1) == b.argmax(axis=1)))


# -- per question ---------------------------------------------------------------------------------------
def score_answer(answer: str, gold: Optional[str] = None, reference: Optional[str] = None) -> QuestionScores:
    """The text metrics of one answer: ``correct`` when there is a gold answer, the agreement metrics
    when there is a reference answer."""
    out: QuestionScores = {}
    if gold is not None:
        out[CORRECT] = float(contains_gold(answer, gold))
    if reference is not None:
        out[AGREE_EXACT] = float(exact_match(answer, reference))
        out[ROUGE_L] = rouge_l(answer, reference)
    return out


def score_logits(logits: Any, full_logits: Any, targets: Sequence[int]) -> QuestionScores:
    """``delta_nll`` and ``top1_agreement`` of a compressed cache's logits along the reference answer
    against the full cache's logits along the same answer."""
    if len(targets) == 0:
        return {}
    return {
        DELTA_NLL: nll_per_token(logits, targets) - nll_per_token(full_logits, targets),
        TOP1: top1_agreement(logits, full_logits),
    }


def teacher_force(model, cache, question_ids: Sequence[int], answer_ids: Sequence[int]) -> np.ndarray:
    """Logits ``[len(answer_ids), vocab]`` (fp32) predicting each answer token after the question.

    Feeds the question and the answer (all but its last token, which predicts nothing we score) to the
    model in one forward pass on top of the (compressed) context in ``cache``, then trims the cache
    back to the context, so the same cache can score or answer the next question.
    """
    if not question_ids:
        raise ValueError("teacher forcing needs at least one question token")
    if not answer_ids:
        raise ValueError("teacher forcing needs at least one answer token")
    ids = list(question_ids) + list(answer_ids[:-1])
    try:
        logits = model(mx.array(ids, dtype=mx.int32)[None], cache=cache)
        out = logits[0, len(question_ids) - 1 :, :].astype(mx.float32)
        mx.eval(out)
        return np.array(out)
    finally:
        nestedkv.rewind(cache)


def evaluation_rows(run_id: str, result, scores: Sequence[QuestionScores], reference_run_id: Optional[str]) -> list[dict]:
    """Rows for ``Store.write_evaluations``: metrics against gold or the document with ``reference_run_id`` NULL,
    agreement metrics with the reference run (dropped when there is none). NaN values are not stored."""
    rows = []
    for q, s in zip(result.questions, scores):
        if q.status == TOO_LONG:  # never answered: no evaluation (its outputs row names why)
            continue
        for metric, value in (s or {}).items():
            ref = None if metric in UNREFERENCED else reference_run_id
            if (ref is None and metric not in UNREFERENCED) or value is None or math.isnan(value):
                continue
            rows.append({"run_id": run_id, "doc_id": result.doc_id, "question_idx": q.question_idx,
                         "metric": metric, "value": float(value), "reference_run_id": ref})
    return rows


# -- the reference of one document ----------------------------------------------------------------------
def gold_nll(model, cache, question_ids: Sequence[int], gold_ids: Sequence[int]) -> float:
    """Mean NLL per token of the gold answer's tokens after the question, under ``cache`` (NaN: no gold)."""
    if not gold_ids:
        return math.nan
    return nll_per_token(teacher_force(model, cache, question_ids, gold_ids), gold_ids)


def gold_targets(tokenizer, prepared) -> list[list[int]]:
    """The gold answer's token ids per question ([] where there is none)."""
    return [encode(tokenizer, g) if g else [] for _, _, g in prepared.questions]


class Reference:
    """The uncompressed answers of one document, the full cache's logits along each of them, and the
    full cache's NLL of each gold answer."""

    def __init__(self, answers: list, targets: list, logits: list, gold: list | None = None, gold_nll: list | None = None):
        self.answers = answers  # None where the reference question failed
        self.targets = targets  # the reference answers' token ids
        self.logits = logits  # [len(target), vocab] per question; None when there is nothing to score
        self.gold = gold or [[] for _ in answers]  # gold answers' token ids
        self.gold_nll = gold_nll or [math.nan for _ in answers]  # under the full cache; NaN: no gold

    @classmethod
    def build(cls, runner, prepared, res, cache) -> "Reference":
        answers, targets, logits = [], [], []
        gold = gold_targets(runner.tokenizer, prepared)
        # a question too long for the window is never fed (its row says so): no NLL
        nll = [math.nan if q.status == TOO_LONG else gold_nll(runner.model, cache, q_ids, g)
               for q, (_, q_ids, _), g in zip(res.questions, prepared.questions, gold)]
        for q, (_, q_ids, _) in zip(res.questions, prepared.questions):
            ok = q.status == "ok"
            answers.append(q.output if ok else None)
            ids = encode(runner.tokenizer, q.output) if ok else []
            targets.append(ids)
            logits.append(teacher_force(runner.model, cache, q_ids, ids) if ids else None)
        return cls(answers, targets, logits, gold, nll)

    def own_scores(self, res) -> list[QuestionScores]:
        """The reference against gold only: agreeing with itself would be trivially perfect."""
        out = []
        for k, q in enumerate(res.questions):
            s = score_answer(q.output, gold=q.gold) if q.status == "ok" else {}
            if q.status == "ok" and not math.isnan(self.gold_nll[k]):
                s[GOLD_NLL] = self.gold_nll[k]
            out.append(s)
        return out

    def score(self, runner, prepared, res, cache) -> list[QuestionScores]:
        out = []
        for k, (q, (_, q_ids, _)) in enumerate(zip(res.questions, prepared.questions)):
            if q.status != "ok":
                out.append({})
                continue
            s = score_answer(q.output, gold=q.gold, reference=self.answers[k])
            if self.logits[k] is not None:
                s.update(score_logits(teacher_force(runner.model, cache, q_ids, self.targets[k]),
                                      self.logits[k], self.targets[k]))
            s.update(self.gold_scores(runner.model, cache, k, q_ids))
            out.append(s)
        return out

    def gold_scores(self, model, cache, k: int, q_ids: Sequence[int]) -> QuestionScores:
        """``gold_nll`` and ``delta_gold_nll`` of question ``k`` under ``cache`` (the context only)."""
        if not self.gold[k]:
            return {}
        nll = gold_nll(model, cache, q_ids, self.gold[k])
        return {GOLD_NLL: nll, DELTA_GOLD_NLL: nll - self.gold_nll[k]}


# -- opt-in metric hooks: (runner, prepared, full cache, press) -> one score dict per question -----------
def gold_spans(tokenizer, context_ids: Sequence[int], answers: Sequence[Optional[str]]) -> dict[int, list[int]]:
    """question index -> context positions of its gold answer's tokens (first occurrence), trying the
    answer with and without a leading space."""
    out = {}
    for k, ans in enumerate(answers):
        if not ans:
            continue
        for variant in (" " + ans, ans):
            ids = encode(tokenizer, variant)
            n = len(ids)
            hit = next((i for i in range(len(context_ids) - n + 1) if list(context_ids[i : i + n]) == ids), None)
            if n and hit is not None:
                out[k] = list(range(hit, hit + n))
                break
    return out


def retention(full_cache, press, span: Sequence[int]) -> float:
    """Share of (layer, KV head, position in ``span``) triples ``press`` keeps, from the full cache's keys
    (each layer as it would run the press: ``nestedkv.cache.layer_press``)."""
    kept = total = 0
    for c in full_layers(full_cache):
        layer = layer_press(press, c.facts)[0] if c.facts is not None else press
        sel = layer.select(c.keys[..., : c.stored, :], unrope=c.unrope)
        if sel is None:
            return 1.0
        idx = np.array(sel.indices)[0]  # [H, K]
        ok = np.array(sel.valid)[0] if sel.valid is not None else np.ones(idx.shape, bool)
        for h in range(idx.shape[0]):
            have = set(idx[h][ok[h]].tolist())
            kept += sum(p in have for p in span)
            total += len(span)
    mx.clear_cache()
    return kept / total if total else math.nan


def gold_kept(runner, prepared, full_cache, press) -> list[QuestionScores]:
    """``gold_kept`` per question whose gold answer occurs in the context."""
    spans = gold_spans(runner.tokenizer, prepared.context_ids, [g for _, _, g in prepared.questions])
    return [{GOLD_KEPT: retention(full_cache, press, spans[k])} if k in spans else {}
            for k in range(len(prepared.questions))]


METRIC_HOOKS = {GOLD_KEPT: gold_kept}  # one per name of metrics.HOOKED_METRICS, which the settings accept
