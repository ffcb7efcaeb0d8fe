"""SnapKV (arXiv:2404.14469): the questions pick the rows. After the prefill the model reads the document's
questions (every one, one after another, as one observation window: one compression answers them all); a
cached key's score is the attention it gets from the window's queries, averaged over those queries and over its
KV head's query group, then smoothed along the context by an average of ``kernel`` neighbours (SnapKV's
pooling, which keeps the tokens around a chosen one). The window's rows are attended to, never stored: the
cache holds the context only, as for any press. About the window's length in compute, counted as compression.

Question-aware: a question asked later, which the window did not hold, may find its rows gone. The pipeline
records that a run's compression saw the questions, and keeps such runs apart from the query-agnostic ones."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx
import mlx.nn as nn

from nestedkv.press.base import BasePress, check_ints
from nestedkv.probe import peak_context_weights, probe


def average_pool(scores: mx.array, kernel: int) -> mx.array:
    """Each position's mean over the ``kernel`` positions centred on it along the last axis, the positions
    past either end counting as zeros (torch's ``avg_pool1d`` with ``padding=kernel // 2``, as SnapKV pools)."""
    pool = nn.AvgPool1d(kernel_size=kernel, stride=1, padding=kernel // 2)
    return pool(scores.reshape(-1, scores.shape[-1], 1)).reshape(scores.shape)  # mlx pools [N, L, C]


@dataclass(frozen=True)
class SnapKVPress(BasePress):
    name: ClassVar[str] = "snapkv"
    rank: ClassVar[int] = 20
    needs_model: ClassVar[bool] = True
    needs_questions: ClassVar[bool] = True

    kernel: int = 5  # SnapKV's and kvpress's pooling width

    def __post_init__(self):
        super().__post_init__()
        check_ints(self, kernel=1)
        if self.kernel % 2 == 0:
            raise ValueError(f"kernel must be odd (a window centred on each position), got {self.kernel!r}")

    def model_scores(self, model, cache, tokens, prompt, questions=()):
        n = len(tokens)
        window = [t for q in questions for t in q]
        scores: list = [None] * len(cache)

        def observe(layer, queries, keys, values, scale):
            g = queries.shape[1] // keys.shape[1]
            total = peak_context_weights(queries, keys, scale, n, total=True)  # [B, H, n]
            scores[layer] = average_pool(total / (g * queries.shape[2]), self.kernel)

        for _ in probe(model, cache, [window], observe, self.name):
            mx.eval(scores)
        return scores
