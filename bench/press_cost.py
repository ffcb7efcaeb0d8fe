"""What each press's compression costs against the prefill it compresses, on one document.

    nkv bench press-cost [--model qwen2.5-coder-0.5b] [--context 4096] [--press kvzip,expected_attention]

The document: Austen's prose (``pipeline.tasks.text.haystack``) in the model's chat template, cut at
``context`` tokens, prefilled as the pipeline prefills (``pipeline.runner.prefill``: its chunks, no LM head).
Each press compresses a clone of that one prefill at ``compression_ratio``, the presses that score with the
model given the pipeline's instruction (``repeat_instruction``). Best of ``repeats`` for the prefill and
each compression.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Callable, Optional, Sequence

import mlx.core as mx

from pydantic import Field

import nestedkv
from nestedkv.press import PRESSES, get_press
from nestedkv.run_defaults import COMPRESSION_RATIO
from pipeline import models
from pipeline.prompts import build_prompt, encode, repeat_instruction
from pipeline.runner import prefill
from pipeline.tasks.text import haystack

DEFAULT_PRESSES = ("nestedkv", "keydiff", "kvzip", "expected_attention")


def document_ids(tokenizer, n: int) -> list[int]:
    """``n`` context tokens: the chat template's head, then the novels' sentences."""
    words, text = 0, []
    for s in haystack():  # about 4 characters a token: enough text, then cut at n tokens
        text.append(s.text)
        words += len(s.text)
        if words > 6 * n:
            break
    ids = encode(tokenizer, build_prompt(tokenizer, " ".join(text), "").context)
    if len(ids) < n:
        raise ValueError(f"--context {n}: the novels give only {len(ids)} tokens")
    return ids[:n]


def best_of(repeats: int, fn: Callable[[], None]) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def run_press_cost(model: Optional[str] = None, context: Annotated[int, Field(description="context tokens")] = 4096,
                   presses: Annotated[Sequence[str], Field(description="the presses",
                                                           json_schema_extra={"flags": ["--press"]})] = DEFAULT_PRESSES,
                   compression_ratio: Annotated[float, Field(description="fraction of the context removed")] = COMPRESSION_RATIO,
                   chunk: Annotated[int, Field(description="prefill chunk size")] = 512,
                   repeats: Annotated[int, Field(description="timed runs of the prefill and of each compression, the best taken")] = 1,
                   out: Annotated[Optional[str], Field(description="also write the figures here (JSON)")] = None, log: Callable[[str], None] = print) -> dict:
    """The figures through ``log`` (and to ``out`` as JSON). Bad arguments raise ValueError before any work."""
    unknown = [p for p in presses if p not in PRESSES or p == "no_press"]
    if unknown:
        raise ValueError(f"--press {', '.join(unknown)}: not a press; allowed: "
                         f"{', '.join(p for p in PRESSES if p != 'no_press')}")
    if context < 16 or chunk < 1 or repeats < 1 or not 0 < compression_ratio < 1:
        raise ValueError("--context must be >= 16, --chunk and --repeats >= 1, --compression-ratio in (0, 1)")
    configs = {p: get_press(p, compression_ratio=compression_ratio) for p in presses}
    lm, tokenizer = models.load_model(model)
    ids = document_ids(tokenizer, context)
    instruction = repeat_instruction(tokenizer)
    full: list = []

    def prefilled():
        full[:] = nestedkv.make_cache(lm, get_press("no_press"))
        prefill(lm, full, ids, chunk)

    res = {"model": model or "default", "device": str(mx.default_device()), "context": context, "chunk": chunk,
           "compression_ratio": compression_ratio, "repeats": repeats,
           "prefill_s": best_of(repeats, prefilled), "presses": {}}
    log(f"{res['model']} on {res['device']}: {context} tokens, prefill {res['prefill_s']:.2f} s "
        f"(best of {repeats})")
    for name, press in configs.items():
        def compress():
            c = nestedkv.clone(full, press, model=lm)
            nestedkv.compress(c, model=lm, tokens=ids, prompt=instruction)

        s = best_of(repeats, compress)
        res["presses"][name] = {"compress_s": s, "compress_over_prefill": s / res["prefill_s"]}
        log(f"  {name:<20} compress {s:7.2f} s  = {s / res['prefill_s']:.2f}x the prefill")
    if out:
        Path(out).write_text(json.dumps(res, indent=2))
        log(f"wrote {out}")
    return res
