"""How a document is read within the memory a run may use, planned before its prefill.

A Mac has one pool of unified memory for the weights, the KV cache and the prefill's working buffers. Before a
document is prefilled, each way of reading it is estimated from the model's shape (what ``nestedkv.introspect``
measured: bytes per context token of every compressed layer, the windows and states kept as they are), the
document's length, the press and the chunk size, and the first way within the limit is taken:

- ``whole``: every row, compressed after the last chunk;
- ``streaming``: evicting while prefilling (key-only presses), the KV bounded by the budget and a chunk;
- ``parts``: map-reduce over parts sized to fit, for presses that cannot stream.

A document no way fits gets one line before its prefill. The estimate, in bytes: the weights, plus the KV rows a
way holds at its peak, plus one chunk's working buffers (the fp32 attention scores of one layer, which mlx's CPU
attention materializes, and the chunk's activations), plus the compression's scoring of one layer, plus
``SLACK`` for the rest.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from nestedkv import introspect

SLACK = 128 * 2**20  # the interpreter, mlx's own buffers, the tokenizer's: what no formula below counts
SHARE = 0.85  # of the memory available when the run starts, taken as the default limit
MIN_PART = 256  # tokens: parts smaller than this are no plan
WHOLE, STREAMING, PARTS = "whole", "streaming", "parts"


def available_bytes() -> int:
    """Memory this process could still take: Metal's recommended working set less what mlx holds, else the
    system's available memory (Linux's MemAvailable; else free pages)."""
    if mx.metal.is_available():
        info = mx.device_info()
        return max(0, int(info.get("max_recommended_working_set_size", info["memory_size"])) - mx.get_active_memory())
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class Shape:
    """What the estimates need of a model."""

    weights: int  # bytes of its parameters as loaded
    row_bytes: int  # one context position's keys and values over every compressed layer
    layer_row_bytes: int  # the largest of one compressed layer (what scoring one layer reads)
    n_q_heads: int
    hidden: int
    intermediate: int


def shape_of(model: nn.Module) -> Shape:
    facts = introspect.probe(model)
    hidden = int(introspect.setting(model, "hidden_size", "n_embd", "d_model", "model_dim") or 0)
    heads = int(introspect.setting(model, "num_attention_heads", "n_head", "n_heads", "num_heads") or
                max(f.n_kv_heads for f in facts))
    inter = introspect.setting(model, "intermediate_size", "n_inner", "ffn_hidden_size", "moe_intermediate_size")
    return Shape(weights=sum(p.nbytes for _, p in tree_flatten(model.parameters())),
                 row_bytes=sum(f.row_bytes for f in facts), layer_row_bytes=max(f.row_bytes for f in facts),
                 n_q_heads=heads, hidden=hidden, intermediate=int(inter or 4 * hidden))


def working_bytes(shape: Shape, chunk: int, keys: int) -> int:
    """One prefill chunk's transient buffers: one layer's fp32 attention scores and the chunk's activations."""
    return 4 * shape.n_q_heads * chunk * keys + 4 * chunk * (6 * shape.hidden + 3 * shape.intermediate)


def scoring_bytes(shape: Shape, rows: int) -> int:
    """Scoring one layer's ``rows`` rows at compression, each press's included: ``nkv bench scoring-memory``
    measured 3 to 7 times the layer's K/V bytes at 16k tokens (docs/benchmarks.md); eight times is the bound."""
    return 8 * rows * shape.layer_row_bytes


def peak(shape: Shape, model, n: int, chunk: int, rows: int) -> int:
    """The peak of reading ``n`` context tokens in chunks of ``chunk`` while at most ``rows`` of them are held
    per layer (``n`` read whole; the budget and a chunk while streaming; a part's length)."""
    return (shape.weights + rows * shape.row_bytes + introspect.bounded_bytes(model, n, chunk)
            + max(working_bytes(shape, min(chunk, n), rows), scoring_bytes(shape, rows)) + SLACK)


@dataclass(frozen=True)
class MemoryPlan:
    way: str  # whole, streaming or parts
    peak_bytes: int  # the estimate for that way
    limit_bytes: int
    part_tokens: Optional[int] = None  # parts: the context tokens a part holds

    def label(self) -> str:
        return f"{PARTS} of {self.part_tokens}" if self.way == PARTS else self.way


class NoPlan(ValueError):
    """No way of reading the document fits the memory limit (one line, before its prefill)."""


def can_stream(presses: Sequence) -> bool:
    """Every press evicts while prefilling (``streams``: key-only, or steered), with a budget (not ``no_press``)."""
    return bool(presses) and all(p.streams and p.n_keep(10**9) is not None for p in presses)


def plan(shape: Shape, model, doc_id: str, n: int, chunk: int, presses: Sequence, limit: int,
         streaming: bool = False) -> MemoryPlan:
    """The first way to read ``n`` context tokens within ``limit`` bytes: whole, streaming (when every press
    can), then parts; ``streaming``: the presses stream anyway (their own setting), so whole is not a way.
    Raises ``NoPlan`` naming the document and the least any way needs."""
    whole = peak(shape, model, n, chunk, n)
    if whole <= limit and not streaming:
        return MemoryPlan(WHOLE, whole, limit)
    least = whole
    if streaming or can_stream(presses):
        keep = max(p.n_keep(n) or n for p in presses)
        rows = min(n, keep + 2 * chunk)
        need = peak(shape, model, n, chunk, rows)
        if need <= limit:
            return MemoryPlan(STREAMING, need, limit)
        least = min(least, need)
    if not streaming:
        part = _largest_part(shape, model, n, chunk, limit)
        if part is not None:
            return MemoryPlan(PARTS, peak(shape, model, part, chunk, part), limit, part)
        least = min(least, peak(shape, model, MIN_PART, chunk, MIN_PART))
    raise NoPlan(f"document {doc_id!r}: reading its {n:,} tokens needs at least {_gib(least)} (weights "
                 f"{_gib(shape.weights)}), over the memory limit of {_gib(limit)}; raise --memory-limit, or lower "
                 "--prefill-step-size or the budget")


def _largest_part(shape: Shape, model, n: int, chunk: int, limit: int) -> Optional[int]:
    lo, hi = MIN_PART, n
    if peak(shape, model, lo, chunk, lo) > limit:
        return None
    while lo < hi:  # the peak grows with the part's length
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if peak(shape, model, mid, chunk, mid) <= limit else (lo, mid - 1)
    return lo


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def default_limit(shape: Shape) -> int:
    """``SHARE`` of the memory available now, plus the weights already loaded."""
    return shape.weights + int(SHARE * available_bytes())
