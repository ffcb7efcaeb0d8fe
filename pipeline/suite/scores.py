"""Scoring the suite's answers (RULER's recall, written as evaluation rows against the questions table) and
reading them: calibration per (task, length), and paired comparisons of two configurations."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Optional, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

import nestedkv
from nestedkv.quant import KVQuant
from pipeline.documents import sha256_hex
from pipeline.evaluate import contains_gold, summary_coverage
from pipeline.labels import config_label as label, press_label  # noqa: F401  (the suite's names)
from pipeline.metrics import COVERAGE
from pipeline.suite.options import HEADLINE_RATIOS, LONG_FROM, QUESTIONS_FILE
from pipeline.tasks import KNOWN

RECALL = "recall"


def question_rows(docs: Sequence[dict]) -> list[dict]:
    return [{"doc_id": d["doc_id"], "content_sha256": sha256_hex(d["text"]), "question_idx": k, "task": d["task"],
             "length": d["length"], "n_tokens": d["n_tokens"], "kind": d["kinds"][k], "parts": d["parts"][k]}
            for d in docs for k in range(len(d["questions"]))]


def register(store, docs: Sequence[dict], folder: Path) -> None:
    """Put the documents' questions into ``suite_questions`` (replacing the same documents' rows), and beside
    the suite as Parquet."""
    rows = question_rows(docs)
    pq.write_table(pa.Table.from_pylist(rows), (folder / QUESTIONS_FILE).resolve())
    store.write_suite_questions(rows)


def recall(answer: Optional[str], parts: Sequence[str]) -> float:
    """RULER's string_match_all: the share of ``parts`` contained in the answer (as ``contains_gold``)."""
    return sum(contains_gold(answer, p) for p in parts) / len(parts) if parts else math.nan


def score(store) -> int:
    """Write a ``recall`` evaluation row for every ok suite answer that has none yet; returns how many."""
    rows = store.unscored_suite_answers()
    if rows:
        store.write_evaluations([{"run_id": r["run_id"], "doc_id": r["doc_id"], "question_idx": r["question_idx"],
                                  "metric": RECALL, "value": recall(r["output"], r["parts"]),
                                  "reference_run_id": None} for r in rows])
    return len(rows)


def score_coverage(store, docs: Sequence[dict]) -> int:
    """Write the coverage rows (``evaluate.summary_coverage``: the planted events a summary names and the
    document's tenths it draws words from, overall, in the middle, at the ends) of every ok summary of these
    documents that has none yet; returns how many."""
    plants = {sha256_hex(d["text"]): d for d in docs if d.get("parts")}
    rows = store.unscored_outputs(list(plants), COVERAGE)
    out = []
    for r in rows:
        d = plants[r["content_sha256"]]
        for metric, value in summary_coverage(r["output"], d).items():
            out.append({"run_id": r["run_id"], "doc_id": r["doc_id"], "question_idx": r["question_idx"],
                        "metric": metric, "value": value, "reference_run_id": None})
    if out:
        store.write_evaluations(out)
    return len(rows)


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def calibration(scores: Sequence[dict], threshold: float) -> list[dict]:
    """Uncompressed accuracy per (task, length), and whether the cell enters the headline."""
    cells = defaultdict(list)
    for s in scores:
        if s["press"] == "no_press":
            cells[(s["task"], s["length"])].append(s["value"])
    out = []
    for (task, length), vals in sorted(cells.items(), key=lambda kv: (kv[0][1], KNOWN.index(kv[0][0]))):
        acc = _mean(vals)
        out.append({"task": task, "length": length, "n": len(vals), "accuracy": acc, "headline": acc >= threshold})
    return out


def paired(scores: Sequence[dict], a: dict, b: dict, cells: set, lower_is_better: bool = False) -> dict:
    """Per question in ``cells``: configuration ``a``'s score against ``b``'s (each a dict of press, head
    budget, prefill, ratio, ``quant`` (a KVQuant), or a config hash), as counts better / worse / same, the mean difference a - b and
    its standard error."""

    def pick(cfg):  # a dict of fields, or a config hash
        same = (lambda s: s["config_hash"] == cfg) if isinstance(cfg, str) else \
            (lambda s: all(KVQuant.from_fields(s) == v if k == "quant" else s.get(k) == v for k, v in cfg.items()))
        return {(s["doc_id"], s["question_idx"]): s["value"] for s in scores if (s["task"], s["length"]) in cells
                and same(s)}

    xa, xb = pick(a), pick(b)
    d = [xa[k] - xb[k] for k in xa.keys() & xb.keys()]
    n = len(d)
    mean = _mean(d)
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1) / n) if n > 1 else math.nan
    sign = -1 if lower_is_better else 1
    return {"n": n, "better": sum(sign * x > 0 for x in d), "worse": sum(sign * x < 0 for x in d),
            "same": sum(x == 0 for x in d),
            "mean_diff": mean, "se": se, "acc_a": _mean([xa[k] for k in xa.keys() & xb.keys()]),
            "acc_b": _mean([xb[k] for k in xa.keys() & xb.keys()])}


def rivals(scores: Sequence[dict], a: str = "nestedkv") -> list[str]:
    """The presses ``a`` is paired against: every other compressed press in the scores, in the registry's
    order (KeyDiff, KVzip, Expected Attention, ... as the suite ran them)."""
    order = list(nestedkv.PRESSES)
    present = {s["press"] for s in scores} - {a, "no_press"}
    return sorted(present, key=lambda p: (order.index(p) if p in order else len(order), p))


def headline(scores: Sequence[dict], calib: Sequence[dict], ratios=HEADLINE_RATIOS,
             long_from: int = LONG_FROM, lower_is_better: bool = False) -> tuple[list[dict], set]:
    """NestedKV against each other press (``rivals``) per ratio, budget mode and prefill mode on the headline
    cells (calibrated, at the long lengths when the suite has any, else at all). A pairing needs both presses
    in the same mode: one that scores with the model runs whole-prefill only, so it has no streaming rows."""
    lengths = sorted({c["length"] for c in calib})
    long = [n for n in lengths if n >= long_from] or lengths
    cells = {(c["task"], c["length"]) for c in calib if c["headline"] and c["length"] in long}
    # a mode is every setting but the press: rotated and unrotated 4-bit keys are two modes, never one
    modes = sorted({(s["head_budget"], s["prefill"], KVQuant.from_fields(s)) for s in scores
                    if s["press"] == "nestedkv"}, key=lambda m: (m[0], m[1], m[2].sort_key()))
    out = []
    for rival in rivals(scores):
        for r in ratios:
            for hb, pf, quant in modes:
                cfg = {"compression_ratio": r, "head_budget": hb, "prefill": pf, "quant": quant}
                p = paired(scores, {"press": "nestedkv", **cfg}, {"press": rival, **cfg}, cells, lower_is_better)
                if p["n"]:
                    out.append({"rival": rival, "ratio": r, "head_budget": hb, "prefill": pf, "kv_bits": quant.bits,
                                "quant": quant, **p})
    for rival in rivals(scores):
        for r in ratios:  # the best NestedKV budget mode per ratio and rival (by its own accuracy), marked
            rows = [h for h in out if h["ratio"] == r and h["rival"] == rival]
            if rows:
                (min if lower_is_better else max)(rows, key=lambda h: h["acc_a"])["best"] = True
    return out, cells
