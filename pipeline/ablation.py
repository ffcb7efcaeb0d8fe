"""Per-scale ablation of NestedKV: which part of the score helps or hurts, on the same documents.

Variants of ``NestedKVPress`` (each scale alone, all scales without the surprise gate, the full method, in
uniform or adaptive head budgets) and optional baselines, all compressed from ONE prefill per document
and scored against the same uncompressed reference as ``nkv eval`` (``pipeline.sweep`` machinery).
Nothing is stored; the result is a table. The variants use the method's fixed constants: this is a
diagnosis, not a search over constants.

    python -m pipeline.ablation --input data/eval_set.parquet --compression-ratio 0.75,0.9 [--out reports/ablation.md]
"""

from __future__ import annotations

import pipeline  # noqa: F401  (loads OpenBLAS before mlx)

import argparse
import copy
import math
import sys
import time
from typing import Callable, Optional

from nestedkv.press import BasePress, KeyDiffPress, NestedKVPress, NoPress
from pipeline.config import RunConfig
from pipeline.documents import load_documents
from pipeline.evaluate import AGREE_EXACT, CORRECT, DELTA_NLL, ROUGE_L, TOP1
from pipeline.results import ERROR
from pipeline.sweep import _answer_together, _compress, _Reference, install_attention_hook

# name -> press factory for a compression ratio
VARIANTS: dict[str, Callable[[float], BasePress]] = {
    "nestedkv": lambda r: NestedKVPress(compression_ratio=r),
    "nestedkv adaptive": lambda r: NestedKVPress(compression_ratio=r, head_budget="adaptive"),
    "no gate": lambda r: NestedKVPress(compression_ratio=r, use_gate=False),
    "stable only": lambda r: NestedKVPress(compression_ratio=r, scales=(True, False, False)),
    "block only": lambda r: NestedKVPress(compression_ratio=r, scales=(False, True, False)),
    "window only": lambda r: NestedKVPress(compression_ratio=r, scales=(False, False, True)),
    "stable+block": lambda r: NestedKVPress(compression_ratio=r, scales=(True, True, False)),
    "stable+window": lambda r: NestedKVPress(compression_ratio=r, scales=(True, False, True)),
    "block+window": lambda r: NestedKVPress(compression_ratio=r, scales=(False, True, True)),
    "keydiff": lambda r: KeyDiffPress(compression_ratio=r),
    "keydiff adaptive": lambda r: KeyDiffPress(compression_ratio=r, head_budget="adaptive"),
}
GOLD_KEPT = "gold_kept"  # share of the gold answer's context tokens kept, over layers and KV heads
METRICS = (CORRECT, AGREE_EXACT, ROUGE_L, DELTA_NLL, TOP1, GOLD_KEPT)


def ablate(
    input: str,
    ratios: list[float],
    variants: Optional[list[str]] = None,
    model: str = "smollm2-135m",
    max_new_tokens: int = 24,
    prefill_step_size: int = 512,
    limit: Optional[int] = None,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
) -> tuple[list[dict], dict]:
    """Mean metrics per (variant, ratio) and per-question values keyed by (variant, ratio, doc, question)."""
    from pipeline.batch import make_runner

    names = variants or list(VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    base = RunConfig(task="qa", model=model, press="no_press", compression_ratio=0.0,
                     max_new_tokens=max_new_tokens, prefill_step_size=prefill_step_size)
    runner = make_runner(base)
    docs, _ = load_documents(input)
    docs = docs[:limit] if limit else docs
    per_q: dict[tuple, dict] = {}
    for d, doc in enumerate(docs, 1):
        t0 = time.perf_counter()
        shell, prepared = runner.start(doc)
        if prepared is None:
            log(f"skip {doc.doc_id}: {shell.error}")
            continue
        full = runner.prefill(prepared, shell, press=NoPress())
        ref_res = copy.deepcopy(shell)
        ref_cache = _clone(runner, full, NoPress())
        runner.finish(ref_cache, prepared, ref_res)
        reference = _Reference.build(runner, prepared, ref_res, ref_cache)
        for k, s in enumerate(reference.own_scores(ref_res)):
            per_q[("no_press", 0.0, doc.doc_id, k)] = s
        spans = gold_spans(runner.tokenizer, prepared.context_ids, doc.answers or [])
        caches, results = {}, {}
        for name in names:
            for r in ratios:
                key = (name, r)
                press = VARIANTS[name](r)
                for k, span in spans.items():
                    per_q.setdefault((name, r, doc.doc_id, k), {})["gold_kept"] = retention(full, press, span)
                results[key] = copy.deepcopy(shell)
                caches[key] = _clone(runner, full, press)
                _compress(caches[key], results[key])
        scores = _answer_together(runner, prepared, caches, results, reference)
        for key, ss in scores.items():
            if results[key].status == ERROR:
                log(f"{doc.doc_id} {key}: {results[key].error}")
            for k, s in enumerate(ss):
                per_q.setdefault((*key, doc.doc_id, k), {}).update(s)
        log(f"[{d}/{len(docs)}] {doc.doc_id}: {time.perf_counter() - t0:.0f} s")
    rows = []
    for name, r in [("no_press", 0.0)] + [(n, r) for n in names for r in ratios]:
        vals = [v for (vn, vr, _, _), v in per_q.items() if vn == name and vr == r]
        row = {"variant": name, "compression_ratio": r, "n": len(vals)}
        for m in METRICS:
            xs = [v[m] for v in vals if m in v and not math.isnan(v[m])]
            row[m] = sum(xs) / len(xs) if xs else None
        rows.append(row)
    return rows, per_q


def gold_spans(tokenizer, context_ids: list[int], answers: list[str]) -> dict[int, list[int]]:
    """question index -> context positions of its gold answer's tokens (first occurrence; the planted
    answers occur once), trying the answer with and without a leading space."""
    from pipeline.prompts import encode

    out = {}
    for k, ans in enumerate(answers):
        for variant in (" " + ans, ans):
            ids = encode(tokenizer, variant)
            n = len(ids)
            hit = next((i for i in range(len(context_ids) - n + 1) if context_ids[i : i + n] == ids), None)
            if n and hit is not None:
                out[k] = list(range(hit, hit + n))
                break
    return out


def retention(full, press: BasePress, span: list[int]) -> float:
    """Share of (layer, KV head, gold position) triples the press keeps, from the full cache's keys."""
    import mlx.core as mx
    import numpy as np

    kept = total = 0
    for c in full:
        sel = press.select(c.keys[..., : c.stored, :])
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


def _clone(runner, full, press: BasePress):
    import nestedkv

    if press.head_budget == "adaptive":
        install_attention_hook(runner.model)
    return nestedkv.clone(full, press)


def paired(per_q: dict, a: tuple, b: tuple, metric: str = CORRECT) -> tuple[int, int, int]:
    """(questions a got right and b wrong, b right and a wrong, both the same) for two (variant, ratio)."""
    wins = losses = ties = 0
    for (vn, vr, doc, k), s in per_q.items():
        if (vn, vr) != a or metric not in s:
            continue
        other = per_q.get((*b, doc, k), {})
        if metric not in other:
            continue
        if s[metric] > other[metric]:
            wins += 1
        elif s[metric] < other[metric]:
            losses += 1
        else:
            ties += 1
    return wins, losses, ties


def to_markdown(rows: list[dict]) -> str:
    head = "| variant | ratio | questions | accuracy | agree exact | ROUGE-L | delta NLL | top-1 agree | gold kept |"
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    f = lambda v, fmt: "-" if v is None else fmt.format(v)  # noqa: E731
    for r in rows:
        lines.append(f"| {r['variant']} | {r['compression_ratio']:.2f} | {r['n']} | {f(r[CORRECT], '{:.3f}')} | "
                     f"{f(r[AGREE_EXACT], '{:.3f}')} | {f(r[ROUGE_L], '{:.3f}')} | {f(r[DELTA_NLL], '{:+.3f}')} | "
                     f"{f(r[TOP1], '{:.3f}')} | {f(r[GOLD_KEPT], '{:.3f}')} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", default="data/eval_set.parquet")
    p.add_argument("--compression-ratio", default="0.75,0.9")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--limit", type=int, default=None, help="only the first N documents")
    p.add_argument("--out", default=None, help="also write the table as markdown here")
    a = p.parse_args(argv)
    ratios = [float(x) for x in a.compression_ratio.split(",") if x.strip()]
    rows, per_q = ablate(a.input, ratios, [v.strip() for v in a.variants.split(",") if v.strip()], a.model,
                         a.max_new_tokens, limit=a.limit)
    md = to_markdown(rows)
    pairs = []
    for r in ratios:
        for name in VARIANTS:
            if name != "keydiff" and any(k[0] == name for k in per_q) and any(k[0] == "keydiff" for k in per_q):
                w, l, t = paired(per_q, (name, r), ("keydiff", r))
                pairs.append(f"- r={r:.2f} {name} vs keydiff (correct): {w} better, {l} worse, {t} same")
    text = md + "\n\n" + "\n".join(pairs) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(text)


if __name__ == "__main__":
    main()
