"""Peak memory of each press's scoring, at long contexts, against the KV it scores.

    nkv bench scoring-memory [--model smollm2-135m] [--lengths 4096,16384,32768] [--layers 2]

Per length: one uncompressed prefill of the bundled novels' text (the model cut to its first ``--layers`` layers, so
32k tokens prefill in minutes on a CPU; each layer is scored on its own, so the peak per layer is what a whole
model's scoring reaches too), then each press compresses a copy of it. The figure is what compression allocates
beyond the cache it compresses (``mx.get_peak_memory`` less the memory held before it), beside the K/V bytes of
one layer and of the cut model. Positions past the model's window are read as they come: the memory, not the
answers, is measured.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional, Sequence

import mlx.core as mx

from pydantic import Field

import nestedkv
from nestedkv.cache import arrays, full_layers
from nestedkv.run_defaults import COMPRESSION_RATIO
from pipeline import models
from pipeline.config import INT32_MAX
from pipeline.prompts import encode, repeat_instruction
from pipeline.runner import prefill
from pipeline.tasks import summary_documents, token_counter

MIB = 2**20
PRESSES = ("nestedkv", "keydiff", "kvzip", "expected_attention")


def measure(model_ref: str, lengths: Sequence[int], n_layers: int, ratio: float, chunk: int, log=print) -> list[dict]:
    model, tokenizer = models.load_model(model_ref)
    inner = getattr(model, "model", model)
    inner.layers = inner.layers[:n_layers]  # scoring is per layer: fewer layers, the same peak per layer
    instruction = repeat_instruction(tokenizer)
    rows = []
    for n in lengths:
        ids = encode(tokenizer, summary_documents(token_counter(tokenizer), [n], 1, seed=0)[0]["text"])[:n]
        full = nestedkv.make_cache(model, nestedkv.NoPress())
        prefill(model, full, ids, chunk)
        layer_kv = max(c.nbytes for c in full_layers(full))
        model_kv = sum(c.nbytes for c in full_layers(full))
        for name in PRESSES:
            press = nestedkv.get_press(name, compression_ratio=ratio)
            cache = nestedkv.clone(full, press, model=model)
            mx.eval(arrays(cache))
            mx.clear_cache()
            before = mx.get_active_memory()
            mx.reset_peak_memory()
            nestedkv.compress(cache, model=model, tokens=ids, prompt=instruction)
            extra = mx.get_peak_memory() - before
            rows.append({"press": name, "tokens": n, "scoring_peak_mib": extra / MIB, "layer_kv_mib": layer_kv / MIB,
                         "model_kv_mib": model_kv / MIB, "peak_over_layer_kv": extra / layer_kv})
            log(f"{n:>6} tokens  {name:<19} scoring peak {extra / MIB:8.1f} MiB  = {extra / layer_kv:5.2f} x one "
                f"layer's K/V ({layer_kv / MIB:.1f} MiB; {n_layers} layers {model_kv / MIB:.1f} MiB)")
            del cache
        del full
        mx.clear_cache()
    return rows


def run_benchmark(model: str = "smollm2-135m",
                  lengths: Annotated[Sequence[int], Field(description="context lengths")] = (4096, 16384, 32768),
                  layers: Annotated[int, Field(description="the model's first layers kept (scoring is per "
                                                          "layer)")] = 2,
                  compression_ratio: Annotated[float, Field(description="fraction of the context removed")] = COMPRESSION_RATIO,
                  chunk: Annotated[int, Field(description="prefill chunk size")] = 512,
                  out: Annotated[Optional[str], Field(description="also write the figures here (JSON)")] = None) -> list[dict]:
    if not lengths or not all(1 <= n <= INT32_MAX for n in lengths) or layers < 1:
        raise ValueError("--lengths: positive token counts; --layers: at least 1")
    rows = measure(model, lengths, layers, compression_ratio, chunk)
    if out:
        Path(out).write_text(json.dumps(rows, indent=2))
    return rows
