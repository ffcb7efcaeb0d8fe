"""What the runner produces for one document; the store writes exactly these."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # an annotation only: nestedkv.accounting loads mlx-lm, which the store's readers need not
    from nestedkv.accounting import LayerMemory

# Document/question statuses.
OK = "ok"
ERROR = "error"
TOO_LONG = "too_long"


@dataclass
class QuestionResult:
    question_idx: int
    question: str
    output: str = ""
    gold: Optional[str] = None
    n_question_tokens: int = 0
    n_generated: int = 0
    decode_s: float = 0.0
    status: str = OK
    error: Optional[str] = None
    logprob: float = 0.0  # mean log-probability of the answer's tokens (map-reduce's tie-break)

    @property
    def decode_tok_s(self) -> float:
        return self.n_generated / self.decode_s if self.decode_s > 0 else 0.0


@dataclass
class DocumentResult:
    doc_id: str
    content_sha256: str
    n_chars: int
    title: Optional[str] = None
    n_tokens: int = 0  # context tokens fed (what is compressed)
    n_tokens_full: Optional[int] = None  # the document's own length, when truncation fed fewer
    read_mode: str = "whole"  # whole (fits the window), stream (read past it) or truncate (its middle cut)
    status: str = OK
    error: Optional[str] = None
    prefill_s: float = 0.0  # this run's: the load time when the prefill came from the prefill cache
    # The seconds computing that prefill took (here, or in the run that stored the cache entry): what
    # compression's cost is measured against. None: loaded from an entry stored before it was kept.
    prefill_compute_s: Optional[float] = 0.0
    compress_s: float = 0.0
    peak_prefill_bytes: int = 0
    peak_decode_bytes: int = 0
    peak_kv_prefill_bytes: int = 0  # K/V buffers at their largest, all layers, while prefilling + compressing
    peak_kv_decode_bytes: int = 0  # the same while answering
    memory_plan: Optional[str] = None  # how the memory plan read it: whole, streaming, parts of N (tokens)
    planned_peak_bytes: Optional[int] = None  # the plan's estimate of the peak (pipeline.runner.memory_plan)
    questions: list[QuestionResult] = field(default_factory=list)
    layers: list[LayerMemory] = field(default_factory=list)
    # The exception behind an error status (not stored): lets a caller decide to retry.
    exception: Optional[BaseException] = field(default=None, repr=False, compare=False)

    def fail(self, exc: BaseException) -> "DocumentResult":
        self.status, self.error, self.exception = ERROR, f"{type(exc).__name__}: {exc}", exc
        return self

    def close_questions(self) -> "DocumentResult":
        """A document with a failed question is an error, naming each failed question. A question too long
        for the window is not a failure of the document: only its own row says so, the others keep theirs."""
        failed = [q for q in self.questions if q.status not in (OK, TOO_LONG)]
        if failed:
            self.status = ERROR
            self.error = "; ".join(f"question {q.question_idx}: {q.error}" for q in failed if q.error)
        return self

    @property
    def all_ok(self) -> bool:
        """The document and every question ended ok (a question too long for the window leaves the document
        ok, its other answers stored, but not done: resume runs it again)."""
        return self.status == OK and all(q.status == OK for q in self.questions)

    @property
    def problems(self) -> Optional[str]:
        """What went wrong, in one line: a failed document's error; for an ok one, its note (truncation) and the
        errors of its questions that did not end ok. None when there is nothing to say."""
        if self.status != OK:
            return self.error
        return "; ".join([self.error] * bool(self.error) + [q.error for q in self.questions
                                                            if q.status != OK and q.error]) or None

    @property
    def prefill_tok_s(self) -> float:
        return self.n_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_s(self) -> float:
        return sum(q.decode_s for q in self.questions)
