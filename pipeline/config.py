"""The configuration of a run: what makes two runs comparable, and its stable hash."""

from __future__ import annotations

import hashlib
import json
from importlib import metadata
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Task = Literal["summarize", "qa"]
HeadBudget = Literal["uniform", "adaptive"]

DEFAULT_MODEL = "smollm2-135m"
SUMMARY_INSTRUCTION = "Summarize the document above in 3 sentences."
# Asking for a phrase copied from the document made SmolLM2-135M answer 7 of the 8 sample-batch
# questions without compression, against 5 of 8 for "answer in a few words".
QA_INSTRUCTION = "Question: {question}\nAnswer with a short phrase copied from the document."
# Greedy summaries from small models loop ("The game of chance is a game of chance..."); a mild
# penalty over the last 64 generated tokens stops that. QA stays plain greedy unless asked.
SUMMARY_REPETITION_PENALTY = 1.1


class RunConfig(BaseModel):
    """Everything that changes a document's output. Two runs with equal hashes are the same work."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    task: Task = "summarize"
    model: str = DEFAULT_MODEL
    press: str = "nestedkv"
    compression_ratio: float = Field(0.75, ge=0.0, lt=1.0)
    budget: Optional[int] = Field(None, ge=1)
    head_budget: HeadBudget = "uniform"
    prefill_step_size: int = Field(512, ge=1)
    max_new_tokens: int = Field(128, ge=1)
    truncate: bool = False
    summary_instruction: str = SUMMARY_INSTRUCTION
    qa_instruction: str = QA_INSTRUCTION
    repetition_penalty: Optional[float] = Field(None, gt=0)  # 1.0 disables

    @model_validator(mode="before")
    @classmethod
    def _summary_penalty(cls, data):
        if isinstance(data, dict) and data.get("repetition_penalty") is None and data.get("task", "summarize") == "summarize":
            data = {**data, "repetition_penalty": SUMMARY_REPETITION_PENALTY}
        return data

    @field_validator("qa_instruction")
    @classmethod
    def _has_question_slot(cls, v: str) -> str:
        if "{question}" not in v:
            raise ValueError("qa_instruction must contain the placeholder {question}")
        return v

    @field_validator("press")
    @classmethod
    def _known_press(cls, v: str) -> str:
        from nestedkv.press import PRESSES

        if v not in PRESSES:
            raise ValueError(f"unknown press {v!r}; allowed: {', '.join(sorted(PRESSES))}")
        return v

    def make_press(self):
        """The nestedkv press this configuration describes."""
        from nestedkv.press import get_press

        return get_press(
            self.press,
            compression_ratio=self.compression_ratio,
            budget=self.budget,
            head_budget=self.head_budget,
        )

    def canonical_json(self) -> str:
        return json.dumps(self.model_dump(), sort_keys=True, separators=(",", ":"))

    def config_hash(self) -> str:
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()

    def reference(self) -> "RunConfig":
        """The uncompressed twin of this configuration (what quality is measured against)."""
        return self.model_copy(
            update={"press": "no_press", "compression_ratio": 0.0, "budget": None, "head_budget": "uniform"}
        )


def code_version() -> str:
    try:
        return metadata.version("nestedkv-pipeline")
    except metadata.PackageNotFoundError:
        return "0+unknown"
