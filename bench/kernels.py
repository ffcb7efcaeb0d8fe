"""Micro-benchmarks: BLAS GEMM speed, scoring+selection per layer, and (with a model) prefill, compress and decode.

    nkv bench kernels [--model smollm2-135m] [--context 4096] [--new-tokens 32] [--out FILE.json]

``run`` takes an mlx-lm directory (nestedkv never imports pipeline, so it takes no model names; the CLI
resolves them). It loads mlx when imported: the process opts in to the CPU fast path first (importing ``flows``
does, as ``nkv`` does).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated, Callable, Optional, Sequence
from unittest import mock

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.utils import dequantize_model, load_model

from pydantic import Field

from nestedkv import KeyDiffPress, NestedKVPress, NoPress, _cpu, _platform, attention, clone, compress, layer_stats, make_cache
from bench.blas import bench_blas
from nestedkv.cache import full_layers

SIZES = (2048, 8192, 32768)
PARAGRAPH = (
    "The village lay at the foot of a long green hill, and every morning the carts came down the lane "
    "with milk and bread for the houses by the river. Mrs. Hale kept the shop on the corner; she knew "
    "every family by name, what they owed, and which of the children had been ill that winter. In the "
    "spring the orchard behind the church flowered all at once, and the vicar, who was fond of bees, "
    "walked there after the service to count the hives and to talk with anyone who cared to listen. "
)


def _best_seconds(fns: dict, repeats: int, warmup: int = 2) -> dict:
    """Fastest of ``repeats`` timed runs per function, run in turn so that load from other processes
    hits them alike (ratios between them are what the benchmark reports)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t)
    return best


def bench_scoring(sizes=SIZES, repeats: int = 3, heads: int = 8, head_dim: int = 128) -> list[dict]:
    """Best seconds of score + select (mx.eval inside) for one layer's keys [1, heads, N, head_dim]."""
    # Random keys carry no rotation to undo (and no model gives a rope): scored as they are.
    presses = {
        "nestedkv": NestedKVPress(compression_ratio=0.75, unrotate=False),
        "nestedkv_adaptive": NestedKVPress(compression_ratio=0.75, head_budget="adaptive", unrotate=False),
        "keydiff": KeyDiffPress(compression_ratio=0.75, unrotate=False),
    }
    rows = []
    for n in sizes:
        keys = mx.random.normal((1, heads, n, head_dim), key=mx.random.key(n))
        mx.eval(keys)

        def runner(press):
            def run():
                sel = press.select(keys)
                mx.eval(sel.indices, sel.counts)

            return run

        best = _best_seconds({name: runner(press) for name, press in presses.items()}, repeats)
        rows += [{"method": name, "n": n, "seconds": sec} for name, sec in best.items()]
    return rows


# -- model part ------------------------------------------------------------------------------
def to_fp32_on_cpu(model) -> bool:
    """On CPU, fp16/bf16/quantized matmuls are slow: run in fp32 there. Returns True if changed."""
    if mx.default_device() != mx.cpu:
        return False
    quantized = any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())
    if quantized:
        dequantize_model(model)
    half = any(p.dtype in (mx.float16, mx.bfloat16) for _, p in tree_flatten(model.parameters()))
    if half:
        model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return quantized or half


def _has_tokenizer(path: Path) -> bool:
    return any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))


def load_model_dir(path: Path, random_tokens: bool):
    """(model, tokenizer or None). Without a tokenizer (or with --random-tokens) only weights load."""
    if random_tokens or not _has_tokenizer(path):
        model, _ = load_model(path)
        return model, None
    return load(str(path))


def context_tokens(tokenizer, n: int, text_file: str | None = None) -> mx.array:
    """``n`` token ids of English text (the file's, or the built-in paragraph), repeated as needed."""
    text = Path(text_file).read_text(encoding="utf-8") if text_file else PARAGRAPH
    per_copy = len(tokenizer.encode(text))
    if per_copy == 0:
        raise ValueError("the text tokenized to nothing")
    # Encode the repeated text once, so there is a single BOS, not one per copy.
    ids = tokenizer.encode(text * (n // per_copy + 2))
    return mx.array(ids[:n], dtype=mx.int32)


def _vocab_size(model) -> int:
    args = getattr(model, "args", None)
    return int(getattr(args, "vocab_size", 1000))


def _summary(values: list[float]) -> dict:
    return {"min": min(values), "mean": sum(values) / len(values), "max": max(values)}


def _prefill_seconds(model, toks, chunk: int) -> float:
    cache = make_cache(model, NoPress())
    t = time.perf_counter()
    for i in range(0, int(toks.shape[0]), chunk):
        mx.eval(model(toks[None, i : i + chunk], cache=cache), [c.keys for c in cache])
    return time.perf_counter() - t


def prefill_profile(model, toks, chunk: int) -> dict:
    """Prefill seconds with the attention's long chunks in NumPy blocks (the CPU fast path's), in mlx blocks
    (before them), and with no attention at all (the queries returned: the rest of the model's work). Only
    with the CPU fast path on the CPU; elsewhere the three are one path and this is empty."""
    if not _cpu.fast():
        return {}

    def mlx_blocks(q, k, v, scale, causal, plan):
        return attention._by_rows(q, k, v, scale, "causal" if causal else None, None, plan)

    out = {"numpy_blocks": _prefill_seconds(model, toks, chunk)}
    with mock.patch.object(attention, "numpy_rows", mlx_blocks):
        out["mlx_blocks"] = _prefill_seconds(model, toks, chunk)
    with mock.patch.object(attention, "_attend", lambda q, *a, **k: q):
        out["no_attention"] = _prefill_seconds(model, toks, chunk)
    return out


def _counting(fn, calls: list):
    def counted(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)

    return counted


DECODE_BLOCK = 8  # decode steps a configuration takes before the next one's turn


def bench_model(path: Path, context: int, new_tokens: int, chunk: int = 512, text=None, random_tokens=False):
    model, tokenizer = load_model_dir(path, random_tokens)
    converted = to_fp32_on_cpu(model)
    if tokenizer is None:
        toks = mx.random.randint(0, _vocab_size(model), (context,), key=mx.random.key(0)).astype(mx.int32)
    else:
        toks = context_tokens(tokenizer, context, text)
    context = int(toks.shape[0])

    cache = make_cache(model, NoPress())
    t = time.perf_counter()
    for i in range(0, context, chunk):
        logits = model(toks[None, i : i + chunk], cache=cache)
        mx.eval(logits, [c.keys for c in cache])
    prefill_s = time.perf_counter() - t
    first = mx.argmax(logits[:, -1:, :], axis=-1)
    profile = prefill_profile(model, toks, chunk)

    configs = {"no_press": NoPress(), "r=0.75": NestedKVPress(compression_ratio=0.75),
               "r=0.75 adaptive": NestedKVPress(compression_ratio=0.75, head_budget="adaptive"),
               "r=0.9": NestedKVPress(compression_ratio=0.9)}
    results, live = {}, {}
    for name, press in configs.items():
        c = clone(cache, press)  # one prefill shared by every configuration
        t = time.perf_counter()
        compress(c)
        compress_s = time.perf_counter() - t
        stats = layer_stats(c)
        calls = []
        # The warm-up step, not timed: its calls counted with the fast path off, as Metal runs it (the CPU's
        # decode takes one call per KV head where that is faster).
        with mock.patch.object(attention, "_attend", _counting(attention._attend, calls)), \
                mock.patch.dict(_platform._state, fast_path=False):
            y = mx.argmax(model(first, cache=c)[:, -1:, :], axis=-1)
            mx.eval(y)
        live[name] = [c, y, 0.0]
        results[name] = {
            "compression_ratio": press.compression_ratio,
            "compress_seconds": compress_s,
            "compress_over_prefill": compress_s / prefill_s,
            "attention_calls_per_layer_token": len(calls) / len(full_layers(c)),
            "kept_over_full": _summary([s.bytes_kept / s.bytes_full for s in stats]),
            "resident_over_logical": _summary([s.bytes_resident / s.bytes_kept for s in stats]),
            "kept_rows_per_head": _summary([s.kept_mean for s in stats]),
        }
    # Decode in blocks of DECODE_BLOCK steps, each configuration in turn: a machine whose speed drifts during
    # the run (a shared host's neighbours, clocks) moves every configuration alike, so their ratios hold.
    for start in range(0, new_tokens, DECODE_BLOCK):
        for entry in live.values():
            c, y, _ = entry
            t = time.perf_counter()
            for _ in range(min(DECODE_BLOCK, new_tokens - start)):
                y = mx.argmax(model(y, cache=c)[:, -1:, :], axis=-1)
                mx.eval(y)
            entry[1], entry[2] = y, entry[2] + time.perf_counter() - t
    for name, (_, _, decode_s) in live.items():
        results[name]["decode_tokens_per_s"] = new_tokens / decode_s
    live.clear()
    full = results["no_press"]["decode_tokens_per_s"]
    for r in results.values():
        r["decode_speedup"] = r["decode_tokens_per_s"] / full
    return {
        "model": str(path),
        "n_layers": len(cache),
        "dtype": str(cache[0].keys.dtype).removeprefix("mlx.core."),
        "converted_to_fp32": converted,
        "tokens": "random ids" if tokenizer is None else "text",
        "context": context,
        "chunk": chunk,
        "new_tokens": new_tokens,
        "prefill_seconds": prefill_s,
        "prefill_profile": profile,
        "configs": results,
    }


# -- report ----------------------------------------------------------------------------------
def _mark(ok: bool) -> str:
    return "ok" if ok else "MISS"


def report(out: dict) -> str:
    lines = [f"nestedkv bench  device={out['device']}  mlx={out['mlx']}", ""]
    blas = out.get("blas")
    if blas:
        if blas["coretype_set"]:
            core = f"{blas['corename']} (OPENBLAS_CORETYPE={blas['coretype_set']} set by nestedkv)"
        elif blas["coretype_env"]:
            core = f"{blas['corename']} (OPENBLAS_CORETYPE={blas['coretype_env']} set by the user)"
        else:
            core = f"{blas['corename']} (detected by OpenBLAS)" if blas["corename"] else "-"
        lines.append(f"BLAS {blas['library']}  kernel {core}")
        if blas.get("thread_timeout_set"):
            lines.append(f"  idle BLAS threads sleep at once (OPENBLAS_THREAD_TIMEOUT={blas['thread_timeout_set']} set by nestedkv)")
        floor = f"  (expected >= {blas['floor_gflops']:.0f})" if blas["floor_gflops"] else ""
        lines.append(f"  fp32 GEMM {blas['gemm_n']}x{blas['gemm_n']}: {blas['gemm_gflops']:.1f} GFLOP/s{floor}")
        if blas["warning"]:
            lines.append(f"  {blas['warning']}")
        lines.append("")
    lines.append(
        f"scoring + selection per layer, keys [1, 8, N, 128] fp32, r=0.75 "
        f"(best of {out['repeats']} runs after warm-up)"
    )
    sizes = sorted({r["n"] for r in out["scoring"]})
    methods = list(dict.fromkeys(r["method"] for r in out["scoring"]))
    lines.append(f"  {'method':<20}" + "".join(f"{'N=' + str(n):>12}" for n in sizes))
    cells = {(r["method"], r["n"]): r["seconds"] for r in out["scoring"]}
    for m in methods:
        lines.append(f"  {m:<20}" + "".join(f"{cells[m, n] * 1e3:>10.1f}ms" for n in sizes))
    if "nestedkv" in methods and "keydiff" in methods:
        ratios = [cells["nestedkv", n] / cells["keydiff", n] for n in sizes]
        lines.append(
            f"  {'nestedkv / keydiff':<20}" + "".join(f"{r:>11.2f}x" for r in ratios)
            + f"  | target <= 2.0 {_mark(max(ratios) <= 2.0)}"
        )
    mo = out.get("model_run")
    if mo:
        lines += [
            "",
            f"model {mo['model']}  ({mo['n_layers']} layers, {mo['dtype']}"
            f"{', converted to fp32' if mo['converted_to_fp32'] else ''}; {mo['tokens']})",
            f"  context {mo['context']} tokens in {mo['chunk']}-token chunks: prefill {mo['prefill_seconds']:.2f}s",
        ]
        pr = mo.get("prefill_profile")
        if pr:
            n = mo["context"]
            lines.append("  prefill profile: " + ", ".join(
                f"{k.replace('_', ' ')} {v:.2f}s ({n / v:.0f} tok/s)" for k, v in pr.items())
                + f"; attention {1 - pr['no_attention'] / pr['numpy_blocks']:.0%} of it in NumPy blocks, "
                f"{1 - pr['no_attention'] / pr['mlx_blocks']:.0%} in mlx blocks")
        for name, r in mo["configs"].items():
            kept = r["kept_over_full"]
            res = r["resident_over_logical"]
            line = (
                f"  {name:<15} compress {r['compress_seconds'] * 1e3:7.1f}ms "
                f"({r['compress_over_prefill'] * 100:5.2f}% of prefill)  "
                f"decode {r['decode_tokens_per_s']:7.1f} tok/s (x{r['decode_speedup']:.2f}, "
                f"{r['attention_calls_per_layer_token']:g} attention calls a layer on Metal's path)  "
                f"kept/full {kept['mean']:.3f} [{kept['min']:.3f}..{kept['max']:.3f}]  "
                f"resident/logical {res['mean']:.2f}"
            )
            if name != "no_press":
                target = 1 - r["compression_ratio"]
                line += (
                    f"  | targets: compress<=1% {_mark(r['compress_over_prefill'] <= 0.01)}, "
                    f"kept=1-r {_mark(abs(kept['max'] - target) <= 1.0 / mo['context'] + 1e-9)}"
                )
                if name == "r=0.75":
                    line += f", decode>=1.25x {_mark(r['decode_speedup'] >= 1.25)}"
                if name == "r=0.75 adaptive":
                    uniform = mo["configs"]["r=0.75"]["decode_tokens_per_s"]
                    line += (f", calls<=2 {_mark(r['attention_calls_per_layer_token'] <= 2)}, decode within 10% "
                             f"of uniform ({r['decode_tokens_per_s'] / uniform:.2f}) "
                             f"{_mark(r['decode_tokens_per_s'] >= 0.9 * uniform)}")
            lines.append(line)
    return "\n".join(lines)


def run(model: Optional[Path] = None,
        context: Annotated[int, Field(description="context tokens")] = 4096,
        new_tokens: Annotated[int, Field(description="tokens decoded per measurement")] = 32,
        chunk: Annotated[int, Field(description="prefill chunk size")] = 512,
        text: Annotated[Optional[str], Field(description="a UTF-8 text file for the context (default: a built-in "
                                                         "paragraph, repeated)")] = None,
        random_tokens: Annotated[bool, Field(description="random token ids instead of tokenized text")] = False,
        sizes: Annotated[Sequence[int], Field(description="scoring sizes N")] = SIZES,
        repeats: Annotated[int, Field(description="timed runs per scoring size, after two warm-ups")] = 3,
        out: Annotated[Optional[str], Field(description="also write the figures here (JSON)")] = None,
        log: Callable[[str], None] = print) -> dict:
    """Every part above, reported through ``log`` (and written to ``out`` as JSON). ``model``: an mlx-lm
    directory for the model part (none: BLAS and scoring only). Bad arguments raise ValueError before any work."""
    if context < 8 or new_tokens < 1 or chunk < 1:
        raise ValueError("--context must be >= 8, --new-tokens and --chunk >= 1")
    model = Path(model) if model is not None else None
    if model is not None and not (model / "config.json").exists():
        raise ValueError(f"--model {model}: not an mlx-lm directory (no config.json)")

    res = {"device": str(mx.default_device()), "mlx": mx.__version__, "repeats": repeats}
    res["blas"] = bench_blas()
    if res["blas"]["warning"]:
        print(res["blas"]["warning"], file=sys.stderr)
    res["scoring"] = bench_scoring(list(sizes), repeats)
    if model is not None:
        res["model_run"] = bench_model(model, context, new_tokens, chunk, text, random_tokens)
    log(report(res))
    if out:
        Path(out).write_text(json.dumps(res, indent=2))
        log(f"\nwrote {out}")
    return res
