"""Memory at its peak, for real text at growing lengths: no compression, whole-context compression and
streaming compression (budget and ratio), and adaptive head budgets padded against unpadded.

    nkv bench memory [--lengths 1024,2048,4096,8192] [--budget 512] [--compression-ratio 0.75] [--out DIR]

Per length, one uncompressed prefill serves the uncompressed and the whole-context rows (they hold the
whole context while prefilling, by definition); each streaming row prefills on its own. Columns: peak
K/V MiB while prefilling and while decoding (the caches' own buffers, measured), process peak MiB
(``mx.get_peak_memory``: weights and activations included), prefill seconds (compression included) and
decode tokens per second. Writes ``memory.json``, ``memory.md`` and ``memory.png`` to ``--out``.
"""

from __future__ import annotations

from typing import Annotated, Sequence
import json
import time
from pathlib import Path

import mlx.core as mx
import pyarrow.parquet as pq
from matplotlib.figure import Figure

from pydantic import Field

import nestedkv
from nestedkv.run_defaults import COMPRESSION_RATIO
from pipeline import tables
from pipeline.config import DEFAULT_MODEL, INT32_MAX, RunConfig
from pipeline.engine import make_runner
from pipeline.prompts import encode
from pipeline.results import DocumentResult, QuestionResult
from pipeline.runner.window import PreparedDocument

MIB = 2**20


def _text_ids(tokenizer, n: int) -> list[int]:
    """``n`` token ids of real text: the bundled novels' chapters, one after another."""
    root = Path(__file__).resolve().parents[1] / "data"
    texts = pq.read_table(root / "eval_set.parquet", columns=["text"])["text"].to_pylist()
    texts += pq.read_table(root / "sample_batch.parquet", columns=["text"])["text"].to_pylist()
    ids: list[int] = []
    for t in texts:
        ids += encode(tokenizer, t + "\n\n")
        if len(ids) >= n:
            return ids[:n]
    raise ValueError(f"the bundled text has only {len(ids)} tokens; asked for {n}")


def measure(model_ref: str, lengths: list[int], budget: int, ratio: float, chunk: int, new_tokens: int,
            log=print) -> list[dict]:
    config = RunConfig(task="summarize", model=model_ref, prefill_step_size=chunk, max_new_tokens=new_tokens,
                       repetition_penalty=1.0)
    runner = make_runner(config)
    runner.eos = set()  # decode speed is timed over exactly new_tokens tokens, whatever the text says
    question = encode(runner.tokenizer, "\n\n" + config.summary_instruction)
    rows = []

    def finish(label: str, n: int, cache, res: DocumentResult, prefill_s: float) -> None:
        runner.compress(cache, res)
        peak_prefill = max(res.peak_prefill_bytes, mx.get_peak_memory())
        stats = nestedkv.layer_stats(cache)
        kept = sum(m.bytes_kept for m in stats)
        # What a padded layout allocates: every head of a layer as long as its longest.
        padded = sum(m.kept_max * m.n_kv_heads * m.bytes_kept / (m.kept_mean * m.n_kv_heads)
                     for m in stats if m.kept_mean)
        q = QuestionResult(0, config.summary_instruction)
        mx.reset_peak_memory()
        nestedkv.reset_peak(cache)
        runner.answer(cache, question, q)
        rows.append({
            "tokens": n, "mode": label,
            "peak_kv_prefill_mib": round(res.peak_kv_prefill_bytes / MIB, 1),
            "peak_kv_decode_mib": round(sum(nestedkv.peak_kv_bytes(cache)) / MIB, 1),
            "full_kv_mib": round(sum(m.bytes_full for m in stats) / MIB, 1),
            "process_peak_mib": round(max(peak_prefill, mx.get_peak_memory()) / MIB, 1),
            "prefill_s": round(prefill_s + res.compress_s, 2),
            "decode_tok_s": round(q.decode_tok_s, 2),
            "resident_over_kept": round(sum(m.bytes_resident for m in stats) / kept, 3) if kept else None,
            "padded_over_kept": round(padded / kept, 3) if kept else None,
        })
        log(json.dumps(rows[-1]))

    room = (runner.max_context or max(lengths) + len(question) + new_tokens) - len(question) - new_tokens
    for n in (min(n, room) for n in lengths):  # the model's window holds the question and the answer too
        ids = _text_ids(runner.tokenizer, n)
        prepared = PreparedDocument(ids, [(config.summary_instruction, question, None)])
        shell = DocumentResult("bench", "-", n)
        full = runner.prefill(prepared, shell, press=nestedkv.NoPress())
        whole_s = shell.prefill_s
        presses = {
            "no_press": nestedkv.NoPress(),
            f"whole budget {budget}": nestedkv.NestedKVPress(budget=budget),
            f"whole r={ratio}": nestedkv.NestedKVPress(compression_ratio=ratio),
            f"whole r={ratio} adaptive": nestedkv.NestedKVPress(compression_ratio=ratio, head_budget="adaptive"),
        }
        for label, press in presses.items():
            res = DocumentResult("bench", "-", n, peak_prefill_bytes=shell.peak_prefill_bytes,
                                 peak_kv_prefill_bytes=shell.peak_kv_prefill_bytes)
            mx.reset_peak_memory()
            finish(label, n, nestedkv.clone(full, press), res, whole_s)
        del full
        for label, press in {f"streaming budget {budget}": nestedkv.NestedKVPress(budget=budget, prefill="streaming"),
                             f"streaming r={ratio}": nestedkv.NestedKVPress(compression_ratio=ratio,
                                                                           prefill="streaming")}.items():
            res = DocumentResult("bench", "-", n)
            t0 = time.perf_counter()
            cache = runner.prefill(prepared, res, press=press)
            finish(label, n, cache, res, time.perf_counter() - t0)
        mx.clear_cache()
    return rows


def to_markdown(rows: list[dict]) -> str:
    return "\n".join(tables.markdown_dicts(rows)) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    fig = Figure(figsize=(11, 4))  # no pyplot: no global backend state, renders with Agg
    a, b = fig.subplots(1, 2)
    for mode in dict.fromkeys(r["mode"] for r in rows):
        rs = [r for r in rows if r["mode"] == mode]
        a.plot([r["tokens"] for r in rs], [r["peak_kv_prefill_mib"] for r in rs], marker="o", label=mode)
        b.plot([r["tokens"] for r in rs], [r["prefill_s"] for r in rs], marker="o", label=mode)
    a.set(xlabel="context tokens", ylabel="peak K/V MiB while prefilling", title="peak KV memory")
    b.set(xlabel="context tokens", ylabel="prefill + compress seconds", title="prefill time")
    for ax in (a, b):
        ax.grid(alpha=0.3)
    a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(model: str = DEFAULT_MODEL,
         lengths: Annotated[Sequence[int], Field(description="context lengths")] = (1024, 2048, 4096, 8192),
         budget: Annotated[int, Field(description="tokens kept per head")] = 512,
         compression_ratio: Annotated[float, Field(description="fraction of the context removed")] = COMPRESSION_RATIO,
         chunk: Annotated[int, Field(description="prefill chunk size")] = 512,
         new_tokens: Annotated[int, Field(description="tokens decoded per measurement")] = 32,
         out: Annotated[str, Field(description="folder for the table and the PNG plot")] = "reports/memory",
         ) -> list[dict]:
    if not lengths or not all(1 <= n <= INT32_MAX for n in lengths):
        raise ValueError(f"--lengths: context lengths must be whole numbers of tokens in 1..{INT32_MAX}, got "
                         f"{','.join(map(str, lengths))}")
    rows = measure(model, lengths, budget, compression_ratio, chunk, new_tokens)
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "memory.json").write_text(json.dumps(rows, indent=2))
    (folder / "memory.md").write_text(to_markdown(rows))
    plot(rows, folder / "memory.png")
    print(to_markdown(rows))
    print(f"wrote {folder / 'memory.md'}, {folder / 'memory.json'} and {folder / 'memory.png'}")
    return rows
