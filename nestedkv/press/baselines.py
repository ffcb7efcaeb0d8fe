"""The key-only baselines that need no memory of evicted keys: key norm, StreamingLLM's window, random."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from nestedkv import scoring
from nestedkv.press.base import SEED_MAX, BasePress, check, int_in


@dataclass(frozen=True)
class KnormPress(BasePress):
    name: ClassVar[str] = "knorm"
    rank: ClassVar[int] = 3
    compared: ClassVar[bool] = True

    def score(self, keys):
        return scoring.knorm_scores(keys)


@dataclass(frozen=True)
class StreamingLLMPress(BasePress):
    name: ClassVar[str] = "streaming_llm"
    rank: ClassVar[int] = 4
    compared: ClassVar[bool] = True

    def score(self, keys):
        return scoring.streaming_scores(keys)


@dataclass(frozen=True)
class RandomPress(BasePress):
    name: ClassVar[str] = "random"
    rank: ClassVar[int] = 5
    compared: ClassVar[bool] = True

    seed: int = 0

    def __post_init__(self):
        super().__post_init__()
        check(int_in(self.seed, 0, SEED_MAX), "seed", f"an int in 0..{SEED_MAX}", self.seed, press=self.name)

    def score(self, keys):
        return scoring.random_scores(keys, self.seed)
