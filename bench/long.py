"""``nkv bench long``: documents longer than the model's window, read each way ``--long-docs`` offers.
``--task summarize``: the suite's summary documents instead (planted events at every depth), scored by the
events the summary names overall, in the middle 30-70% and at the ends.

Needles are planted in the middle 30-70% of stretches of the novels (the suite's ``niah_middle`` task) at each
length; a document that fits the window is answered uncompressed (the ceiling); a longer one is cut in the middle
(no_press, ``truncate``), in parts (``map_reduce``, each part compressed by NestedKV at its defaults), and
read whole while evicting (``stream``) with each press at its default settings.
Per way and length: recall (RULER's string match), the gold answer's NLL per token under the cache it is
answered from (map-reduce: its best part), wall time per document, prefill tokens/s and the peak KV bytes while
prefilling; for map-reduce also the recall had it kept each question's most likely answer instead. ``rates``: a streaming prefill of the novels' text at each length with a fixed budget,
read past the window as ``--long-docs stream`` reads it (prefill tokens/s and peak KV bytes by length).
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Annotated, Callable, Literal, Optional, Sequence

import mlx.core as mx

from pydantic import Field

import nestedkv
from nestedkv.press import get_press
from pipeline import models  # models.load_model looked up at each call: tests stand a tiny model in for it
from pipeline.config import RunConfig
from pipeline.documents import Document
from pipeline.evaluate import gold_nll, summary_coverage
from pipeline.metrics import (COVERAGE, COVERAGE_ENDS, COVERAGE_METRICS, COVERAGE_MIDDLE, SOURCE, SOURCE_ENDS,
                              SOURCE_MIDDLE)
from pipeline.models.shape import model_info
from pipeline.prompts import encode
from pipeline.runner import Runner, prefill
from pipeline.suite.scores import recall
from pipeline.tasks.build import generate, summary_documents, token_counter
from pipeline.tasks.text import haystack

Log = Callable[[str], None]
# A summary's length; qa: the suite's 32, since a small model restates the question before the needle's value.
NEW_TOKENS = {"qa": 32, "summarize": 128}


def ways(presses: Sequence[str], fits: bool) -> list[tuple[str, dict]]:
    """(label, RunConfig fields) for each way of reading one document."""
    if fits:  # the ceiling; the other ways read a document that fits as it is
        return [("uncompressed", {"press": "no_press", "long_docs": "refuse"})]
    out = [("middle cut", {"press": "no_press", "long_docs": "truncate"}),
           ("map-reduce", {"press": "nestedkv", "long_docs": "map_reduce"})]  # each part compressed as usual
    return out + [(f"stream {p}", {"press": p, "long_docs": "stream"}) for p in presses]


def run(model_ref: str, lengths: Annotated[Sequence[int], Field(description="document lengths")] = (6554, 20480),
        per_length: Annotated[int, Field(description="documents per length (0: none)")] = 2,
        presses: Annotated[Sequence[str], Field(description="the presses that stream")] = ("nestedkv", "keydiff", "streaming_llm"),
        max_new_tokens: Annotated[Optional[int], Field(description="tokens per output at most (default " + ", ".join(
            f"{n} for {t}" for t, n in NEW_TOKENS.items()) + ")")] = None,
        seed: Annotated[int, Field(description="the documents' seed")] = 0,
        austen: Annotated[Optional[str], Field(description="folder with the Austen .txt files")] = None,
        window: Annotated[Optional[int], Field(description="treat the model's window as this many tokens (default: its own)")] = None,
        task: Annotated[Literal["qa", "summarize"], Field(description="qa (needles in the middle: recall) or summarize "
                                                    "(planted events: coverage by depth)")] = "qa",
        log: Log = print) -> dict:
    """``window``: treat the model's window as this many tokens (a smaller one than its own puts a weak
    model's lengths past it; the positions, memory and eviction then work as they would past the real one).
    ``task``: qa (needles in the middle, recall) or summarize (the suite's summary documents with planted
    events, coverage overall, in the middle and at the ends: ``evaluate.summary_coverage``). ``max_new_tokens``: by
    default the task's ``NEW_TOKENS``."""
    if task not in NEW_TOKENS:
        raise ValueError(f"task must be qa or summarize, got {task!r}")
    max_new_tokens = max_new_tokens or NEW_TOKENS[task]
    model, tokenizer = models.load_model(model_ref)
    window = window or model_info(model).get("max_position_embeddings")
    count = token_counter(tokenizer)
    docs = generate(count, lengths, per_length, seed, tasks=["niah_middle"], austen=Path(austen) if austen else None) \
        if task == "qa" else summary_documents(count, lengths, per_length, seed, Path(austen) if austen else None)
    rows = []
    for d in docs:
        doc = Document(doc_id=d["doc_id"], text=d["text"], questions=d["questions"], answers=d["answers"])
        for label, fields in ways(presses, fits=window is None or d["n_tokens"] + 64 + max_new_tokens <= window):
            cfg = RunConfig(task=task, model=model_ref, max_new_tokens=max_new_tokens, **fields)
            runner = Runner(model, tokenizer, cfg, max_context=window)
            nll, seen = gold_nlls(runner, d["answers"]) if task == "qa" else ({}, {})
            t0 = time.perf_counter()
            res = runner.run(doc)
            wall = time.perf_counter() - t0
            if task == "summarize":
                got = summary_coverage(res.questions[0].output, d) \
                    if res.questions and res.questions[0].status == "ok" else {}
                rows.append({**summary_row(d, label, res, wall), **{k: [v] for k, v in got.items()},
                             "recall": []})
                log(f"{d['doc_id']} ({d['n_tokens']} tokens) {label}: {res.status}, coverage "
                    f"{got.get(COVERAGE, float('nan')):.2f}, {wall:.0f} s")
                continue
            scores = [recall(q.output, parts) for q, parts in zip(res.questions, d["parts"]) if q.status == "ok"]
            rows.append({**summary_row(d, label, res, wall), "recall": scores,
                         "gold_nll": [min(v) for v in nll.values()]})
            if res.read_mode == "map_reduce":  # the other rule map-reduce could pick by, on the same answers
                rows[-1]["recall_by_answer"] = [recall(max(seen[k], key=lambda q: q.logprob).output, parts)
                                                for k, parts in enumerate(d["parts"]) if seen.get(k)]
            log(f"{d['doc_id']} ({d['n_tokens']} tokens) {label}: {res.status}, recall "
                f"{sum(scores) / len(scores) if scores else float('nan'):.2f}, {wall:.0f} s")
    table = summarize(rows)
    for r in table:
        quality = (f"coverage {r[COVERAGE]:.3f} middle {r[COVERAGE_MIDDLE]:.3f} ends {r[COVERAGE_ENDS]:.3f}, "
                   f"source words {r[SOURCE]:.3f} middle {r[SOURCE_MIDDLE]:.3f} ends {r[SOURCE_ENDS]:.3f} "
                   f"({r['documents']} documents)") if task == "summarize" else \
            f"recall {r['recall']:.3f} ({r['questions']} questions)  gold NLL {r['gold_nll']:.3f}"
        log(f"{r['length']:>7} {r['way']:<22} {quality}  {r['wall_s']:.0f} s/doc  prefill "
            f"{r['prefill_tok_s'] or 0:.0f} tok/s  peak KV {r['peak_kv_mib']:.1f} MiB" +
            (f"  (by the answer's likelihood: recall {r['recall_by_answer']:.3f})" if "recall_by_answer" in r else ""))
    return {"model": model_ref, "window": window, "task": task, "rows": rows, "table": table}


def summary_row(d: dict, label: str, res, wall: float) -> dict:
    return {"length": d["length"], "n_tokens": d["n_tokens"], "doc_id": d["doc_id"], "way": label,
            "read_mode": res.read_mode, "status": res.status, "wall_s": wall,
            "prefill_tok_s": res.n_tokens / res.prefill_s if res.prefill_s else None,
            "peak_kv_prefill_bytes": res.peak_kv_prefill_bytes}


def gold_nlls(runner, golds: Sequence[str]) -> tuple[dict[int, list[float]], dict[int, list]]:
    """Question -> the gold answer's NLL per token under each cache ``runner`` answers it from, and question
    -> the answers given there (filled as it runs: one cache, or one per part)."""
    seen: dict[int, list[float]] = {}
    answers: dict[int, list] = {}
    answer_all = runner.answer_all

    def scoring(cache, prepared, res):
        for k, (_, q_ids, _) in enumerate(prepared.questions):
            if k < len(golds) and golds[k] and res.questions[k].status == "ok":
                seen.setdefault(k, []).append(gold_nll(runner.model, cache, q_ids, encode(runner.tokenizer, golds[k])))
        out = answer_all(cache, prepared, res)
        for k, q in enumerate(out.questions):
            if q.status == "ok":
                answers.setdefault(k, []).append(copy.copy(q))
        return out

    runner.answer_all = scoring
    return seen, answers


def summarize(rows: Sequence[dict]) -> list[dict]:
    """One row per (length, way): mean recall over the questions answered, mean gold NLL, mean wall time,
    prefill rate and the largest peak KV."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["length"], r["way"]), []).append(r)
    table = []
    for (length, way), rs in groups.items():
        scores = [s for r in rs for s in r["recall"]]
        rates = [r["prefill_tok_s"] for r in rs if r["prefill_tok_s"]]
        nll = [v for r in rs for v in r.get("gold_nll", ())]
        by_answer = [s for r in rs for s in r.get("recall_by_answer", ())]
        cover = {m: [v for r in rs for v in r.get(m, ()) if v == v] for m in COVERAGE_METRICS}  # NaN: none there
        table.append({"length": length, "way": way, "questions": len(scores), "documents": len(rs),
                      **{m: sum(v) / len(v) if v else float("nan") for m, v in cover.items()},
                      "recall": sum(scores) / len(scores) if scores else float("nan"),
                      **({"recall_by_answer": sum(by_answer) / len(by_answer)} if by_answer else {}),
                      "gold_nll": sum(nll) / len(nll) if nll else float("nan"),
                      "wall_s": sum(r["wall_s"] for r in rs) / len(rs),
                      "prefill_tok_s": sum(rates) / len(rates) if rates else None,
                      "peak_kv_mib": max(r["peak_kv_prefill_bytes"] for r in rs) / 2**20})
    return table


def rates(model_ref: str, lengths: Annotated[Sequence[int], Field(description="also time a streaming prefill of these lengths")],
          budget: Annotated[int, Field(description="tokens kept per head", json_schema_extra={"flags": ["--budget"]})
                            ] = 1024,
          press: Annotated[str, Field(description="the press that streams")] = "nestedkv",
          chunk: Annotated[int, Field(description="prefill chunk size")] = 512,
          austen: Optional[str] = None, log: Log = print) -> list[dict]:
    """Streaming prefill tokens/s and peak KV bytes of ``press`` keeping ``budget`` rows per head, at each
    length (the window's positions as a 64-token question and 16-token answer would leave them)."""
    model, tokenizer = models.load_model(model_ref)
    window = model_info(model).get("max_position_embeddings")
    text = " ".join(s.text for s in haystack(Path(austen) if austen else None))
    base = encode(tokenizer, text)
    out = []
    for n in lengths:
        ids = (base * (n // len(base) + 1))[:n]
        streaming = get_press(press, budget=budget, prefill="streaming")
        positions = window - 80 if window and n + 80 > window else None
        cache = nestedkv.make_cache(model, streaming, context_len=n, positions=positions)
        t0 = time.perf_counter()
        prefill(model, cache, ids, chunk)
        nestedkv.compress(cache)
        wall = time.perf_counter() - t0
        peak = sum(nestedkv.peak_kv_bytes(cache))
        out.append({"length": n, "press": press, "budget": budget, "tok_s": n / wall, "wall_s": wall,
                    "peak_kv_mib": peak / 2**20, "past_window": positions is not None})
        log(f"{n:>7} tokens  {press} budget {budget}: {n / wall:.0f} tok/s ({wall:.0f} s), peak KV "
            f"{peak / 2**20:.1f} MiB" + ("  (past the window)" if positions else ""))
        del cache
        mx.clear_cache()
    return out
