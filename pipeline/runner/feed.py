"""Feeding a document's context to the model: chunk by chunk, and, for a press its questions steer, reading them
after each chunk."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import mlx.core as mx

import nestedkv
from pipeline.results import TOO_LONG, DocumentResult
from pipeline.runner.window import PreparedDocument

Progress = Callable[[int, int], None]


def _backbone(model):
    # The transformer without the LM head: context chunks need only the cache, and the head is
    # ~20% of a small model's prefill FLOPs.
    inner = getattr(model, "model", None)
    return inner if callable(inner) else model


def prefill(model, cache, ids: list[int], step: int, on_progress: Optional[Progress] = None,
            questions: Sequence[Sequence[int]] = ()) -> None:
    """Feed the context in chunks of ``step`` tokens into ``cache`` (evaluated chunk by chunk); a press that
    steers its streaming prefill reads ``questions`` after each chunk but the last (``nestedkv.steer``; compression
    reads them after the last)."""
    body = _backbone(model)
    tokens = mx.array(ids, dtype=mx.int32)[None]
    n = len(ids)
    press = nestedkv.press_of(cache) if questions else None
    steered = press is not None and press.prefill == "streaming" and press.needs_questions
    for start in range(0, n, step):
        body(tokens[:, start : start + step], cache=cache)
        mx.eval([c.state for c in cache])
        if steered and start + step < n:
            nestedkv.steer(cache, model, questions)
        if on_progress:
            on_progress(min(start + step, n), n)


def asked(prepared: PreparedDocument, res: DocumentResult) -> list[list[int]]:
    """The token ids of the document's questions that will be asked (one too long for the window never is)."""
    return [ids for (_, ids, _), q in zip(prepared.questions, res.questions) if q.status != TOO_LONG]
