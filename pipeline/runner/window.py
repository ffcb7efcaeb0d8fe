"""How a document meets the model's window: read whole, streamed past it, cut in the middle, or refused
(``long_docs``), and why a question cannot be answered within it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from pipeline.config import CHARS_PER_TOKEN, RunConfig
from pipeline.runner.memory_plan import STREAMING, MemoryPlan


class OverLimit(ValueError):
    """A document longer than ``max_doc_tokens``: refused (a too_long row) before it is read."""


def check_size(doc_id: str, n_chars: int, n_tokens: Optional[int], cfg: RunConfig) -> None:
    """Refuse a document over ``max_doc_tokens``, by its characters before tokenizing (the tokenizer's
    memory grows with the text), then by its tokens."""
    limit = cfg.max_doc_tokens
    if n_tokens is None and n_chars > limit * CHARS_PER_TOKEN:
        raise OverLimit(f"document {doc_id!r}: {n_chars:,} characters, over the limit of "
                        f"{limit * CHARS_PER_TOKEN:,} ({CHARS_PER_TOKEN} per token of --max-doc-tokens {limit:,}); "
                        "split it or raise --max-doc-tokens")
    if n_tokens is not None and n_tokens > limit:
        raise OverLimit(f"document {doc_id!r}: {n_tokens:,} tokens, over --max-doc-tokens {limit:,}; "
                        "split it or raise --max-doc-tokens")


@dataclass
class PreparedDocument:
    """A document's token ids: one context, one question suffix per question."""

    context_ids: list[int]
    questions: list[tuple[str, list[int], Optional[str]]]  # (question, suffix ids, gold)
    truncated_from: Optional[int] = None
    # Longer than the window and read whole (long_docs="stream"): the rope positions its kept rows may use.
    positions: Optional[int] = None
    # Longer than the window, read in parts (long_docs="map_reduce"): the context tokens a part may hold,
    # and the parts (each a PreparedDocument of its own).
    split_room: Optional[int] = None
    parts: list = field(default_factory=list)
    memory: Optional[MemoryPlan] = None  # the way the memory plan chose (pipeline.runner.memory_plan)

    @property
    def stream_to_fit(self) -> bool:
        """Within the window, but read evicting while prefilling: whole would not fit the memory limit."""
        return self.memory is not None and self.memory.way == STREAMING and not self.positions

    @property
    def read_mode(self) -> str:
        """How the document was read: whole (it fits the window), stream (past it) or truncate (middle cut)."""
        if self.parts:
            return "map_reduce"
        return "stream" if self.positions else "truncate" if self.truncated_from else "whole"


def fit(prepared: PreparedDocument, cfg: RunConfig, max_context: Optional[int]) -> PreparedDocument:
    """Cut the middle (``truncate``) or plan to stream (``stream``: the rope positions its kept rows may use) a
    context too long for the window, in place; room is left for the longest question that fits with its
    answer at all (one that cannot is too long alone)."""
    if not max_context:
        return prepared
    context_ids, questions = prepared.context_ids, prepared.questions
    fitting = [len(q[1]) for q in questions if len(q[1]) + cfg.max_new_tokens < max_context]
    room = max_context - max(fitting, default=max_context) - cfg.max_new_tokens
    if len(context_ids) > room and room > 0 and cfg.long_docs == "truncate":
        # Keep the head (template + start) and the tail (end of the document) of the context.
        half = room // 2
        prepared.truncated_from = len(context_ids)
        prepared.context_ids = context_ids[:half] + context_ids[len(context_ids) - (room - half) :]
    elif len(context_ids) + min(len(q[1]) for q in questions) + cfg.max_new_tokens > max_context:
        # No question fits with the whole context (else those that do are answered from it, as is).
        if cfg.long_docs == "stream" and room > 2 * cfg.prefill_step_size:
            prepared.positions = room
        elif cfg.long_docs == "map_reduce" and room > 0:
            prepared.split_room = room
    return prepared


def over(prepared: PreparedDocument, n_question: int, cfg: RunConfig, max_context: Optional[int]) -> Optional[str]:
    """Why the context, a question of ``n_question`` tokens and its answer exceed the window, or None."""
    # streamed: the positions its kept rows use; in parts: the longest part
    fed = prepared.positions or max((len(p.context_ids) for p in prepared.parts), default=len(prepared.context_ids))
    need = fed + n_question + cfg.max_new_tokens
    if not max_context or need <= max_context:
        return None
    # Truncated or streamed, the context fits: only the question and the answer can be too long.
    hint = ("the question and the answer leave too little room for the context: shorten the question or lower "
            "--max-new-tokens" if cfg.long_docs != "refuse" else
            "pass --long-docs stream to read it whole or --long-docs truncate to cut its middle")
    return (f"context {len(prepared.context_ids)} + question {n_question} + max_new_tokens {cfg.max_new_tokens} "
            f"= {need} tokens exceeds the model window of {max_context}; {hint}")
