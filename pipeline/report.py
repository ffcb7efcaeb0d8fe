"""Quality against compression, from a store written by ``nkv eval``: a table and a plot.

One row per (model, method, head budget, compression ratio or budget): answer accuracy against gold,
agreement with the uncompressed answer (exact, ROUGE-L), teacher-forced delta-NLL and top-1 agreement
along the uncompressed answer, and the share of context KV bytes kept. The uncompressed reference
(``no_press``) is the first row. When a (configuration, document, question) was evaluated more than once
(a resumed or repeated sweep), only its latest run counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import pyarrow as pa
from matplotlib.figure import Figure  # no pyplot: no global backend state, renders with Agg
from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

from nestedkv.quant import KVQuant
from pipeline import tables
from pipeline.labels import config_label, config_order, press_order
from pipeline.store import Store, StoreError


MARKDOWN_NAME = "report.md"
PLOT_NAME = "quality_vs_ratio.png"
FRONTIER_NAME = "quality_vs_memory.png"
MARKERS = ("o", "o", "s", "^", "D", "v", "P", "X")

COLUMNS = [  # (key, header, format)
    ("press", "method", "{}"),
    ("head_budget", "head budget", "{}"),
    ("compression_ratio", "ratio", "{:.2f}"),
    ("n_questions", "questions", "{}"),
    ("accuracy", "accuracy", "{:.3f}"),
    ("accuracy_vs_full", "acc / full", "{:.2f}"),
    ("agree_exact", "agree exact", "{:.3f}"),
    ("rouge_l", "ROUGE-L", "{:.3f}"),
    ("delta_nll", "delta NLL", "{:+.3f}"),
    ("top1_agreement", "top-1 agree", "{:.3f}"),
    ("gold_nll", "gold NLL", "{:.3f}"),
    ("delta_gold_nll", "delta gold NLL", "{:+.3f}"),
    ("source_coverage", "source", "{:.2f}"),
    ("source_middle", "source middle", "{:.2f}"),
    ("source_ends", "source ends", "{:.2f}"),
    ("kept_share", "KV kept", "{:.3f}"),
    ("resident_share", "KV resident", "{:.3f}"),
    ("resident_mib", "KV MiB/doc", "{:.2f}"),
]


@dataclass
class Report:
    rows: list[dict]  # numeric, one per configuration, reference first
    table: pa.Table  # the same, formatted as strings for display
    markdown: str
    markdown_path: Optional[Path] = None
    plot_path: Optional[Path] = None
    frontier_path: Optional[Path] = None


def quality_rows(store: Store) -> list[dict]:
    """One numeric row per evaluated configuration, ordered: reference, nestedkv, baselines; ratio up."""
    rows = store.quality_by_config()
    if not rows:
        raise StoreError(f"{store.path}: no evaluations stored; run `nkv eval --db {store.path}` first")
    kept = {r["config_hash"]: r for r in store.kept_by_config()}
    full_acc = {r["model"]: r["accuracy"] for r in rows if r["press"] == "no_press" and not r.get("kv_bits")}
    for r in rows:
        r["kept_share"] = kept.get(r["config_hash"], {}).get("kept_share")
        r["resident_share"] = kept.get(r["config_hash"], {}).get("resident_share")
        r["resident_mib"] = kept.get(r["config_hash"], {}).get("resident_mib")
        ref = full_acc.get(r["model"])
        r["accuracy_vs_full"] = r["accuracy"] / ref if ref and r["accuracy"] is not None else None
        r["kv_label"] = kv_label(r)
    return sorted(rows, key=config_order)


def kv_label(row: dict, unit: str = "") -> Optional[str]:
    """The KV width as the report writes it: ``4`` (``unit`` after the number), then the group size when not
    64 and ``plain`` for keys quantized unrotated (``KVQuant.label``)."""
    return KVQuant.from_fields(row).label(unit).strip() or None


def _fmt(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt.format(value)


# Shown where some row has them: answers against gold (questions), where summaries draw from (summaries).
OPTIONAL = ("accuracy", "accuracy_vs_full", "gold_nll", "delta_gold_nll", "source_coverage", "source_middle",
            "source_ends")


def _columns(rows: list[dict]) -> list[tuple[str, str, str]]:
    cols = [c for c in COLUMNS if c[0] not in OPTIONAL or any(r.get(c[0]) is not None for r in rows)]
    if len({r["model"] for r in rows}) > 1:
        cols.insert(0, ("model", "model", "{}"))
    if any(r.get("kv_bits") for r in rows):
        cols.insert(cols.index(("compression_ratio", "ratio", "{:.2f}")) + 1, ("kv_label", "KV bits", "{}"))
    if any(r["budget"] for r in rows):
        cols.insert(cols.index(("compression_ratio", "ratio", "{:.2f}")) + 1, ("budget", "budget", "{}"))
    return cols


def display_table(rows: list[dict]) -> pa.Table:
    cols = _columns(rows)
    return pa.table({header: [_fmt(r.get(key), fmt) for r in rows] for key, header, fmt in cols})


def markdown_table(rows: list[dict]) -> str:
    cols = _columns(rows)
    return "\n".join(tables.markdown([h for _, h, _ in cols], [[_fmt(r.get(k), f) for k, _, f in cols] for r in rows],
                                     align=["l" if k in ("press", "head_budget", "model") else "r" for k, _, _ in cols]))


def to_markdown(rows: list[dict], db: Union[str, Path]) -> str:
    models = sorted({r["model"] for r in rows})
    n_docs = max(r["n_docs"] for r in rows)
    n_q = max(r["n_questions"] or 0 for r in rows)
    has = {key for key, _, _ in _columns(rows)}
    gold = [
        "- **accuracy**: share of answers containing the gold answer (case, punctuation and whitespace "
        "folded); **acc / full**: accuracy over the `no_press` accuracy.",
        "- **gold NLL** (nats per token): teacher-forced NLL of the gold answer after the question; "
        "**delta gold NLL**: the same minus its value under the full cache (lower is better). It separates "
        "methods even where greedy accuracy is at the floor.",
        f"- With {n_q} questions the standard error of an accuracy near 0.5 is about "
        f"{_se(0.5, n_q):.2f}; differences smaller than about twice that are within noise.",
    ]
    source = [
        "- **source**, **source middle**, **source ends** (summaries): the share of the document's tenths whose "
        "own words (found in no other tenth) the summary uses, over all tenths, the middle 30-70% and the rest "
        "(docs/summaries.md).",
    ]
    return "\n".join([
        "# Quality against compression",
        "",
        f"Store `{db}`; model {', '.join(f'`{m}`' for m in models)}; {n_docs} documents"
        + (f", {n_q} questions per configuration" if n_q else "")
        + "; each document prefilled once, every configuration compressed from a copy of that cache (`nkv eval`).",
        "",
        markdown_table(rows),
        "",
        "- **ratio**: fraction of context KV entries removed; **KV kept**: kept context KV bytes over the "
        "uncompressed context's (logical: the rows attention reads); **KV resident**: bytes actually allocated "
        "after compression over the same (adaptive head budgets pad every head of a layer to its longest one).",
        "- **agree exact**, **ROUGE-L**: the answer (or summary) against the `no_press` one to the same question.",
        "- **delta NLL** (nats per token, lower is better) and **top-1 agree**: teacher-forced along the "
        "`no_press` answer, compressed cache against full cache.",
        *(gold if "accuracy" in has else []),
        *(source if "source_coverage" in has else []),
        "",
        *frontier_markdown(rows),
    ])


def frontier(rows: list[dict]) -> list[dict]:
    """The configurations no other beats for their memory: by resident MiB per document, each one more
    accurate than every configuration holding as little or less (ties: the lower delta gold NLL, then the
    smaller cache). Rows without accuracy or memory are left out."""
    def key(r):
        gold = r.get("delta_gold_nll")
        return r["resident_mib"], -r["accuracy"], math.inf if gold is None else gold

    pts = sorted((r for r in rows if r.get("accuracy") is not None and r.get("resident_mib") is not None), key=key)
    out: list[dict] = []
    for r in pts:
        if not out or r["accuracy"] > out[-1]["accuracy"]:
            out.append(r)
    return out


def frontier_markdown(rows: list[dict]) -> list[str]:
    best = frontier(rows)
    if not best:
        return []
    lines = ["## Which configuration at each memory size", "",
             "Each row is the most accurate configuration within its resident KV memory per document: every "
             "configuration not listed answers no better with as much memory or more (`quality_vs_memory.png`).",
             ""]
    cells = [[f"{r['resident_mib']:.2f}", config_label(r), _fmt(r["compression_ratio"], "{:.2f}"), f"{r['accuracy']:.3f}",
              _fmt(r.get("delta_gold_nll"), "{:+.3f}")] for r in best]
    return lines + tables.markdown(["KV MiB/doc", "configuration", "ratio", "accuracy", "delta gold NLL"], cells,
                                   align="rlrrr") + [""]


def _se(p: float, n: int) -> float:
    return math.sqrt(p * (1 - p) / n) if n else float("nan")


def _num(v) -> float:
    return math.nan if v is None else float(v)




def plot(rows: list[dict], path: Union[str, Path]) -> Path:
    """Accuracy (for summaries without gold: source coverage) and delta-NLL against compression ratio, one line
    per method (and head-budget mode)."""
    path = Path(path)
    left = "accuracy" if any(r.get("accuracy") is not None for r in rows) else "source_coverage"
    fig = Figure(figsize=(11, 4.6), layout="constrained")
    ax_acc, ax_nll = fig.subplots(1, 2)
    multi = len({r["model"] for r in rows}) > 1
    lines: dict[str, list[dict]] = {}
    for r in rows:
        if r["press"] == "no_press" or r["budget"]:
            continue  # the reference is a horizontal line; absolute budgets have no ratio to plot against
        lines.setdefault(f"{r['model']}: {config_label(r)}" if multi else config_label(r), []).append(r)
    for name, pts in lines.items():
        pts = sorted(pts, key=lambda x: x["compression_ratio"])
        xs = [p["compression_ratio"] for p in pts]
        press = pts[0]["press"]
        order = press_order()
        rank = order.index(press) if press in order else len(order) + len(lines)
        shade = {None: 0, 8: 6, 4: 7}.get(pts[0].get("kv_bits"), 8)  # one color per method and KV width
        style = {"marker": MARKERS[rank % len(MARKERS)], "color": f"C{(rank - 1 + shade) % 10}", "label": name,
                 "linestyle": "--" if pts[0]["head_budget"] == "adaptive" else "-",
                 "linewidth": 2.5 if press == "nestedkv" else 1.5}
        ax_acc.plot(xs, [_num(p.get(left)) for p in pts], **style)
        ax_nll.plot(xs, [_num(p["delta_nll"]) for p in pts], **style)
    for r in rows:  # the uncompressed runs are horizontal lines, one style per KV width
        if r["press"] == "no_press" and r.get(left) is not None:
            bits = r.get("kv_bits")
            line = {"color": "black", "linestyle": {None: ":", 8: "-."}.get(bits, "--"), "linewidth": 1.2}
            ax_acc.axhline(r[left], **line, label=f"{config_label(r)} ({r[left]:.2f})")
            if bits and r["delta_nll"] is not None:
                ax_nll.axhline(r["delta_nll"], **line, label=f"{config_label(r)} ({r['delta_nll']:+.2f})")
    ax_nll.axhline(0.0, color="black", linestyle=":", linewidth=1.2, label="no_press (0)")
    ax_acc.set(title="Answer accuracy (gold contained)" if left == "accuracy" else
               "Summary's source coverage (tenths of the document drawn on)",
               xlabel="compression ratio (fraction removed)", ylabel="accuracy" if left == "accuracy" else "share of tenths",
               ylim=(-0.02, 1.02))
    ax_nll.set(title="Delta NLL of the no_press answer (teacher-forced)", xlabel="compression ratio (fraction removed)",
               ylabel="nats / token vs full cache")
    for ax in (ax_acc, ax_nll):
        ax.grid(True, alpha=0.3)
    # One legend for both panels, below them, so that it hides no line.
    handles, labels = ax_acc.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=min(len(labels), 7), fontsize=8, frameon=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


FRONTIER_PANELS = (("accuracy", "Answer accuracy (gold contained)", "accuracy"),
                   ("delta_nll", "Delta NLL of the no_press answer", "nats / token vs full cache"),
                   ("delta_gold_nll", "Delta gold NLL", "nats / token vs full cache"))


def plot_frontier(rows: list[dict], path: Union[str, Path]) -> Optional[Path]:
    """Accuracy, delta NLL and delta gold NLL against resident KV MiB per document: one line per method,
    head budget and KV width through its ratios, the uncompressed runs as stars; None without memory rows."""
    pts = [r for r in rows if r.get("resident_mib") and not r["budget"]]
    if not pts:
        return None
    path = Path(path)
    fig = Figure(figsize=(15, 4.8), layout="constrained")
    axes = fig.subplots(1, len(FRONTIER_PANELS))
    multi = len({r["model"] for r in rows}) > 1
    lines: dict[str, list[dict]] = {}
    for r in pts:
        lines.setdefault(f"{r['model']}: {config_label(r)}" if multi else config_label(r), []).append(r)
    order = press_order()
    for name, group in lines.items():
        group = sorted(group, key=lambda x: x["resident_mib"])
        r0 = group[0]
        rank = order.index(r0["press"]) if r0["press"] in order else len(order)
        bits = r0.get("kv_bits")
        ref = r0["press"] == "no_press"
        style = {"color": "black" if ref else f"C{rank % 10}", "label": name,
                 "marker": ({None: "*", 8: "P"} if ref else {None: "o", 8: "^"}).get(bits, "X" if ref else "v"),
                 "markersize": 11 if ref else 6,
                 "linestyle": "none" if ref else {None: "-", 8: "--"}.get(bits, ":"),
                 "linewidth": 2.2 if r0["press"] == "nestedkv" else 1.3,
                 "alpha": 1.0 if ref or r0["head_budget"] == "adaptive" else 0.6}
        xs = [g["resident_mib"] for g in group]
        for ax, (key, _, _) in zip(axes, FRONTIER_PANELS):
            ax.plot(xs, [_num(g.get(key)) for g in group], **style)
    for ax, (_, title, ylabel) in zip(axes, FRONTIER_PANELS):
        ax.set(title=title, xlabel="resident KV cache per document (MiB, log scale)", ylabel=ylabel, xscale="log")
        ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))  # 1, 2, 5, 10, ... as plain numbers
        ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(True, alpha=0.3)
    axes[0].set_ylim(-0.02, 1.02)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=min(len(labels), 6), fontsize=8, frameon=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


def build_report(db: Union[str, Path]) -> Report:
    with Store(db, read_only=True) as store:
        rows = quality_rows(store)
    return Report(rows, display_table(rows), to_markdown(rows, db))


def write_report(db: Union[str, Path], out: Union[str, Path]) -> Report:
    """``out/report.md`` and ``out/quality_vs_ratio.png`` from the evaluations in ``db``."""
    rep = build_report(db)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rep.markdown_path = out / MARKDOWN_NAME
    rep.markdown_path.write_text(rep.markdown)
    rep.plot_path = plot(rep.rows, out / PLOT_NAME)
    rep.frontier_path = plot_frontier(rep.rows, out / FRONTIER_NAME)
    return rep
