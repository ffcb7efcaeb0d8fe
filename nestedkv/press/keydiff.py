"""KeyDiff (arXiv:2504.15364): evict the keys most similar to the mean key direction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from nestedkv import scoring
from nestedkv.press.base import BasePress
from nestedkv.streaming import AnchorScorer


@dataclass(frozen=True)
class KeyDiffPress(BasePress):
    name: ClassVar[str] = "keydiff"
    rank: ClassVar[int] = 2
    compared: ClassVar[bool] = True
    stream_scorer: ClassVar[type] = AnchorScorer  # the anchor counts evicted keys too, as whole-context scoring

    unrotate: bool = True  # as NestedKV's, so the two compare like for like; False: the paper's post-RoPE KeyDiff

    def score(self, keys):
        return scoring.keydiff_scores(keys)
