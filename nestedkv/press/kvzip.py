"""KVzip (arXiv:2505.23416): query-agnostic scores from context reconstruction. After the prefill the model
reads an instruction to repeat the context (``nestedkv.Instruction``: in a chat model's user turn, then the
change to the assistant's turn) followed by the context again, chunk by chunk, attending to the whole cache as
any forward pass does. A cached key's score is the most attention it gets from the queries repeating its own
chunk, the softmax taken over that chunk's cached keys, the attention sinks and the fed rows (as the paper's
implementation scores), per KV head over its query group. About one more prefill of compute, counted as
compression."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx

from nestedkv.press.base import BasePress, check_ints
from nestedkv.press.nestedkv import NestedKVPress
from nestedkv.probe import Instruction, peak_context_weights, probe
from nestedkv.selection import N_SINK


@dataclass(frozen=True)
class KVzipPress(BasePress):
    name: ClassVar[str] = "kvzip"
    rank: ClassVar[int] = 10
    compared: ClassVar[bool] = True
    needs_model: ClassVar[bool] = True
    # Runs take the paper's budget (kvpress's default too, layerwise=False): one threshold over every layer and
    # head. The field stays uniform, as every press's.
    run_defaults: ClassVar[dict] = {"head_budget": "adaptive"}

    # Context tokens reconstructed per forward pass, each after the repeat instruction. The chunk bounds the
    # scores' softmax (sinks, the chunk, the fed rows), so it is part of the method: the paper's implementation
    # takes 2,000, kvpress 2,048.
    chunk: int = 2048
    # Context tokens before each later chunk fed after the resume instruction, so the model knows where the
    # repetition resumes (the paper's implementation feeds the previous chunk's last 8).
    overlap: int = 8

    def __post_init__(self):
        super().__post_init__()
        check_ints(self, chunk=1, overlap=0)

    def layer_keeps(self, scores: list) -> list:
        """Adaptive budgets compete across layers too, as in the paper: its scores are attention
        probabilities, comparable between layers, and only some layers reconstruct (copy or induction heads);
        one threshold over every layer and head gives each layer the rows above it. Uniform: the same budget
        per head in every layer."""
        n = scores[0].shape[2]
        keep = self.n_keep(n)
        if self.head_budget != "adaptive" or keep is None:
            return super().layer_keeps(scores)
        flat = mx.concatenate([s.reshape(-1) for s in scores])
        total = keep * sum(s.shape[0] * s.shape[1] for s in scores)
        threshold = mx.sort(flat)[flat.size - total]
        counts = [int(mx.sum(s >= threshold).item()) for s in scores]
        return [min(n, max(self.n_sink, round(c / (s.shape[0] * s.shape[1])))) for c, s in zip(counts, scores)]

    def model_scores(self, model, cache, tokens, prompt):
        n = len(tokens)
        starts = [0] * len(cache)  # per layer, the chunk the current feed repeats
        parts: list[list] = [[] for _ in cache]

        def observe(layer, queries, keys, values, scale):
            a = starts[layer]
            b = starts[layer] = min(a + self.chunk, n)
            sink = min(N_SINK, a)
            rows = mx.concatenate([keys[..., :sink, :], keys[..., a:b, :], keys[..., n:, :]], axis=2)
            parts[layer].append(peak_context_weights(queries, rows, scale, sink + b - a)[..., sink:])  # [B, H, b - a]
            return None  # the layer attends as always, to the whole cache

        prompt = Instruction.of(prompt)
        feeds = [prompt.feed(tokens[max(a - self.overlap, 0) : a], tokens[a : a + self.chunk], a == 0)
                 for a in range(0, n, self.chunk)]
        for _ in probe(model, cache, feeds, observe, self.name):
            mx.eval([p[-1] for p in parts if p])
        return [mx.concatenate(p, axis=-1) if p else None for p in parts]


def _ranks(scores: mx.array) -> mx.array:
    """Each head's scores ``[B, H, N]`` as ranks in [0, 1] (0: the lowest)."""
    n = scores.shape[-1]
    return mx.argsort(mx.argsort(scores, axis=-1), axis=-1).astype(mx.float32) / max(n - 1, 1)


@dataclass(frozen=True)
class KVzipNestedPress(KVzipPress):
    """A variant measuring whether KVzip's and NestedKV's scores are complementary: each head's keys ranked by
    the reconstruction and by NestedKV's key-only score (its defaults, unrotated keys), the score the mean of
    the two ranks (ranks make the two scales comparable without a weight). Not compared by default."""

    name: ClassVar[str] = "kvzip_nestedkv"
    rank: ClassVar[int] = 12
    compared: ClassVar[bool] = False

    def layer_keeps(self, scores: list) -> list:
        return BasePress.layer_keeps(self, scores)  # ranks say nothing of one layer against another

    def model_scores(self, model, cache, tokens, prompt):
        nested, n = NestedKVPress(), len(tokens)
        out = []
        for c, s in zip(cache, super().model_scores(model, cache, tokens, prompt)):
            keys = c.keys[..., :n, :]
            keys = keys if c.unrope is None else c.unrope(keys, 0)  # a layer no rope undoes: as cached
            out.append((_ranks(s) + _ranks(nested.score(keys))) / 2)
            mx.eval(out[-1])
        return out
