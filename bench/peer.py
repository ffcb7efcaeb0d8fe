"""Side by side with kvpress (PyTorch) on the same CPU: same documents, weights, prompt tokens and methods.

    nkv bench peer [--input data/eval_set.parquet] [--docs 2] [--new-tokens 24] [--compression-ratio 0.75]
        [--peer-python .venv-peer/bin/python] [--peer-threads 1] [--out FILE]

kvpress runs in its own environment (docs/benchmarks.md, "Side by side with kvpress"), as a subprocess started on
``bench/peer_worker.py`` that exchanges JSON files, so this process never imports torch. Steps:

1. export our fp32 weights as a transformers directory (``bench.peer_export``; reused when present);
2. probe: both engines' logits on the first ``--probe-tokens`` context tokens of the first document; the
   benchmark refuses (exit 3, one line) when they differ by more than ``--tolerance`` or in any argmax;
3. kvpress: each document prefilled per configuration under its press, every question answered;
4. our engine: each document prefilled once, compressed per configuration, every question answered.

Configurations (``METHODS``): no compression, KeyDiff, AdaKV(KeyDiff) (our keydiff, head budget adaptive),
Knorm, StreamingLLM, KVzip and Expected Attention, at one compression ratio. Ours keep the sink tokens kvpress's
press keeps: none for KeyDiff and Knorm, 4 for the others. Documents/hour is from model compute per document
(prefill, compression, question and decode): one method, and the whole sweep.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from bench.peer_export import export_fp32
from bench.rss import peak_rss
from nestedkv.run_defaults import COMPRESSION_RATIO
from pipeline.config import DEFAULT_MODEL, EVAL_INPUT, REFERENCE_PRESS, RunConfig
from pipeline.documents import load_documents
from pipeline.engine import compute, make_runner
from pipeline.evaluate import contains_gold, exact_match
from pipeline.prompts import question_text

DEFAULT_PEER_PYTHON = ".venv-peer/bin/python"
DEFAULT_EXPORT = ".peer"
WORKER = Path(__file__).with_name("peer_worker.py")


@dataclass(frozen=True)
class Method:
    """One configuration on both sides: our press settings and the kvpress press that matches them."""

    label: str
    press: str  # ours
    head_budget: str = "uniform"
    n_sink: Optional[int] = 0  # None: no press parameters (the reference)
    peer_press: Optional[str] = None  # kvpress class name; None: no compression
    peer_adaptive: bool = False  # wrapped in kvpress.AdaKVPress
    peer_kwargs: tuple = ()
    params: tuple = ()  # our press's other parameters, set to what kvpress's press does


METHODS = (
    Method(REFERENCE_PRESS, REFERENCE_PRESS, n_sink=None),
    Method("keydiff", "keydiff", peer_press="KeyDiffPress"),
    Method("adakv(keydiff)", "keydiff", head_budget="adaptive", peer_press="KeyDiffPress", peer_adaptive=True),
    Method("knorm", "knorm", peer_press="KnormPress"),
    # kvpress's StreamingLLM keeps 4 sinks by default; ours is given the same.
    Method("streaming_llm", "streaming_llm", n_sink=4, peer_press="StreamingLLMPress", peer_kwargs=(("n_sink", 4),)),
    # kvpress's KVzip: 4 sinks, 2,048-token chunks (our default too), one budget over every layer and head
    # (its layerwise=False).
    Method("kvzip", "kvzip", head_budget="adaptive", n_sink=4, peer_press="KVzipPress"),
    # kvpress's Expected Attention: 4 sinks, statistics of every context query after them (ours: the recent ones).
    Method("expected_attention", "expected_attention", n_sink=4, peer_press="ExpectedAttentionPress",
           params=(("n_recent", 2**31 - 1),)),
)


class Refusal(Exception):
    """The two sides cannot be compared; the message is the one line printed."""


# -- the probe --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LogitCheck:
    positions: int
    max_abs_diff: float
    argmax_differ: int  # positions whose argmax token differs
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= self.tolerance and self.argmax_differ == 0

    def line(self) -> str:
        return (f"logits on a {self.positions}-token probe: max |diff| {self.max_abs_diff:.3g} "
                f"(tolerance {self.tolerance:g}), argmax differs at {self.argmax_differ} of {self.positions} positions")


def compare_logits(ours, theirs, tolerance: float = 1e-2) -> LogitCheck:
    """How far two ``[positions, vocab]`` logit arrays are apart; ``Refusal`` when they cannot even be
    compared (shape, non-finite values)."""
    a, b = np.asarray(ours, dtype=np.float64), np.asarray(theirs, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 2 or a.shape[0] == 0:
        raise Refusal(f"refusing to compare: probe logits have shapes {a.shape} (ours) and {b.shape} (kvpress)")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise Refusal("refusing to compare: probe logits are not all finite")
    return LogitCheck(int(a.shape[0]), float(np.max(np.abs(a - b))), int(np.sum(a.argmax(1) != b.argmax(1))),
                      float(tolerance))


def check_probe(ours, theirs, tolerance: float = 1e-2) -> LogitCheck:
    check = compare_logits(ours, theirs, tolerance)
    if not check.ok:
        raise Refusal(f"refusing to compare: the two models differ, {check.line()}")
    return check


# -- the peer subprocess ------------------------------------------------------------------------------
def call_peer(python: str, request: dict, workdir: Path, timeout: Optional[float] = None) -> dict:
    """Run one worker request in the peer environment; its JSON answer."""
    req, resp = workdir / f"{request['op']}-request.json", workdir / f"{request['op']}-response.json"
    req.write_text(json.dumps(request))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the peer must not see this checkout's mlx
    env.update(HF_HUB_DISABLE_PROGRESS_BARS="1", TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1")
    proc = subprocess.run([python, str(WORKER), str(req), str(resp)], env=env, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise Refusal(f"the kvpress worker failed (exit {proc.returncode}): {tail[0]}")
    return json.loads(resp.read_text())


def peer_config(m: Method, ratio: float) -> dict:
    return {"label": m.label, "press": m.peer_press, "compression_ratio": ratio, "adaptive": m.peer_adaptive,
            "kwargs": dict(m.peer_kwargs)}


# -- our side ---------------------------------------------------------------------------------------
def our_configs(model: str, ratio: float, max_new_tokens: int, methods: Sequence[Method] = METHODS) -> list:
    out = []
    for m in methods:
        if m.press == REFERENCE_PRESS:
            out.append(RunConfig(task="qa", model=model, max_new_tokens=max_new_tokens).reference())
        else:
            out.append(RunConfig(task="qa", model=model, press=m.press, compression_ratio=ratio,
                                 # kvpress scores the keys as cached, RoPE included
                                 head_budget=m.head_budget,
                                 press_params={"n_sink": m.n_sink, "unrotate": False, **dict(m.params)},
                                 max_new_tokens=max_new_tokens))
    return out


def run_ours(runner, docs, configs, methods: Sequence[Method] = METHODS) -> dict:
    """label -> one record per document (the shape ``summarize`` reads)."""
    out: dict = {m.label: [] for m in methods}
    for doc in docs:
        outcomes = compute(runner, doc, configs)
        for m, o in zip(methods, outcomes):
            r = o.result
            if r.status != "ok":
                raise Refusal(f"our engine failed on {doc.doc_id} under {m.label}: {r.error}")
            out[m.label].append({
                "doc_id": doc.doc_id, "n_tokens": r.n_tokens, "prefill_s": r.prefill_s, "compress_s": r.compress_s,
                "decode_s": [q.decode_s for q in r.questions], "n_generated": [q.n_generated for q in r.questions],
                "answers": [q.output for q in r.questions],
                "kv_resident_bytes": sum(l.bytes_resident for l in r.layers),
            })
    return out


def peer_records(response: dict, methods: Sequence[Method] = METHODS) -> dict:
    """The worker's answer in ``run_ours``'s shape (kvpress compresses inside its prefill: no compress_s)."""
    out: dict = {m.label: [] for m in methods}
    for doc in response["documents"]:
        for run in doc["runs"]:
            out[run["label"]].append({"doc_id": doc["doc_id"], "n_tokens": doc["n_tokens"], "compress_s": 0.0,
                                      **{k: run[k] for k in ("prefill_s", "decode_s", "n_generated", "answers",
                                                             "kv_resident_bytes")}})
    return out


def probe_logits(model, ids: list) -> np.ndarray:
    logits = model(mx.array(ids, dtype=mx.int32)[None])[0].astype(mx.float32)
    mx.eval(logits)
    return np.array(logits)


# -- figures ----------------------------------------------------------------------------------------
def _per_hour(n_docs: int, seconds: float) -> float:
    return round(3600 * n_docs / seconds, 1) if seconds > 0 else 0.0


def side_figures(records: dict, one_method: str, shared_prefill: bool) -> dict:
    """Throughput of one side. ``shared_prefill``: every configuration starts from one prefill per
    document (ours), else each configuration prefills on its own (kvpress)."""
    ref = records[REFERENCE_PRESS]
    n_docs = len(ref)
    tokens = sum(d["n_tokens"] for d in ref)
    prefill = sum(d["prefill_s"] for d in ref)
    dec_s = sum(sum(d["decode_s"]) for runs in records.values() for d in runs)
    dec_n = sum(sum(d["n_generated"]) for runs in records.values() for d in runs)

    def cost(label: str, with_prefill: bool) -> float:
        return sum((d["prefill_s"] if with_prefill else 0.0) + d["compress_s"] + sum(d["decode_s"])
                   for d in records[label])

    one = cost(one_method, True)
    if shared_prefill:
        sweep = prefill + sum(cost(label, False) for label in records)
    else:
        sweep = sum(cost(label, True) for label in records)
    return {"documents": n_docs, "context_tokens": tokens,
            "prefill_tok_s": round(tokens / prefill, 1) if prefill else 0.0,
            "decode_tok_s": round(dec_n / dec_s, 1) if dec_s else 0.0,
            "docs_per_hour_one": _per_hour(n_docs, one), "docs_per_hour_sweep": _per_hour(n_docs, sweep),
            "sweep_configurations": len(records)}


def summarize(ours: dict, peer: dict, golds: list, one_method: str = "keydiff") -> dict:
    """Accuracy per method on both sides, per-question agreement, KV bytes and throughput.
    ``golds``: per document, the gold answer of each question."""
    rows = []
    ref_ours = sum(d["kv_resident_bytes"] for d in ours[REFERENCE_PRESS])
    ref_peer = sum(d["kv_resident_bytes"] for d in peer[REFERENCE_PRESS])
    for label in ours:
        a = [(x, g) for d, gs in zip(ours[label], golds) for x, g in zip(d["answers"], gs)]
        b = [x for d in peer[label] for x in d["answers"]]
        if len(a) != len(b):
            raise ValueError(f"{label}: {len(a)} answers from us, {len(b)} from kvpress")
        ca = [contains_gold(x, g) for x, g in a]
        cb = [contains_gold(y, g) for (_, g), y in zip(a, b)]
        kv_o = sum(d["kv_resident_bytes"] for d in ours[label])
        kv_p = sum(d["kv_resident_bytes"] for d in peer[label])
        rows.append({
            "method": label, "questions": len(a),
            "ours_correct": sum(ca), "peer_correct": sum(cb),
            "same_correctness": sum(x == y for x, y in zip(ca, cb)),
            "same_answer": sum(exact_match(x, y) for (x, _), y in zip(a, b)),
            "ours_kv_bytes": kv_o // max(1, len(ours[label])), "peer_kv_bytes": kv_p // max(1, len(peer[label])),
            "ours_kv_share": round(kv_o / ref_ours, 3) if ref_ours else None,
            "peer_kv_share": round(kv_p / ref_peer, 3) if ref_peer else None,
        })
    return {"methods": rows, "one_method": one_method,
            "ours": side_figures(ours, one_method, shared_prefill=True),
            "peer": side_figures(peer, one_method, shared_prefill=False)}


def _mib(n) -> str:
    return f"{n / 2**20:.1f}" if n is not None else "-"


def _kv(n: int, share: Optional[float]) -> str:
    return _mib(n) if share is None else f"{_mib(n)} ({share:.0%})"


def format_report(report: dict) -> str:
    """The printed tables: methods (accuracy, agreement, resident KV) and throughput."""
    lines = []
    head = ("method", "ours", "kvpress", "same correct", "same answer", "KV MiB ours", "KV MiB kvpress")
    table = [head]
    for r in report["methods"]:
        n = r["questions"]
        table.append((r["method"], f"{r['ours_correct']}/{n} ({r['ours_correct'] / n:.2f})" if n else "-",
                      f"{r['peer_correct']}/{n} ({r['peer_correct'] / n:.2f})" if n else "-",
                      f"{r['same_correctness']}/{n}", f"{r['same_answer']}/{n}",
                      _kv(r["ours_kv_bytes"], r["ours_kv_share"]), _kv(r["peer_kv_bytes"], r["peer_kv_share"])))
    lines += _columns(table)
    lines.append("")
    o, p = report["ours"], report["peer"]
    rows = [("", "ours (mlx)", "kvpress (torch)"),
            ("prefill tokens/s", o["prefill_tok_s"], p["prefill_tok_s"]),
            ("decode tokens/s", o["decode_tok_s"], p["decode_tok_s"]),
            (f"documents/hour, {report['one_method']}", o["docs_per_hour_one"], p["docs_per_hour_one"]),
            (f"documents/hour, {o['sweep_configurations']}-configuration sweep", o["docs_per_hour_sweep"],
             p["docs_per_hour_sweep"])]
    if "ours_peak_rss_bytes" in report:
        rows.append(("peak RSS MiB", _mib(report["ours_peak_rss_bytes"]), _mib(report["peer_peak_rss_bytes"])))
    lines += _columns([tuple(str(c) for c in r) for r in rows])
    return "\n".join(lines)


def _columns(rows: list) -> list[str]:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
            for r in rows]


# -- the command ------------------------------------------------------------------------------------
def setup_hint(python: str) -> str:
    return (f"no kvpress environment at {python}; create it (docs/benchmarks.md, 'Side by side with kvpress'): "
            "python -m venv .venv-peer && .venv-peer/bin/pip install torch==2.13.0 --index-url "
            "https://download.pytorch.org/whl/cpu && .venv-peer/bin/pip install kvpress==0.5.5")


def measure(a) -> dict:
    if not Path(a.peer_python).is_file():
        raise Refusal(setup_hint(a.peer_python))
    load_start = os.getloadavg()
    docs = [d for d in load_documents(a.input)[0] if d.questions][: a.docs]
    if not docs:
        raise Refusal(f"{a.input} has no documents with questions")
    export = export_fp32(a.model, Path(a.export_dir) / f"{Path(a.model).name}-fp32")
    configs = our_configs(a.model, a.compression_ratio, a.max_new_tokens)
    runner = make_runner(configs[0])
    prepared = [runner.prepare(d) for d in docs]
    eos = sorted(runner.eos)
    with tempfile.TemporaryDirectory(prefix="nkv-peer-") as tmp:
        tmp = Path(tmp)
        probe_ids = prepared[0].context_ids[: a.probe_tokens]
        call_peer(a.peer_python, {"op": "probe", "model_dir": str(export), "threads": a.peer_threads,
                                  "probe_ids": probe_ids, "probe_out": str(tmp / "probe.npy")}, tmp)
        check = check_probe(probe_logits(runner.model, probe_ids), np.load(tmp / "probe.npy"), a.tolerance)
        print(f"probe ok: {check.line()}", flush=True)

        request = {"op": "bench", "model_dir": str(export), "threads": a.peer_threads, "eos": eos,
                   "max_new_tokens": a.max_new_tokens,
                   "configs": [peer_config(m, a.compression_ratio) for m in METHODS],
                   "documents": [{"doc_id": d.doc_id, "context_ids": p.context_ids,
                                  "questions_ids": [q[1] for q in p.questions],
                                  # what kvpress's pipeline would be given: it must tokenize to the same ids
                                  "context_text": d.text + "\n\n",
                                  "question_texts": [question_text(runner.config, q) for q in d.questions]}
                                 for d, p in zip(docs, prepared)]}
        response = call_peer(a.peer_python, request, tmp)
        print(f"kvpress done in {response['wall_s']:.0f} s", flush=True)
        t0 = time.perf_counter()
        ours = run_ours(runner, docs, configs)
        ours_wall = time.perf_counter() - t0
        ours_rss = peak_rss()
        print(f"ours done in {ours_wall:.0f} s", flush=True)

    peer = peer_records(response)
    report = summarize(ours, peer, [[q[2] for q in p.questions] for p in prepared])
    report.update({
        "input": a.input, "doc_ids": [d.doc_id for d in docs], "compression_ratio": a.compression_ratio,
        "max_new_tokens": a.max_new_tokens, "probe": check.line(), "peer_threads": response["threads"],
        "peer_versions": response["versions"],
        "prompt_equal_to_kvpress_pipeline": sum(d["prompt_equal"] for d in response["documents"]),
        "ours_wall_s": round(ours_wall, 1), "peer_wall_s": round(response["wall_s"], 1),
        "ours_peak_rss_bytes": ours_rss, "peer_peak_rss_bytes": response["peak_rss_bytes"],
        "loadavg_start": [round(x, 2) for x in load_start], "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(), "answers": {"ours": {k: [d["answers"] for d in v] for k, v in ours.items()},
                                            "peer": {k: [d["answers"] for d in v] for k, v in peer.items()}},
    })
    return report


class PeerOptions(BaseModel):
    """What ``nkv bench peer`` runs: ``docs`` documents (with questions) from the start of ``input``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    input: str = Field(EVAL_INPUT, description="the batch")
    docs: int = Field(2, ge=1, description="documents (with questions) from the start of the input")
    model: str = DEFAULT_MODEL
    compression_ratio: float = Field(COMPRESSION_RATIO, description="fraction of the context removed")
    max_new_tokens: int = Field(24, ge=1, description="tokens per answer at most")
    peer_python: str = Field(default_factory=lambda: os.environ.get("NKV_PEER_PYTHON", DEFAULT_PEER_PYTHON),
                             description="the kvpress environment's python (default: $NKV_PEER_PYTHON or "
                                         f"{DEFAULT_PEER_PYTHON})")
    peer_threads: int = Field(1, ge=1, description="torch threads")
    export_dir: str = Field(DEFAULT_EXPORT, description="where the fp32 transformers copy is written")
    probe_tokens: int = Field(256, ge=1, description="context tokens whose logits both engines must agree on")
    tolerance: float = Field(1e-2, gt=0, description="max |logit difference| on the probe")
    out: Optional[str] = Field(None, description="also write the report here (JSON)")


def run(a: PeerOptions) -> dict:
    """The benchmark, printed (and written to ``a.out``); ``Refusal`` when it cannot compare."""
    report = measure(a)
    print(f"{len(report['doc_ids'])} documents of {a.input} ({report['ours']['context_tokens']} context tokens), "
          f"r = {a.compression_ratio:g}, max {a.max_new_tokens} new tokens; kvpress "
          f"{report['peer_versions'].get('kvpress')} on torch {report['peer_versions'].get('torch')} with "
          f"{report['peer_threads']} thread(s); prompts equal to kvpress's pipeline on "
          f"{report['prompt_equal_to_kvpress_pipeline']}/{len(report['doc_ids'])} documents")
    print(report["probe"])
    print(format_report(report))
    print(f"load average {report['loadavg_start']} at the start, {report['loadavg_end']} at the end, "
          f"{report['cpus']} CPUs")
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=2))
    return report
