"""Per-scale ablation of NestedKV: which part of the score helps or hurts, on the same documents.

Variants of ``NestedKVPress`` (each scale alone, all scales without the surprise gate, the full method, in
uniform or adaptive head budgets) and optional baselines, all compressed from ONE prefill per document
and scored against the same uncompressed reference as ``nkv eval``: an evaluation over press variants
(``pipeline.engine``), with the ``gold_kept`` metric. The result is a table. The variants use the method's fixed constants: this is a
diagnosis, not a search over constants.

    nkv ablation --input data/eval_set.parquet --compression-ratio 0.75,0.9 [--out reports/ablation.md]
"""

from __future__ import annotations

import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, Callable, Optional, Sequence

import pyarrow.parquet as pq
from pydantic import Field

from pipeline import models, tables
from pipeline.config import DEFAULT_MODEL, RunConfig
from pipeline.engine import EngineOptions, Hooks, run
from pipeline.store import Store
from pipeline.suite.options import HEADLINE_RATIOS
from pipeline.suite.variants import VARIANTS, check_variants, variant_configs
from pipeline.evaluate import AGREE_EXACT, CORRECT, DELTA_NLL, GOLD_KEPT, ROUGE_L, TOP1

METRICS = (CORRECT, AGREE_EXACT, ROUGE_L, DELTA_NLL, TOP1, GOLD_KEPT)


ABLATION_NEW_TOKENS = 24  # the evaluation set's answers are short


def ablate(
    input: str,
    compression_ratio: Annotated[Sequence[float], Field(description="the ratios")] = HEADLINE_RATIOS,
    variants: Annotated[Optional[Sequence[str]], Field(description="the variants (default: all)",
                                                       json_schema_extra={"choices": lambda: tuple(VARIANTS)})] = None,
    model: str = DEFAULT_MODEL,
    max_new_tokens: Annotated[int, Field(description="tokens per answer at most")] = ABLATION_NEW_TOKENS,
    prefill_step_size: Annotated[int, Field(description="context tokens per prefill chunk")] = 512,
    limit: Annotated[Optional[int], Field(description="only the first N documents")] = None,
    db: Annotated[Optional[str], Field(description="keep the rows in this store (default: a temporary "
                                                   "one)")] = None,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
) -> tuple[list[dict], dict]:
    """Mean metrics per (variant, ratio) and per-question values keyed by (variant, ratio, doc, question).

    An evaluation through the engine (one prefill per document, batched decode, the ``gold_kept`` hook);
    the rows land in ``db`` (a temporary store when None)."""
    names, ratios = list(variants or VARIANTS), list(compression_ratio)
    check_variants(names)
    base = RunConfig(task="qa", model=model, press="no_press", compression_ratio=0.0,
                     max_new_tokens=max_new_tokens, prefill_step_size=prefill_step_size)
    configs = {models.keyed(c): key for c, key in variant_configs(base, names, ratios).items()}
    with tempfile.TemporaryDirectory(prefix="nkv-ablation-") as tmp:
        source = input if not limit else _first(input, limit, Path(tmp))
        store_path = db or str(Path(tmp) / "ablation.duckdb")
        t0 = time.perf_counter()
        hooks = Hooks(on_document=lambda i, n, doc, _: log(f"[{i}/{n}] {doc.doc_id}: {time.perf_counter() - t0:.0f} s"))
        summary = run(source, list(configs), store_path,
                      EngineOptions(evaluate=True, batch_decode=True, metrics=(GOLD_KEPT,)), hooks=hooks)
        for o in summary.outcomes:
            if o.result.status != "ok":
                log(f"{o.result.doc_id} {o.config.label()}: {o.result.error}")
        with Store(store_path, read_only=True) as store:
            hashes = {c.config_hash(): key for c, key in configs.items()}
            got = store.evaluations_by_config()
    per_q: dict[tuple, dict] = {}
    for g in got:
        name, r = hashes[g["config_hash"]]
        per_q.setdefault((name, r, g["doc_id"], g["question_idx"]), {})[g["metric"]] = g["value"]
    rows = []
    for name, r in [("no_press", 0.0)] + [(n, r) for n in names for r in ratios]:
        vals = [v for (vn, vr, _, _), v in per_q.items() if vn == name and vr == r]
        row = {"variant": name, "compression_ratio": r, "n": len(vals)}
        for m in METRICS:
            xs = [v[m] for v in vals if m in v and not math.isnan(v[m])]
            row[m] = sum(xs) / len(xs) if xs else None
        rows.append(row)
    return rows, per_q


def _first(input: str, limit: int, folder: Path) -> str:
    """The first ``limit`` rows of ``input`` as a Parquet file of their own."""
    path = folder / "first.parquet"
    pq.write_table(pq.read_table(input).slice(0, limit), path)
    return str(path)


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
    f = lambda v, fmt: None if v is None else fmt.format(v)  # noqa: E731
    header = ["variant", "ratio", "questions", "accuracy", "agree exact", "ROUGE-L", "delta NLL", "top-1 agree",
              "gold kept"]
    cells = [[r["variant"], f"{r['compression_ratio']:.2f}", r["n"], f(r[CORRECT], "{:.3f}"),
              f(r[AGREE_EXACT], "{:.3f}"), f(r[ROUGE_L], "{:.3f}"), f(r[DELTA_NLL], "{:+.3f}"), f(r[TOP1], "{:.3f}"),
              f(r[GOLD_KEPT], "{:.3f}")] for r in rows]
    return "\n".join(tables.markdown(header, cells, align=["l"] + ["r"] * 8))


def summary_text(rows: list[dict], per_q: dict, ratios: list[float]) -> str:
    """The table, then each variant against KeyDiff at each ratio, question by question (correct)."""
    pairs = []
    for r in ratios:
        for name in VARIANTS:
            if name != "keydiff" and any(k[0] == name for k in per_q) and any(k[0] == "keydiff" for k in per_q):
                w, l, t = paired(per_q, (name, r), ("keydiff", r))
                pairs.append(f"- r={r:.2f} {name} vs keydiff (correct): {w} better, {l} worse, {t} same")
    return to_markdown(rows) + "\n\n" + "\n".join(pairs) + "\n"
