"""KVzip (arXiv:2505.23416): query-agnostic scores from context reconstruction. After the prefill the model
reads an instruction to repeat the context followed by the context again, chunk by chunk, attending to the
cache; each cached key scores the most attention any reconstruction query gives it, per KV head over its
query group. About one more prefill of compute, counted as compression."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx

from nestedkv.presses.base import BasePress, check


@dataclass(frozen=True)
class KVzipPress(BasePress):
    name: ClassVar[str] = "kvzip"
    rank: ClassVar[int] = 10
    compared: ClassVar[bool] = True
    needs_model: ClassVar[bool] = True

    chunk: int = 512  # context tokens reconstructed per forward pass (each after the repeat instruction)

    def __post_init__(self):
        super().__post_init__()
        check(isinstance(self.chunk, int) and not isinstance(self.chunk, bool) and self.chunk >= 1,
              "chunk", "a positive int", self.chunk, self.name)

    def model_scores(self, model, cache, tokens, prompt):
        from nestedkv.probe import probe, probe_attention  # the attention module imports the presses

        n = len(tokens)
        scores = [None] * len(cache)

        def observe(layer, queries, keys, values, scale):
            out, weights = probe_attention(queries, keys, values, scale, n)
            got = mx.max(weights, axis=2)  # [B, H, n]
            scores[layer] = got if scores[layer] is None else mx.maximum(scores[layer], got)
            return out  # the layer's attention, computed once

        feeds = [prompt + tokens[a : a + self.chunk] for a in range(0, n, self.chunk)]
        for _ in probe(model, cache, feeds, observe, self.name):
            mx.eval(scores)
        return scores
