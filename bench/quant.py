"""Quantized KV against mlx-lm's own and against the model's dtype: answers and decode speed.

    nkv bench quant [--input data/eval_set.parquet] [--docs 6] [--max-new-tokens 24]
        [--speed-docs 1] [--decode-tokens 64] [--out FIGURES.json]

1. For the first ``--docs`` documents, every question answered (greedy, one at a time) from ``NoPress(kv_bits=8)``
   and from mlx-lm's ``KVCache`` prefilled in the same chunks then converted with ``to_quantized`` (its
   ``QuantizedKVCache``): how many answers are equal, and for the others the first differing token position.
2. For ``--speed-docs`` documents: compression time (scoring, selection and quantization) and decode tokens/s,
   NestedKV at r = 0.75 and the uncompressed cache, each at 16 (the model's dtype), 8 and 4 bits, decoding
   ``--decode-tokens`` greedy tokens after the first question (EOS ignored, so every row decodes as many).
3. For ``--error-docs`` documents of the sample batch (not the evaluation set): how much each quantizer moves the
   model's loss. The last ``CONTINUATION`` tokens of each text are scored teacher-forced from the rest's cache,
   quantized (r = 0) at 8 and 4 bits, keys rotated or not (``kv_hadamard``); the figure is the mean increase
   in negative log-likelihood per token over the unquantized cache.
Accuracy and resident bytes come from ``nkv eval`` with ``--kv-bits`` (docs/quantized-kv.md).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Callable, Optional

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache

from pydantic import Field

import nestedkv
from pipeline.config import DEFAULT_INPUT, DEFAULT_MODEL, EVAL_INPUT, RunConfig
from pipeline.documents import load_documents
from pipeline.engine import make_runner
from pipeline.prompts import encode
from pipeline.results import DocumentResult
from pipeline.runner import prefill

CONTINUATION = 128  # tokens scored per document by the error figure


def _tokens(runner, cache, ids: list[int]) -> list[int]:
    out = []
    for token, _ in generate_step(mx.array(ids, dtype=mx.int32), runner.model, max_tokens=runner.config.max_new_tokens,
                                  prompt_cache=cache, prefill_step_size=runner.config.prefill_step_size):
        if int(token) in runner.eos:
            break
        out.append(int(token))
    return out


def compare_with_mlx_lm(runner, docs, hadamard: bool = False) -> dict:
    """Our 8-bit r = 0 answers against mlx-lm's QuantizedKVCache, question by question (``hadamard``: ours with
    rotated keys, which mlx-lm does not have)."""
    equal, differ = 0, []
    for doc in docs:
        prepared = runner.prepare(doc)
        res = DocumentResult(doc.doc_id, doc.content_sha256, doc.n_chars, doc.title)
        ours = runner.prefill(prepared, res, press=nestedkv.NoPress(kv_bits=8, kv_hadamard=hadamard))
        nestedkv.compress(ours)
        ref = [KVCache() for _ in runner.model.layers]
        prefill(runner.model, ref, prepared.context_ids, runner.config.prefill_step_size)
        ref = [c.to_quantized(group_size=64, bits=8) for c in ref]
        n_ctx = ref[0].offset
        for i, (_, ids, _) in enumerate(prepared.questions):
            a, b = _tokens(runner, ours, ids), _tokens(runner, ref, ids)
            for c in ours:
                c.rewind()
            for c in ref:
                c.trim(c.offset - n_ctx)
            if a == b:
                equal += 1
            else:
                pos = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                differ.append({"doc_id": doc.doc_id, "question": i, "first_differing_token": pos})
    return {"answers_compared": equal + len(differ), "answers_equal": equal, "differing": differ}


def decode_speed(runner, docs, n_tokens: int) -> list[dict]:
    """Compress time and decode tokens/s per (ratio, bits), from one uncompressed prefill per document."""
    rows: dict[tuple, dict] = {}
    for doc in docs:
        prepared = runner.prepare(doc)
        res = DocumentResult(doc.doc_id, doc.content_sha256, doc.n_chars, doc.title)
        full = runner.prefill(prepared, res, press=nestedkv.NoPress())
        for ratio in (0.75, 0.0):
            for bits in (None, 8, 4):
                press = nestedkv.NestedKVPress(compression_ratio=ratio, head_budget="adaptive", kv_bits=bits)
                cache = nestedkv.clone(full, press)
                t0 = time.perf_counter()
                nestedkv.compress(cache)
                compress_s = time.perf_counter() - t0
                resident = sum(s.bytes_resident for s in nestedkv.layer_stats(cache))  # as stored: after compression
                logits = runner.model(mx.array(prepared.questions[0][1], dtype=mx.int32)[None], cache=cache)[:, -1]
                tok = mx.argmax(logits, axis=-1)
                mx.eval(tok)
                t0 = time.perf_counter()
                for _ in range(n_tokens):
                    tok = mx.argmax(runner.model(tok[:, None], cache=cache)[:, -1], axis=-1)
                    mx.eval(tok)
                decode_s = time.perf_counter() - t0
                r = rows.setdefault((ratio, bits or 16), {"compression_ratio": ratio, "kv_bits": bits or 16,
                                                          "compress_s": 0.0, "decode_s": 0.0, "tokens": 0,
                                                          "resident_bytes": 0})
                r["compress_s"] += compress_s
                r["decode_s"] += decode_s
                r["tokens"] += n_tokens
                r["resident_bytes"] += resident
                del cache
    out = []
    for r in rows.values():
        out.append({**r, "compress_s": round(r["compress_s"] / len(docs), 3),
                    "decode_tok_s": round(r["tokens"] / r["decode_s"], 1), "decode_s": round(r["decode_s"], 2)})
    return out


def quantization_error(runner, docs) -> list[dict]:
    """Mean increase of the continuation's NLL per token, per (bits, group size, rotation), over the 16-bit cache."""
    variants = [(bits, 64, rotate) for bits in (8, 4) for rotate in (False, True)]
    sums = {v: 0.0 for v in variants}
    n_docs = 0
    for doc in docs:
        ids = encode(runner.tokenizer, doc.text)
        if len(ids) < 2 * CONTINUATION:
            continue
        ctx, cont = ids[:-CONTINUATION], ids[-CONTINUATION:]
        full = nestedkv.make_cache(runner.model, nestedkv.NoPress())
        prefill(runner.model, full, ctx[:-1], runner.config.prefill_step_size)
        inputs = mx.array([ctx[-1:] + cont[:-1]], dtype=mx.int32)

        def nll(cache) -> float:
            logits = runner.model(inputs, cache=cache)[0].astype(mx.float32)
            logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            return -mx.take_along_axis(logp, mx.array(cont)[:, None], axis=-1).mean().item()

        base = nll(nestedkv.clone(full))
        for bits, group, rotate in variants:
            cache = nestedkv.clone(full, nestedkv.NoPress(kv_bits=bits, kv_group_size=group, kv_hadamard=rotate))
            nestedkv.compress(cache)
            sums[(bits, group, rotate)] += nll(cache) - base
        n_docs += 1
    return [{"kv_bits": b, "kv_group_size": g, "kv_hadamard": h, "docs": n_docs,
             "delta_nll": round(sums[(b, g, h)] / max(n_docs, 1), 5)} for b, g, h in variants]


def run(input: Annotated[str, Field(description="the batch (with questions) for the mlx-lm comparison")] = EVAL_INPUT,
        model: str = DEFAULT_MODEL,
        docs: Annotated[int, Field(description="documents for the mlx-lm comparison (0: skip)")] = 6,
        max_new_tokens: Annotated[int, Field(description="tokens per answer at most")] = 24,
        speed_docs: Annotated[int, Field(description="documents for the speed figures (0: skip)")] = 1,
        decode_tokens: Annotated[int, Field(description="greedy tokens decoded per speed row")] = 64,
        error_docs: Annotated[int, Field(description="documents for the loss each quantizer adds (0: skip)")] = 5,
        error_input: Annotated[str, Field(description="the batch for that loss")] = DEFAULT_INPUT,
        out: Annotated[Optional[str], Field(description="also write the figures here (JSON)")] = None,
        log: Callable[[str], None] = lambda s: print(s, flush=True)) -> dict:
    """The three parts (``docs``, ``speed_docs`` or ``error_docs`` 0: that part skipped), each figure through
    ``log`` as it comes (and all of them to ``out`` as JSON)."""
    runner = make_runner(RunConfig(task="qa", model=model, max_new_tokens=max_new_tokens))
    loaded, _ = load_documents(input)
    figures = {"input": input, "model": model, "max_new_tokens": max_new_tokens}
    if error_docs:
        figures["error"] = quantization_error(runner, load_documents(error_input)[0][:error_docs])
        for row in figures["error"]:
            log(json.dumps(row))
    if docs:
        for key, rotate in (("mlx_lm_8bit", False), ("mlx_lm_8bit_rotated_keys", True)):
            figures[key] = compare_with_mlx_lm(runner, loaded[:docs], hadamard=rotate)
            log(json.dumps({key: figures[key]}))
    if speed_docs:
        figures["speed"] = decode_speed(runner, loaded[:speed_docs], decode_tokens)
        for row in figures["speed"]:
            log(json.dumps(row))
    if out:
        Path(out).write_text(json.dumps(figures, indent=2))
    return figures
