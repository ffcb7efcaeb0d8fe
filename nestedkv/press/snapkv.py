"""SnapKV (arXiv:2404.14469): the questions pick the rows. After the prefill the model reads the document's
questions (every one, one after another, as one observation window: one compression answers them all); a
cached key's score is the attention it gets from the window's queries, averaged over those queries and over its
KV head's query group, then smoothed along the context by an average of ``kernel`` neighbours (SnapKV's
pooling, which keeps the tokens around a chosen one). The window's rows are attended to, never stored: the
cache holds the context only, as for any press. About the window's length in compute, counted as compression.

Question-aware: a question asked later, which the window did not hold, may find its rows gone. The pipeline
records that a run's compression saw the questions, and keeps such runs apart from the query-agnostic ones.

Streaming (``prefill="streaming"``, documents past the window), uniform budgets: Finch-class reading. After
each chunk the questions are fed after the rows the cache holds (at the position the next chunk would take)
and score them (``steer``, the same scores); the next chunk's eviction keeps the best, and past the window the
kept rows move into it as any streaming press's do. Memory: the budget, one chunk and the questions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx
import mlx.nn as nn

from nestedkv.press.base import BasePress, check_ints
from nestedkv.probe import peak_context_weights, probe
from nestedkv.streaming import StreamScorer


def average_pool(scores: mx.array, kernel: int) -> mx.array:
    """Each position's mean over the ``kernel`` positions centred on it along the last axis, the positions
    past either end counting as zeros (torch's ``avg_pool1d`` with ``padding=kernel // 2``, as SnapKV pools)."""
    pool = nn.AvgPool1d(kernel_size=kernel, stride=1, padding=kernel // 2)
    return pool(scores.reshape(-1, scores.shape[-1], 1)).reshape(scores.shape)  # mlx pools [N, L, C]


class SteeredScorer(StreamScorer):
    """A steered streaming prefill's memory: each stored row's score from the questions' last reading
    (``SnapKVPress.steer``, after every chunk); a chunk's rows score 0 until the reading that follows it."""

    features: ClassVar[tuple[str, ...]] = ("steer",)

    def observe(self, keys, p0, rows):
        B, H, n, _ = keys.shape
        return {"steer": mx.zeros((B, H, n), dtype=mx.float32)}

    def scores(self, keys, rows, valid):
        return rows["steer"]


@dataclass(frozen=True)
class SnapKVPress(BasePress):
    name: ClassVar[str] = "snapkv"
    rank: ClassVar[int] = 20
    needs_model: ClassVar[bool] = True
    needs_questions: ClassVar[bool] = True
    stream_scorer: ClassVar[type] = SteeredScorer

    kernel: int = 5  # SnapKV's and kvpress's pooling width

    def __post_init__(self):
        super().__post_init__()
        check_ints(self, kernel=1)
        if self.kernel % 2 == 0:
            raise ValueError(f"kernel must be odd (a window centred on each position), got {self.kernel!r}")

    @property
    def streams(self) -> bool:
        return self.head_budget == "uniform"

    def check_whole_prefill(self) -> None:
        if self.prefill != "whole" and not self.streams:
            raise ValueError(f"press {self.name!r} streams (the questions steer each chunk) with "
                             f"head_budget='uniform' only; got {self.head_budget!r}")

    def model_scores(self, model, cache, tokens, prompt, questions=()):
        return self._scores(model, cache, questions, streaming=False)

    def steer(self, model, cache, questions) -> list:
        """The rows a streaming cache holds now, scored by the questions fed after them; each layer's stream
        keeps the scores for its next eviction (``SteeredScorer``). Returns them, ``[B, H, rows]`` per layer."""
        scores = self._scores(model, cache, questions, streaming=True)
        for c, s in zip(cache, scores):
            c.stream.rows["steer"] = s
        return scores

    def _scores(self, model, cache, questions, streaming: bool) -> list:
        window = [t for q in questions for t in q]
        scores: list = [None] * len(cache)

        def observe(layer, queries, keys, values, scale):
            g = queries.shape[1] // keys.shape[1]
            n = keys.shape[2] - queries.shape[2]  # the rows held; the window's own follow them
            total = peak_context_weights(queries, keys, scale, n, total=True)  # [B, H, n]
            scores[layer] = average_pool(total / (g * queries.shape[2]), self.kernel)

        for _ in probe(model, cache, [window], observe, self.name, streaming=streaming):
            mx.eval(scores)
        return scores
