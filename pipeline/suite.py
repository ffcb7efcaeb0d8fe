"""The synthetic long-context suite: generate (``pipeline.tasks``), calibrate, run the methods, report.

    nkv suite [--size quick|small|standard] [--db suite.duckdb] [--out reports/suite]

1. Generate the documents for the model's tokenizer into ``OUT/suite.parquet`` and record each question's
   task, length, kind and gold parts in the store's ``suite_questions`` table (keyed by doc_id, content
   hash and question_idx: joins to ``outputs`` and, through them, to ``evaluations``).
2. Calibrate: the uncompressed model (``no_press``) answers everything. A (task, length) cell whose
   uncompressed accuracy is below ``threshold`` (0.6) is reported but left out of the headline, and by
   default the methods are not run on it (``all_tasks`` runs them anyway).
3. Every method x ratio x head budget x prefill mode through the engine, one whole-context prefill per
   document, into the same DuckDB store (``evaluations`` gains a ``recall`` metric per question: RULER's
   score, the share of the gold parts found in the answer; ``correct`` for one-part questions). Documents of
   4k tokens and more also run NestedKV's per-scale variants (``pipeline.ablation``) at r = 0.75 and 0.9.
4. Report (``OUT/suite_report.md``, ``OUT/frontier.png``): accuracy per task x length x configuration; the
   headline, NestedKV against KeyDiff in the same budget mode on the calibrated cells of the longest
   lengths (4k and up when there are any), as paired per-question counts (better / worse / same) with the
   mean difference and its standard error; and accuracy against resident KV bytes per document.

A re-run resumes: the engine skips (configuration, document) pairs already stored.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

import nestedkv
from pipeline.config import DEFAULT_MODEL, RunConfig
from pipeline.documents import sha256_hex
from pipeline.evaluate import DELTA_GOLD_NLL, contains_gold
from pipeline.tasks import SIZES, TASKS, generate, length_label, token_counter, write

RECALL = "recall"


def methods() -> tuple[str, ...]:
    """The methods a suite compares by default: the registry's (loaded on first use, not at import)."""
    from nestedkv.press import compared_methods

    return compared_methods()


def _rank(press: str) -> int:
    """A press's place in the tables: the registry's order."""
    from nestedkv.press import PRESSES

    order = list(PRESSES)
    return order.index(press) if press in order else -1


HEADLINE_RATIOS = (0.75, 0.9)
LONG_FROM = 4096  # the headline, ablation and summaries use documents of this many tokens and more
SUITE_FILE, QUESTIONS_FILE = "suite.parquet", "questions.parquet"
METHODS_FILE, ABLATION_FILE, SUMMARY_FILE = "methods.parquet", "methods_ablation.parquet", "summaries.parquet"
MARKDOWN_NAME, PLOT_NAME, PREFILLS_DIR = "suite_report.md", "frontier.png", "prefills"
COLOURS = {"nestedkv": "C3", "keydiff": "C0", "knorm": "C2", "streaming_llm": "C1", "random": "C7"}

@dataclass
class SuiteOptions:
    model: str = DEFAULT_MODEL
    db: str = "suite.duckdb"
    out: str = "reports/suite"
    size: str = "standard"
    lengths: Optional[tuple[int, ...]] = None  # default: the size's
    per_task: Optional[int] = None  # default: the size's
    tasks: tuple[str, ...] = TASKS
    seed: int = 0
    presses: tuple[str, ...] = field(default_factory=methods)
    ratios: tuple[float, ...] = (0.5, 0.75, 0.9)
    head_budgets: tuple[str, ...] = ("uniform", "adaptive")
    prefills: tuple[str, ...] = ("whole",)  # "streaming" prefills each configuration on its own
    max_new_tokens: int = 32
    prefill_step_size: int = 512
    threshold: float = 0.6
    all_tasks: bool = False  # run the methods on the cells that failed calibration too
    austen: Optional[str] = None
    ablation: bool = True  # NestedKV's per-scale variants (pipeline.ablation) at the headline ratios
    variants: Optional[tuple[str, ...]] = None  # which of them (default: every NestedKV variant)
    summaries: int = 0  # plain documents per long length whose compressed summaries are compared
    summary_tokens: int = 128  # max_new_tokens of a summary
    long_from: int = LONG_FROM  # "long": the headline, the ablation and the summaries use these lengths

    def __post_init__(self):
        if self.size not in SIZES:
            raise ValueError(f"size must be one of {', '.join(SIZES)}, got {self.size!r}")
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {self.threshold!r}")
        unknown = [t for t in self.tasks if t not in TASKS]
        if unknown or not self.tasks:
            raise ValueError(f"tasks: unknown {unknown or 'none given'}; known: {', '.join(TASKS)}")
        if self.lengths is not None and (not self.lengths or any(int(n) < 256 for n in self.lengths)):
            raise ValueError(f"lengths: need at least one length of 256 tokens or more, got {self.lengths!r}")
        if self.per_task is not None and self.per_task < 1:
            raise ValueError(f"per_task must be >= 1, got {self.per_task!r}")
        for name in ("summaries", "summary_tokens", "long_from", "max_new_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < (0 if name == "summaries" else 1):
                raise ValueError(f"{name} must be an int >= {0 if name == 'summaries' else 1}, got {v!r}")
        if "no_press" in self.presses:
            raise ValueError("presses: no_press is the calibration reference and always runs; leave it out")
        if self.variants is not None:
            from pipeline.ablation import VARIANTS

            unknown = [v for v in self.variants if VARIANTS.get(v, ("",))[0] != "nestedkv"]
            if unknown:
                raise ValueError(f"variants: unknown {unknown}; known: "
                                 f"{', '.join(n for n, v in VARIANTS.items() if v[0] == 'nestedkv')}")

    @property
    def out_dir(self) -> Path:
        return Path(self.out)

    def base(self) -> RunConfig:
        return RunConfig(task="qa", model=self.model, max_new_tokens=self.max_new_tokens,
                         prefill_step_size=self.prefill_step_size)

    def summary_base(self) -> RunConfig:
        return RunConfig(task="summarize", model=self.model, max_new_tokens=self.summary_tokens,
                         prefill_step_size=self.prefill_step_size)

    def ablation_configs(self) -> dict[RunConfig, str]:
        """NestedKV's variants (each scale alone, no gate, ...) at the headline ratios: config -> variant name."""
        from pipeline.ablation import VARIANTS, variant_configs

        if not self.ablation:
            return {}
        ratios = [r for r in HEADLINE_RATIOS if r in self.ratios] or list(self.ratios)
        names = [n for n, v in VARIANTS.items() if v[0] == "nestedkv"] if self.variants is None else \
            list(dict.fromkeys(["nestedkv", *self.variants]))  # the full method: what each variant is paired with
        got = variant_configs(self.base(), list(names), ratios)
        return {c: name for c, (name, _) in got.items() if not c.is_reference}

    def configs(self, base: Optional[RunConfig] = None) -> list[RunConfig]:
        """Every method x ratio x head budget x prefill mode (questions; ``base``: another task's settings)."""
        from pipeline.engine import make_configs

        if not self.presses:
            return []
        return make_configs(base or self.base(), self.presses, self.ratios, head_budgets=self.head_budgets,
                            prefills=self.prefills)

    def summary_documents(self, count) -> list[dict]:
        from pipeline.tasks import summary_documents

        lengths = [n for n in (self.lengths or SIZES[self.size].lengths) if n >= self.long_from]
        if not self.summaries or not lengths:
            return []
        return summary_documents(count, lengths, self.summaries, self.seed,
                                 Path(self.austen) if self.austen else None)


@dataclass
class SuiteResult:
    suite_path: Path
    markdown_path: Path
    plot_path: Optional[Path]
    calibration: list[dict]
    headline: list[dict]
    stage_s: dict = field(default_factory=dict)  # wall seconds per stage


# -- generation and the question table -----------------------------------------------------------------------
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


# -- reading results back --------------------------------------------------------------------------------------
def label(row: dict) -> str:
    if row["press"] == "no_press":
        return "no_press"
    mode = " streaming" if row["prefill"] == "streaming" else ""
    return f"{row['press']} {row['head_budget']}{mode}"


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def calibration(scores: Sequence[dict], threshold: float) -> list[dict]:
    """Uncompressed accuracy per (task, length), and whether the cell enters the headline."""
    cells = defaultdict(list)
    for s in scores:
        if s["press"] == "no_press":
            cells[(s["task"], s["length"])].append(s["value"])
    out = []
    for (task, length), vals in sorted(cells.items(), key=lambda kv: (kv[0][1], TASKS.index(kv[0][0]))):
        acc = _mean(vals)
        out.append({"task": task, "length": length, "n": len(vals), "accuracy": acc, "headline": acc >= threshold})
    return out


def paired(scores: Sequence[dict], a: dict, b: dict, cells: set, lower_is_better: bool = False) -> dict:
    """Per question in ``cells``: configuration ``a``'s score against ``b``'s (each a dict of press, head
    budget, prefill, ratio, or a config hash), as counts better / worse / same, the mean difference a - b and
    its standard error."""

    def pick(cfg):  # a dict of fields, or a config hash
        same = (lambda s: s["config_hash"] == cfg) if isinstance(cfg, str) else \
            (lambda s: all(s[k] == v for k, v in cfg.items()))
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


def headline(scores: Sequence[dict], calib: Sequence[dict], ratios=HEADLINE_RATIOS,
             long_from: int = LONG_FROM, lower_is_better: bool = False) -> tuple[list[dict], set]:
    """NestedKV against KeyDiff per ratio, budget mode and prefill mode on the headline cells (calibrated,
    at the long lengths when the suite has any, else at all)."""
    lengths = sorted({c["length"] for c in calib})
    long = [n for n in lengths if n >= long_from] or lengths
    cells = {(c["task"], c["length"]) for c in calib if c["headline"] and c["length"] in long}
    modes = sorted({(s["head_budget"], s["prefill"]) for s in scores if s["press"] == "nestedkv"})
    out = []
    for r in ratios:
        for hb, pf in modes:
            cfg = {"compression_ratio": r, "head_budget": hb, "prefill": pf}
            p = paired(scores, {"press": "nestedkv", **cfg}, {"press": "keydiff", **cfg}, cells, lower_is_better)
            if p["n"]:
                out.append({"ratio": r, "head_budget": hb, "prefill": pf, **p})
    for r in ratios:  # the best NestedKV budget mode per ratio (by its own accuracy), marked
        rows = [h for h in out if h["ratio"] == r]
        if rows:
            (min if lower_is_better else max)(rows, key=lambda h: h["acc_a"])["best"] = True
    return out, cells


# -- report -------------------------------------------------------------------------------------------------
def _fmt(x: float, digits: int = 2) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _table(header: Sequence[str], rows: Sequence[Sequence]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def accuracy_tables(scores: Sequence[dict], calib: Sequence[dict], mib: dict, nll: Sequence[dict] = ()) -> list[str]:
    """Per length: one row per configuration, one column per task, then the calibrated cells' mean accuracy
    and delta gold NLL (``nll``: that metric's scores)."""
    ok = {(c["task"], c["length"]) for c in calib if c["headline"]}
    nll_by = defaultdict(list)
    for s in nll:
        if (s["task"], s["length"]) in ok:
            nll_by[(s["length"], s["config_hash"])].append(s["value"])
    by = defaultdict(list)
    for s in scores:
        by[(s["length"], s["config_hash"])].append(s)
    lines = []
    for length in sorted({s["length"] for s in scores}):
        tasks = [t for t in TASKS if any(s["task"] == t and s["length"] == length for s in scores)]
        rows = []
        for (n, h), ss in by.items():
            if n != length:
                continue
            s0 = ss[0]
            cells = [_fmt(_mean([s["value"] for s in ss if s["task"] == t])) for t in tasks]
            calibrated = [s["value"] for s in ss if (s["task"], s["length"]) in ok]
            ratio = "-" if s0["press"] == "no_press" else f"{s0['compression_ratio']:g}"
            rows.append(((s0["press"] != "no_press", s0["press"], s0["head_budget"], s0["prefill"],
                          s0["compression_ratio"]),
                         [label(s0), ratio, *cells, _fmt(_mean(calibrated)),
                          "-" if s0["press"] == "no_press" else _fmt(_mean(nll_by.get((length, h), [])), 3),
                          _fmt(mib.get((length, h)), 2)]))
        rows.sort(key=lambda r: (r[0][0], _rank(r[0][1]), *r[0][2:]))
        lines += [f"### {length_label(length)} ({length} tokens)", ""]
        lines += _table(["configuration", "r", *tasks, "calibrated cells", "delta gold NLL", "resident KV MiB/doc"],
                        [r for _, r in rows])
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
    """Per long length and configuration: the compressed summary's ROUGE-L against the uncompressed one and
    the teacher-forced delta-NLL of the uncompressed summary (0 = unchanged; higher = worse)."""
    configs = opts.configs(opts.summary_base())
    rows = store.summary_agreement([c.config_hash() for c in configs], [sha256_hex(d["text"]) for d in docs])
    if not rows:
        return []
    length = {d["doc_id"]: d["length"] for d in docs}
    cells = defaultdict(list)
    for r in rows:
        cells[(length.get(r["doc_id"]), r["config_hash"], r["metric"])].append(r["value"])
    first = {r["config_hash"]: r for r in rows}
    table = []
    for c in configs:
        h = c.config_hash()
        for n in sorted(set(length.values())):
            if (n, h, "rouge_l") in cells:
                table.append([label(first[h]), f"{c.compression_ratio:g}", length_label(n),
                              len(cells[(n, h, "rouge_l")]), _fmt(_mean(cells[(n, h, "rouge_l")])),
                              _fmt(_mean(cells.get((n, h, "delta_nll"), [])), 3)])
    return ["## Summaries at length: agreement with the uncompressed summary", "",
            f"Plain documents: {len(docs)}; max_new_tokens {opts.summary_tokens}.", ""] + \
        _table(["configuration", "r", "length", "documents", "ROUGE-L", "delta NLL"], table) + [""]


def resident_mib(store, hashes: Sequence[str], docs: Sequence[str], doc_length: dict) -> dict:
    """(length, config hash) -> mean resident KV MiB per document."""
    rows = store.kv_bytes_by_document(hashes, docs)
    acc = defaultdict(list)
    for r in rows:
        if r["doc_id"] in doc_length:
            acc[(doc_length[r["doc_id"]], r["config_hash"])].append(r["resident"] / 2**20)
    return {k: _mean(v) for k, v in acc.items()}


def plot_frontier(scores: Sequence[dict], calib: Sequence[dict], mib: dict, path: Path) -> Optional[Path]:
    """Accuracy on the calibrated cells against resident KV MiB per document: one panel per length, one
    curve per method and budget mode (its points are the ratios), the uncompressed model as a star."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig, axes = plt.subplots(1, len(lengths), figsize=(5.5 * len(lengths), 4.2), squeeze=False)
    for ax, length in zip(axes[0], lengths):
        for (n, name), xs in sorted(pts.items()):
            if n != length:
                continue
            xs = sorted(xs)
            if name == "no_press":
                ax.plot([x for x, _, _ in xs], [y for _, y, _ in xs], "k*", markersize=12, label="uncompressed")
                continue
            # colour: the method; line: the head budget; marker: the prefill mode
            press = name.split()[0]
            ax.plot([x for x, _, _ in xs], [y for _, y, _ in xs], color=COLOURS.get(press, "C9"),
                    linestyle="--" if " adaptive" in name else "-", marker="s" if name.endswith(" streaming") else "o",
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
    plt.close(fig)
    return path


def headline_table(heads: Sequence[dict], a: str, b: str, digits: int) -> list[str]:
    return _table(["r", "head budget", "prefill", "questions", a, b, "better", "worse", "same", "mean diff +- SE"],
                  [[f"{h['ratio']:g}{' *' if h.get('best') else ''}", h["head_budget"], h["prefill"], h["n"],
                    _fmt(h["acc_a"], digits), _fmt(h["acc_b"], digits), h["better"], h["worse"], h["same"],
                    f"{h['mean_diff']:+.3f} +- {_fmt(h['se'], 3)}"] for h in heads])


def write_report(store, opts: SuiteOptions, docs: Sequence[dict], stage_s: Optional[dict] = None,
                 summary_docs: Sequence[dict] = ()) -> SuiteResult:
    """The markdown report and the frontier plot for ``docs`` (and ``summary_docs``) under ``opts``'s
    configurations."""
    hashes = [opts.base().reference().config_hash()] + [c.config_hash() for c in opts.configs()]
    doc_hashes = [sha256_hex(d["text"]) for d in docs]
    scores = store.suite_scores(hashes, doc_hashes, RECALL)
    nll = store.suite_scores(hashes, doc_hashes, DELTA_GOLD_NLL)
    calib = calibration(scores, opts.threshold)
    heads, cells = headline(scores, calib, long_from=opts.long_from)
    mib = resident_mib(store, hashes, doc_hashes, {d["doc_id"]: d["length"] for d in docs})
    out = opts.out_dir
    plot = plot_frontier(scores, calib, mib, out / PLOT_NAME)

    n_q = sum(len(d["questions"]) for d in docs)
    lines = [f"# Synthetic long-context suite: {opts.model}", "",
             f"{len(docs)} documents, {n_q} questions; tasks {', '.join(opts.tasks)}; lengths "
             f"{', '.join(length_label(n) for n in sorted({d['length'] for d in docs}))}; seed {opts.seed}; "
             f"max_new_tokens {opts.max_new_tokens}. Accuracy = share of a question's gold parts in the answer "
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
    lines += ["", "## Headline: NestedKV against KeyDiff (same budget mode)", ""]
    if cells:
        lines.append("Cells: " + ", ".join(f"{t} {length_label(n)}" for t, n in sorted(cells)) + ". Paired per "
                     "question; diff = NestedKV - KeyDiff; * = NestedKV's best budget mode at that ratio (chosen "
                     "on these same questions).")
        lines.append("")
        lines += headline_table(heads, "NestedKV", "KeyDiff", 2)
        nll_heads, _ = headline(nll, calib, long_from=opts.long_from, lower_is_better=True)
        if nll_heads:
            lines += ["", "Delta gold NLL (teacher-forced NLL of the gold answer under the compressed cache minus "
                      "under the full one, nats per token; lower is better), same cells and pairing:", ""]
            lines += headline_table(nll_heads, "NestedKV", "KeyDiff", 3)
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
    lines += accuracy_tables(scores, calib, mib, nll)
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


# -- the whole suite ----------------------------------------------------------------------------------------
def run_suite(opts: SuiteOptions, *, runner=None, count=None, hooks=None, log=print) -> SuiteResult:
    """Generate, calibrate, run the methods on the calibrated cells, score and report. ``count``: the token
    counter (default: the model's tokenizer); ``runner``: an engine runner (default: the model's)."""
    from pipeline.engine import NO_HOOKS, EngineOptions, run
    from pipeline.store import Store

    hooks = hooks or NO_HOOKS
    stage: dict[str, float] = {}
    t0 = time.perf_counter()
    if count is None:
        from pipeline.models import load_model

        count = token_counter(load_model(opts.model)[1])
    size = SIZES[opts.size]
    docs = generate(count, opts.lengths or size.lengths, opts.per_task or size.per_task, opts.seed, opts.tasks,
                    Path(opts.austen) if opts.austen else None)
    out = opts.out_dir
    out.mkdir(parents=True, exist_ok=True)
    suite = write(docs, out / SUITE_FILE)
    with Store(opts.db) as store:
        register(store, docs, out)
    stage["generate"] = time.perf_counter() - t0
    log(f"{suite}: {len(docs)} documents, {sum(len(d['questions']) for d in docs)} questions "
        f"({stage['generate']:.0f} s)")

    # Calibration and the methods are two passes over the same documents: the second loads the first's prefills.
    engine = EngineOptions(evaluate=True, batch_decode=True, prefill_cache=str(out / PREFILLS_DIR))
    t0 = time.perf_counter()
    run(str(suite), [opts.base().reference()], opts.db, engine, hooks=hooks, runner=runner)
    with Store(opts.db) as store:
        score(store)
        hashes = [opts.base().reference().config_hash()]
        scores = store.suite_scores(hashes, [sha256_hex(d["text"]) for d in docs], RECALL)
    calib = calibration(scores, opts.threshold)
    stage["calibrate"] = time.perf_counter() - t0
    for c in calib:
        log(f"calibration {c['task']} {length_label(c['length'])}: {c['accuracy']:.2f} over {c['n']} questions"
            + ("" if c["headline"] else f" (below {opts.threshold:g}: left out of the headline)"))

    keep = {(c["task"], c["length"]) for c in calib if c["headline"] or opts.all_tasks}
    todo = [d for d in docs if (d["task"], d["length"]) in keep]
    t0 = time.perf_counter()
    configs, ablation = opts.configs(), list(opts.ablation_configs())
    # the long documents run the ablation variants too, from the same one prefill
    is_long = [bool(ablation) and d["length"] >= opts.long_from for d in todo]
    long = [d for d, lg in zip(todo, is_long) if lg]
    short = [d for d, lg in zip(todo, is_long) if not lg]
    for part, want, name in ((short, configs, METHODS_FILE),
                             (long, configs + [c for c in ablation if c not in configs], ABLATION_FILE)):
        if part and configs:  # no methods: calibration only
            log(f"{len(want)} configurations on {len(part)} documents")
            run(str(write(part, out / name)), want, opts.db, engine, hooks=hooks, runner=runner)
    stage["methods"] = time.perf_counter() - t0
    summaries = opts.summary_documents(count)
    if summaries and opts.presses:
        t0 = time.perf_counter()
        configs = opts.configs(opts.summary_base())
        log(f"summaries: {len(configs)} configurations on {len(summaries)} documents")
        run(str(write(summaries, out / SUMMARY_FILE)), configs, opts.db, engine, hooks=hooks, runner=None)
        stage["summaries"] = time.perf_counter() - t0
    with Store(opts.db) as store:
        score(store)
        return write_report(store, opts, docs, stage, summaries)
