"""Expected Attention (arXiv:2510.00636): a key's score is the attention it would get from the queries still
to come, in closed form. Future queries are modelled as Gaussian, q ~ N(mu, Sigma), so that
E[exp(q.k * s)] = exp(mu.k * s + s^2 k' Sigma k / 2); normalised over the context per query head, averaged
over the KV head's query group and weighted by the value's norm (scored as its log).

mu and Sigma come from the queries of the last ``n_recent`` context tokens, recomputed at their own positions
from the cache before them (fed after the whole context instead, they would read their own copy and look back
at it), rotated back by those positions, then carried to the next ``n_future`` positions by the mean rope
there: mu' = mu M, Sigma' = M' Sigma M. Statistics of the rotated queries would count the rope's turning as
variance, which the covariance term then rewards in keys of large high-frequency norm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Optional

import mlx.core as mx

from nestedkv.press.base import BasePress, check, check_ints
from nestedkv.probe import probe
from nestedkv.rope import from_description, mean_rotation


def expected_attention_scores(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                              use_covariance: bool = True, rotation: Optional[mx.array] = None) -> mx.array:
    """Scores ``[B, H, N]`` of context keys/values ``[B, H, N, D]`` under queries ``[B, Hq, L, D]``, fp32;
    ``rotation`` ``[D, D]``: carries the queries' statistics to the positions they are expected at."""
    B, Hq, L, D = queries.shape
    H = keys.shape[1]
    g = Hq // H
    q = queries.astype(mx.float32).reshape(B, H, g, L, D)
    k = keys.astype(mx.float32)
    mu = mx.mean(q, axis=3)  # [B, H, g, D]
    logits_mu = mu if rotation is None else mu @ rotation
    logits = (logits_mu @ k.swapaxes(-1, -2)) * scale  # [B, H, g, N]
    if use_covariance and L > 1:
        centred = q - mu[..., None, :]
        # Over L, not L - 1, as the reference implementation: the scores then match kvpress's.
        cov = (centred.swapaxes(-1, -2) @ centred) / L  # [B, H, g, D, D]
        if rotation is not None:
            cov = rotation.T @ cov @ rotation
        quad = mx.sum((k[:, :, None] @ cov) * k[:, :, None], axis=-1)  # [B, H, g, N]
        logits = logits + 0.5 * scale * scale * quad
    # In logs (the same order as mean attention times value norm): peaked heads would underflow most keys'
    # attention to exactly 0 in fp32, leaving their order to the tie-break.
    log_attn = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    log_mean = mx.logsumexp(log_attn, axis=2) - math.log(g)  # [B, H, N]
    return log_mean + mx.log(mx.linalg.norm(values.astype(mx.float32), axis=-1))


@dataclass(frozen=True)
class ExpectedAttentionPress(BasePress):
    name: ClassVar[str] = "expected_attention"
    rank: ClassVar[int] = 11
    compared: ClassVar[bool] = True
    needs_model: ClassVar[bool] = True

    n_recent: int = 128  # the last context tokens, whose queries give mu and Sigma
    n_future: int = 512  # the positions after the context the expected queries are averaged over
    use_covariance: bool = True

    def __post_init__(self):
        super().__post_init__()
        check_ints(self, n_recent=2, n_future=1)
        check(isinstance(self.use_covariance, bool), "use_covariance", "true or false", self.use_covariance,
              self.name)

    def model_scores(self, model, cache, tokens, prompt):
        n = len(tokens)
        recent = min(self.n_recent, n - 1)  # their queries recomputed at their own positions, as in the prefill
        scores = [None] * len(cache)
        rotations: dict = {}  # one per distinct rope (layers mostly share one)

        def observe(layer, queries, keys, values, scale):
            spec, rotation = cache[layer].rope_spec, None
            if spec is not None:
                queries = from_description(spec)(queries, n - recent)
                key = repr(sorted(spec.items()))
                if key not in rotations:
                    rotations[key] = mean_rotation(spec, n, self.n_future, queries.shape[-1])
                rotation = rotations[key]
            scores[layer] = expected_attention_scores(queries, keys[..., :n, :], values[..., :n, :], scale,
                                                      self.use_covariance, rotation)

        for _ in probe(model, cache, [tokens[n - recent:]], observe, self.name, rows=n - recent):
            mx.eval(scores)
        return scores
