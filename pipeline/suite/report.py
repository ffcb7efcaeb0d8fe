"""The suite's report: markdown tables (calibration, headline, accuracy per task and length, the ablation,
summaries) and the quality-memory frontier plot."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Optional, Sequence

from matplotlib import colormaps
from matplotlib.colors import to_hex
from matplotlib.figure import Figure  # no pyplot: no global backend state, renders with Agg

from pipeline import tables
from pipeline.documents import sha256_hex
from pipeline.evaluate import DELTA_GOLD_NLL
from pipeline.metrics import COVERAGE, COVERAGE_METRICS, DELTA_NLL, ROUGE_L, SOURCE
from pipeline.suite.options import MARKDOWN_NAME, PLOT_NAME, SUITE_FILE, SUMMARY_FILE, SuiteOptions, SuiteResult
import nestedkv
from nestedkv.quant import KVQuant
from pipeline.suite.scores import RECALL, _mean, calibration, headline, label, paired, press_label, rivals
from pipeline.tasks import KNOWN, length_label

def _rank(press: str) -> int:
    """A press's place in the tables: the registry's order."""
    order = list(nestedkv.PRESSES)
    return order.index(press) if press in order else -1


def colour(press: str) -> str:
    """A press's colour in the plots, by its place in the registry (matplotlib's cycle, then the light shades
    of tab20 past its ninth; C9 for others)."""
    rank = _rank(press)
    if rank < 0:
        return "C9"
    return f"C{rank}" if rank < 9 else to_hex(colormaps["tab20"](2 * (rank - 9) % 20 + 1))


def _fmt(x: float, digits: int = 2) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _table(header: Sequence[str], rows: Sequence[Sequence]) -> list[str]:
    return tables.markdown(header, rows)


def accuracy_tables(scores: Sequence[dict], calib: Sequence[dict], mib: dict, nll: Sequence[dict] = (),
                    cost: Optional[dict] = None) -> list[str]:
    """Per length: one row per configuration (every press against the uncompressed model), one column per
    task, then the calibrated cells' mean accuracy, its share of the uncompressed one, delta gold NLL
    (``nll``: that metric's scores), resident KV, and what compression cost (``cost``: ``costs``)."""
    ok = {(c["task"], c["length"]) for c in calib if c["headline"]}
    cost = cost or {}
    nll_by = defaultdict(list)
    for s in nll:
        if (s["task"], s["length"]) in ok:
            nll_by[(s["length"], s["config_hash"])].append(s["value"])
    by = defaultdict(list)
    for s in scores:
        by[(s["length"], s["config_hash"])].append(s)
    lines = []
    for length in sorted({s["length"] for s in scores}):
        tasks = [t for t in KNOWN if any(s["task"] == t and s["length"] == length for s in scores)]
        full = _mean([s["value"] for s in scores if s["length"] == length and s["press"] == "no_press"
                      and (s["task"], s["length"]) in ok])
        rows = []
        for (n, h), ss in by.items():
            if n != length:
                continue
            s0 = ss[0]
            ref = s0["press"] == "no_press"
            cells = [_fmt(_mean([s["value"] for s in ss if s["task"] == t])) for t in tasks]
            calibrated = _mean([s["value"] for s in ss if (s["task"], s["length"]) in ok])
            c = cost.get((length, h), {})
            rows.append(((not ref, s0["press"], s0["head_budget"], s0["prefill"],
                          KVQuant.from_fields(s0).sort_key(), s0["compression_ratio"]),  # 16 bits first
                         [label(s0), "-" if ref else f"{s0['compression_ratio']:g}", *cells, _fmt(calibrated),
                          "-" if ref else _fmt(calibrated / full if full else math.nan),
                          "-" if ref else _fmt(_mean(nll_by.get((length, h), [])), 3),
                          _fmt(mib.get((length, h)), 2), "-" if ref else _fmt(c.get("compress_s"), 2),
                          "-" if ref else _fmt(overhead(cost, length, h), 2)]))
        rows.sort(key=lambda r: (r[0][0], _rank(r[0][1]), *r[0][2:]))
        lines += [f"### {length_label(length)} ({length} tokens)", ""]
        lines += _table(["configuration", "r", *tasks, "calibrated cells", "of uncompressed", "delta gold NLL",
                         "resident KV MiB/doc", "compress s/doc", "compress / prefill"], [r for _, r in rows])
        lines.append("")
    return lines


def ablation_table(scores: Sequence[dict], calib: Sequence[dict], variants: dict, min_length: int,
                   metric: str = "accuracy") -> list[str]:
    """NestedKV's variants on the calibrated cells of at least ``min_length`` tokens: the metric (accuracy, or
    delta gold NLL: lower is better) per length, and paired against the full method (uniform) at the same ratio."""
    lower = metric != "accuracy"
    cells = {(c["task"], c["length"]) for c in calib if c["headline"] and c["length"] >= min_length}
    scores = [s for s in scores if (s["task"], s["length"]) in cells]
    if not scores:
        return []
    lengths = sorted({s["length"] for s in scores})
    full = {c.compression_ratio: c.config_hash() for c, name in variants.items() if name == "nestedkv"}
    rows = []
    order = list(dict.fromkeys(variants.values()))
    for cfg, name in sorted(variants.items(), key=lambda kv: (kv[0].compression_ratio, order.index(kv[1]))):
        h = cfg.config_hash()
        mine = [s for s in scores if s["config_hash"] == h]
        accs = [_fmt(_mean([s["value"] for s in mine if s["length"] == n])) for n in lengths]
        p = paired(scores, h, full[cfg.compression_ratio], cells, lower) if cfg.compression_ratio in full else None
        vs = "-" if p is None or name == "nestedkv" or not p["n"] else \
            f"{p['better']}/{p['worse']}/{p['same']}, {p['mean_diff']:+.3f} +- {_fmt(p['se'], 3)}"
        rows.append([name, f"{cfg.compression_ratio:g}", *accs, _fmt(_mean([s["value"] for s in mine]), 3 if lower else 2), vs])
    return [f"## Per-scale ablation of NestedKV: {metric} (calibrated cells, "
            + ", ".join(length_label(n) for n in lengths) + ")", "",
            "Against = paired with full NestedKV (uniform) at the same ratio: better/worse/same, mean diff +- SE"
            + (" (lower is better)." if lower else "."), ""] + \
        _table(["variant", "r", *(length_label(n) for n in lengths), "all", "against nestedkv"], rows) + [""]


def summary_table(store, opts: SuiteOptions, docs: Sequence[dict]) -> list[str]:
    """Per length and configuration: the share of planted events the summaries name (coverage: all, the
    middle 30-70%, the ends), the compressed summary's ROUGE-L against the uncompressed one, the
    teacher-forced delta-NLL of the uncompressed summary (0 = unchanged; higher = worse), compress / prefill
    and resident KV; the uncompressed model's rows first, its middle cuts' beside them. Then NestedKV paired
    with each other press per document, at the same ratio and budget mode."""
    configs = opts.configs(opts.summary_base())
    if not configs:
        return []
    ref = configs[0].reference()
    hashes = [ref.config_hash()] + [c.config_hash() for c in configs]
    whole = [d for d in docs if d["task"] == "summary"]
    rows = store.summary_agreement(hashes, [sha256_hex(d["text"]) for d in docs])
    if not rows:
        return []
    doc = {d["doc_id"]: d for d in docs}
    scores = [{**r, "task": doc[r["doc_id"]]["task"], "length": doc[r["doc_id"]]["length"], "question_idx": 0}
              for r in rows if r["doc_id"] in doc]
    cells = defaultdict(list)
    for r in scores:
        cells[(r["task"], r["length"], r["config_hash"], r["metric"])].append(r["value"])
    first = {r["config_hash"]: r for r in rows}
    doc_length = {d["doc_id"]: d["length"] for d in whole}
    whole_hashes = [sha256_hex(d["text"]) for d in whole]
    mib = resident_mib(store, hashes, whole_hashes, doc_length)
    cost = costs(store, hashes, whole_hashes, doc_length, hashes[0])
    table = []
    for n in sorted({d["length"] for d in docs}):
        for task, c in [("summary", ref), ("summary_cut", ref)] + [("summary", c) for c in configs]:
            h = c.config_hash()
            got = {m: cells.get((task, n, h, m), []) for m in (*COVERAGE_METRICS, ROUGE_L, DELTA_NLL)}
            if not any(got.values()):
                continue
            name = label(first[h]) + (" (middle cut)" if task == "summary_cut" else "")
            ratio = overhead(cost, n, h) if task == "summary" and c is not ref else None
            table.append([name, "-" if c is ref else f"{c.compression_ratio:g}", length_label(n),
                          max(len(v) for v in got.values()),
                          *(_fmt(_mean(got[m])) for m in COVERAGE_METRICS), _fmt(_mean(got[ROUGE_L])),
                          _fmt(_mean(got[DELTA_NLL]), 3), _fmt(ratio),
                          _fmt(mib.get((n, h), math.nan), 1) if task == "summary" else "-"])
    lines = ["## Summaries: what the planted events kept, and agreement with the uncompressed summary", "",
             f"Documents: {len(whole)}, each with planted events (a person and a town met nowhere else, one in "
             f"each sixth of the text); max_new_tokens {opts.summary_tokens}. Events: the share of events whose "
             "person or town the summary names, overall, in the middle 30-70% and at the ends. Source: the share "
             "of the document's tenths whose own words (found in no other tenth) the summary uses, the same way. "
             "A middle cut is the same document without its middle 30-70%, summarized uncompressed (its source "
             "scored against the whole document): what a lost middle scores. Compress / prefill: compression's "
             "seconds over the uncompressed prefill's. KV: resident MiB per document.", ""]
    lines += _table(["configuration", "r", "length", "documents", "events", "middle", "ends", "source", "middle",
                     "ends", "ROUGE-L", "delta NLL", "compress / prefill", "KV MiB"], table) + [""]
    return lines + summary_pairs(scores, {("summary", n) for n in doc_length.values()})


def summary_pairs(scores: Sequence[dict], cells: set) -> list[str]:
    """NestedKV against each other press per ratio and budget mode, per document: the two coverages (higher
    is better) and delta NLL of the uncompressed summary (lower is better)."""
    nkv = [s for s in scores if s["press"] == "nestedkv"]
    modes = sorted({(s["compression_ratio"], s["head_budget"], s["prefill"]) for s in nkv})
    out = []
    for rival in rivals(scores):
        for r, budget, prefill in modes:
            a = {"press": "nestedkv", "compression_ratio": r, "head_budget": budget, "prefill": prefill}
            b = {**a, "press": rival}
            got = [paired([s for s in scores if s["metric"] == m], a, b, cells, lower_is_better=m == DELTA_NLL)
                   for m in (COVERAGE, SOURCE, DELTA_NLL)]
            if any(p["n"] for p in got):
                out.append([press_label(rival), f"{r:g}", budget, prefill, max(p["n"] for p in got),
                            *(f"{p['better']}/{p['worse']}/{p['same']}, {p['mean_diff']:+.3f} +- {_fmt(p['se'], 3)}"
                              for p in got)])
    if not out:
        return []
    return ["NestedKV paired with each other press, per document (better/worse/same, mean of NestedKV - other "
            "+- SE; delta NLL: lower is better):", ""] + \
        _table(["against", "r", "head budget", "prefill", "documents", "events", "source", "delta NLL"], out) + [""]


def resident_mib(store, hashes: Sequence[str], docs: Sequence[str], doc_length: dict) -> dict:
    """(length, config hash) -> mean resident KV MiB per document."""
    return _per_length(store.kv_bytes_by_document(hashes, docs), doc_length,
                       lambda rows: _mean([r["resident"] / 2**20 for r in rows]))


def costs(store, hashes: Sequence[str], docs: Sequence[str], doc_length: dict, reference: str) -> dict:
    """(length, config hash) -> mean prefill and compression seconds per document, and whether the hash is
    the uncompressed ``reference`` (whose prefill is what compression is an overhead on)."""
    return _per_length(store.costs_by_document(hashes, docs), doc_length, lambda rows: {
        "prefill_s": math.nan if any(r["prefill_s"] is None for r in rows) else _mean([r["prefill_s"] for r in rows]),
        "compress_s": _mean([r["compress_s"] for r in rows]),
        "reference": rows[0]["config_hash"] == reference})


def overhead(cost: dict, length: int, h: str) -> Optional[float]:
    """Compression's seconds of configuration ``h`` over the uncompressed prefill's at ``length`` (``costs``),
    or None where either is missing."""
    c = cost.get((length, h))
    full = next((x["prefill_s"] for (n, _), x in cost.items() if n == length and x["reference"]), None)
    return c["compress_s"] / full if c and full else None


def _per_length(rows: Sequence[dict], doc_length: dict, reduce) -> dict:
    acc = defaultdict(list)
    for r in rows:
        if r["doc_id"] in doc_length:
            acc[(doc_length[r["doc_id"]], r["config_hash"])].append(r)
    return {k: reduce(v) for k, v in acc.items()}


def plot_frontier(scores: Sequence[dict], calib: Sequence[dict], mib: dict, path: Path) -> Optional[Path]:
    """Accuracy on the calibrated cells against resident KV MiB per document: one panel per length, one
    curve per method and budget mode (its points are the ratios), the uncompressed model as a star."""
    ok = {(c["task"], c["length"]) for c in calib if c["headline"]}
    which = "calibrated tasks"
    if not ok:  # nothing passed calibration (the methods ran only if asked): plot every cell, and say so
        ok, which = {(c["task"], c["length"]) for c in calib}, "all tasks, none calibrated"
    pts = defaultdict(list)  # (length, label) -> [(mib, accuracy, ratio)]
    by = defaultdict(list)
    for s in scores:
        if (s["task"], s["length"]) in ok:
            by[(s["length"], s["config_hash"])].append(s)
    for (length, h), ss in by.items():
        if (length, h) in mib:
            pts[(length, label(ss[0]))].append((mib[(length, h)], _mean([s["value"] for s in ss]),
                                                ss[0]["compression_ratio"]))
    lengths = sorted({n for n, _ in pts})
    if not lengths:
        return None
    fig = Figure(figsize=(5.5 * len(lengths), 4.2))
    axes = fig.subplots(1, len(lengths), squeeze=False)
    for ax, length in zip(axes[0], lengths):
        for (n, name), xs in sorted(pts.items()):
            if n != length:
                continue
            xs = sorted(xs)
            if name == "no_press":
                ax.plot([x for x, _, _ in xs], [y for _, y, _ in xs], "k*", markersize=12, label="uncompressed")
                continue
            # colour: the method; line: the head budget; marker: the prefill mode, or the KV width
            press = name.split()[0]
            marker = "s" if " streaming" in name else "v" if " 4-bit" in name else "^" if " 8-bit" in name else "o"
            ax.plot([x for x, _, _ in xs], [y for _, y, _ in xs], color=colour(press),
                    linestyle="--" if " adaptive" in name else "-", marker=marker,
                    linewidth=2.2 if press == "nestedkv" else 1.2, markersize=5, label=name)
        ax.set_title(f"{length_label(length)} tokens ({which})")
        ax.set_xlabel("resident KV cache per document (MiB)")
        ax.set_ylabel("accuracy (recall of gold parts)")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))  # outside: never over a point
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


def headline_table(heads: Sequence[dict], digits: int) -> list[str]:
    return _table(["against", "r", "head budget", "prefill", "questions", "NestedKV", "other", "better", "worse",
                   "same", "mean diff +- SE"],
                  [[press_label(h["rival"]), f"{h['ratio']:g}{' *' if h.get('best') else ''}", h["head_budget"],
                    h["prefill"] + h["quant"].label(), h["n"],
                    _fmt(h["acc_a"], digits), _fmt(h["acc_b"], digits), h["better"], h["worse"], h["same"],
                    f"{h['mean_diff']:+.3f} +- {_fmt(h['se'], 3)}"] for h in heads])


def write_report(store, opts: SuiteOptions, docs: Sequence[dict], stage_s: Optional[dict] = None,
                 summary_docs: Sequence[dict] = ()) -> SuiteResult:
    """The markdown report and the frontier plot for ``docs`` (and ``summary_docs``) under ``opts``'s
    configurations; the summaries alone under ``opts.summaries_only``."""
    if opts.summaries_only:
        lines = [f"# Summaries: {opts.model}", ""]
        if stage_s:
            lines += ["Wall time: " + ", ".join(f"{k} {v:.0f} s" for k, v in stage_s.items()), ""]
        lines += summary_table(store, opts, summary_docs)
        opts.out_dir.mkdir(parents=True, exist_ok=True)
        md = opts.out_dir / MARKDOWN_NAME
        md.write_text("\n".join(lines) + "\n", encoding="utf-8")
        return SuiteResult(opts.out_dir / SUMMARY_FILE, md, None, [], [], dict(stage_s or {}))
    hashes = [opts.base().reference().config_hash()] + [c.config_hash() for c in opts.configs()]
    doc_hashes = [sha256_hex(d["text"]) for d in docs]
    scores = store.suite_scores(hashes, doc_hashes, RECALL)
    nll = store.suite_scores(hashes, doc_hashes, DELTA_GOLD_NLL)
    calib = calibration(scores, opts.threshold)
    heads, cells = headline(scores, calib, long_from=opts.long_from)
    doc_length = {d["doc_id"]: d["length"] for d in docs}
    mib = resident_mib(store, hashes, doc_hashes, doc_length)
    cost = costs(store, hashes, doc_hashes, doc_length, hashes[0])
    out = opts.out_dir
    plot = plot_frontier(scores, calib, mib, out / PLOT_NAME)

    n_q = sum(len(d["questions"]) for d in docs)
    lines = [f"# Synthetic long-context suite: {opts.model}", "",
             f"{len(docs)} documents, {n_q} questions; tasks {', '.join(opts.tasks)}; lengths "
             f"{', '.join(length_label(n) for n in sorted({d['length'] for d in docs}))}; seed {opts.seed}; "
             f"max_new_tokens {opts.options.max_new_tokens}. Accuracy = share of a question's gold parts in the answer "
             "(RULER's string_match_all; `correct` for one-part questions).", ""]
    if stage_s:
        lines += ["Wall time: " + ", ".join(f"{k} {v:.0f} s" for k, v in stage_s.items()), ""]
    lines += ["## Calibration (uncompressed)", "",
              f"A cell below {opts.threshold:g} is reported and left out of the headline"
              + ("" if opts.all_tasks else " (the methods were not run on it)") + ".", ""]
    lines += _table(["task", "length", "questions", "accuracy", "headline"],
                    [[c["task"], length_label(c["length"]), c["n"], _fmt(c["accuracy"]),
                      "yes" if c["headline"] else f"no: uncompressed {_fmt(c['accuracy'])} < {opts.threshold:g}"]
                     for c in calib])
    kinds = defaultdict(list)  # the needle kinds, uncompressed
    for sc in scores:
        if sc["press"] == "no_press" and sc["kind"] in ("number", "word", "name"):
            kinds[(sc["length"], sc["kind"])].append(sc["value"])
    if kinds:
        lines += ["", "Uncompressed accuracy by needle kind (the niah tasks): " + "; ".join(
            f"{length_label(n)} {k} {_fmt(_mean(v))} ({len(v)})" for (n, k), v in sorted(kinds.items())) + "."]
    lines += ["", "## Headline: NestedKV against each other press (same budget mode)", ""]
    if cells and heads:
        lines.append("Cells: " + ", ".join(f"{t} {length_label(n)}" for t, n in sorted(cells)) + ". Paired per "
                     "question; diff = NestedKV - the other press; * = NestedKV's best budget mode at that ratio "
                     "against that press (chosen on these same questions). Every press against the uncompressed "
                     "model, with what compression costs: the per-length tables below.")
        if any(nestedkv.PRESSES[h["rival"]].needs_questions for h in heads if h["rival"] in nestedkv.PRESSES):
            lines.append("A press marked (saw the questions) read each document's questions before it compressed; "
                         "NestedKV and the others did not, and keep rows for any later question: not equal terms.")
        lines.append("")
        lines += headline_table(heads, 2)
        nll_heads, _ = headline(nll, calib, long_from=opts.long_from, lower_is_better=True)
        if nll_heads:
            lines += ["", "Delta gold NLL (teacher-forced NLL of the gold answer under the compressed cache minus "
                      "under the full one, nats per token; lower is better), same cells and pairing:", ""]
            lines += headline_table(nll_heads, 3)
    elif cells:
        lines.append("No NestedKV configuration ran beside another press: nothing to pair.")
    else:
        lines.append("No cell passed calibration at these lengths: no headline.")
    lines += ["", "## r = 0.5: share of the uncompressed accuracy kept (calibrated cells)", ""]
    ok = {(c["task"], c["length"]) for c in calib if c["headline"]}
    full = _mean([s["value"] for s in scores if s["press"] == "no_press" and (s["task"], s["length"]) in ok])
    keep = defaultdict(list)
    for s in scores:
        if s["press"] == "nestedkv" and s["compression_ratio"] == 0.5 and (s["task"], s["length"]) in ok:
            keep[label(s)].append(s["value"])
    lines += [f"- {name}: {_fmt(_mean(v))} of uncompressed {_fmt(full)} = {_fmt(_mean(v) / full if full else math.nan)}"
              for name, v in sorted(keep.items())] or ["- no NestedKV run at r = 0.5 on calibrated cells"]
    lines += ["", "## Accuracy per task, length and configuration", ""]
    lines += ["Compress / prefill: the seconds compression took (scoring, eviction, and for presses that score "
              "with the model their probe pass) over the uncompressed prefill's, per document.", ""]
    lines += accuracy_tables(scores, calib, mib, nll, cost)
    ablation = opts.ablation_configs()
    if ablation:
        abl = {c.config_hash() for c in ablation}
        abl_scores = store.suite_scores(abl, doc_hashes, RECALL)
        lines += ablation_table(abl_scores, calib, ablation, opts.long_from)
        abl_nll = store.suite_scores(abl, doc_hashes, DELTA_GOLD_NLL)
        lines += ablation_table(abl_nll, calib, ablation, opts.long_from, metric="delta gold NLL")
    if summary_docs:
        lines += summary_table(store, opts, summary_docs)
    if plot:
        lines += ["## Quality against resident KV memory", "", f"![frontier]({plot.name})", ""]
    out.mkdir(parents=True, exist_ok=True)
    md = out / MARKDOWN_NAME
    md.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return SuiteResult(out / SUITE_FILE, md, plot, calib, heads, dict(stage_s or {}))
