"""How much of each NestedKV scale's score is position: the scores of real post-RoPE keys against the same
keys with the rotation undone (``nestedkv.rope``), per layer and head.

    nkv bench rope --model qwen2.5-coder-0.5b --context 4096

For each scale (stable = KeyDiff's anchor, block, window): the mean cosine to its anchor with and without the
rotation, and the Spearman rank correlation of the two score orders (1 = rotation changes nothing the selection
sees; low = the ranking is largely about position). Plus how much the window's unit keys point one way (the
norm of their mean: 1 = all alike), which the rotation lowers when neighbouring keys turn apart.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Callable, Optional

import mlx.core as mx
import numpy as np

from pydantic import Field

from nestedkv import NoPress, make_cache, scoring
from nestedkv.cache import full_layers
from pipeline import models  # models.load_model looked up at each call: tests stand a tiny model in for it
from pipeline.prompts import encode
from pipeline.runner import prefill
from pipeline.tasks import summary_documents, token_counter

SCALES = ("stable", "block", "window")


def _ranks(x: np.ndarray) -> np.ndarray:
    return np.argsort(np.argsort(x, axis=-1, kind="stable"), axis=-1).astype(np.float64)


def spearman(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Rank correlation along the last axis (ties broken by position)."""
    ra, rb = _ranks(a), _ranks(b)
    ra -= ra.mean(-1, keepdims=True)
    rb -= rb.mean(-1, keepdims=True)
    return (ra * rb).sum(-1) / np.sqrt((ra**2).sum(-1) * (rb**2).sum(-1))


def _cosines(k_unit: mx.array, window: int) -> dict[str, mx.array]:
    n = k_unit.shape[2]
    return {"stable": scoring.stable_cosine(k_unit), "block": scoring.block_cosine(k_unit, scoring.block_size(n)),
            "window": scoring.window_cosine(k_unit, window)}


def _window_coherence(k_unit: mx.array, window: int) -> float:
    sums = mx.cumsum(k_unit, axis=2)
    w = sums[:, :, window:] - sums[:, :, :-window]
    return float(mx.mean(mx.linalg.norm(w, axis=-1))) / window


def rotation_effect(keys: mx.array, unrope: Callable, window: int = scoring.WINDOW) -> dict:
    """One layer's keys ``[1, H, N, D]`` (positions 0..N-1): per scale, mean cosine post-RoPE and unrotated,
    and the mean over heads of the Spearman correlation of the two; the window coherence both ways."""
    if keys.shape[2] <= window:
        raise ValueError(f"need more than {window} keys, got {keys.shape[2]}")
    post = scoring._unit(keys.astype(mx.float32))
    pre = scoring._unit(unrope(keys.astype(mx.float32), 0))
    a, b = _cosines(post, window), _cosines(pre, window)
    out = {}
    for s in SCALES:
        x, y = np.array(a[s]), np.array(b[s])
        out[s] = {"cos_post": float(x.mean()), "cos_unrotated": float(y.mean()),
                  "spearman": float(np.nanmean(spearman(x, y)))}
    out["window_coherence"] = {"post": _window_coherence(post, window), "unrotated": _window_coherence(pre, window)}
    return out


def summarize(layers: list[dict]) -> dict:
    """Means over layers, and each scale's lowest layer correlation."""
    out = {s: {k: float(np.mean([l[s][k] for l in layers])) for k in ("cos_post", "cos_unrotated", "spearman")}
           for s in SCALES}
    for s in SCALES:
        out[s]["spearman_min_layer"] = float(min(l[s]["spearman"] for l in layers))
    out["window_coherence"] = {k: float(np.mean([l["window_coherence"][k] for l in layers])) for k in ("post", "unrotated")}
    return out


def run(model_ref: str, context: Annotated[int, Field(description="context tokens")] = 4096,
        step: Annotated[int, Field(description="prefill chunk size")] = 512,
        seed: Annotated[int, Field(description="which passage of the novels")] = 0,
        out: Annotated[Optional[str], Field(description="also write the figures here (JSON)")] = None, log=print) -> dict:
    """Prefill ``context`` tokens of the bundled novels' prose and measure every layer (written to ``out`` as
    JSON too)."""
    if context <= scoring.WINDOW:
        raise ValueError(f"--context must be more than {scoring.WINDOW} tokens, got {context}")
    model, tok = models.load_model(model_ref)
    text = summary_documents(token_counter(tok), [context], 1, seed)[0]["text"]
    ids = encode(tok, text)
    cache = make_cache(model, NoPress())
    rotated = [c for c in full_layers(cache) if c.rope_spec and c.rope_spec["dims"]]
    if not rotated:
        raise ValueError(f"model {model_ref!r} has no layer whose keys carry a rope nestedkv can undo")
    prefill(model, cache, ids, step)
    layers = []
    for c in rotated:
        layers.append(rotation_effect(c.keys[..., : c.stored, :], c.unrope))
        mx.clear_cache()
    res = {"model": model_ref, "n_tokens": len(ids), "n_layers": len(layers), **summarize(layers)}
    log(format_report(res))
    if out:
        Path(out).write_text(json.dumps(res, indent=1))
    return res


def format_report(res: dict) -> str:
    lines = [f"{res['model']}: {res['n_tokens']} tokens of prose, {res['n_layers']} layers (means over layers and heads)",
             f"  {'scale':8s} {'cos post-RoPE':>14s} {'cos unrotated':>14s} {'Spearman':>9s} {'lowest layer':>13s}"]
    for s in SCALES:
        r = res[s]
        lines.append(f"  {s:8s} {r['cos_post']:14.3f} {r['cos_unrotated']:14.3f} {r['spearman']:9.3f} "
                     f"{r['spearman_min_layer']:13.3f}")
    w = res["window_coherence"]
    lines.append(f"  window coherence (norm of the mean unit key over {scoring.WINDOW}): post-RoPE {w['post']:.3f}, "
                 f"unrotated {w['unrotated']:.3f}")
    return "\n".join(lines)
