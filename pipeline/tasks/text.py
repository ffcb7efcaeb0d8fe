"""Jane Austen's novels as a haystack of sentences: chapters -> paragraphs -> sentences, with the places where a
planted sentence may go (never inside a quotation)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import pyarrow.parquet as pq

DATA = Path(__file__).resolve().parents[2] / "data"
DEFAULT_AUSTEN = Path(__file__).resolve().parents[3] / "shared/data/austen"
NOVEL_FILES = ("prideprejudice.txt", "sensesensibility.txt", "northangerabbey.txt", "mansfieldpark.txt")

ABBREVIATIONS = {"Mr.", "Mrs.", "Dr.", "St.", "Col.", "Capt.", "Esq."}
SENTENCE_END = re.compile(r'(?<=[.!?]) +(?=["A-Z])')


def roman(s: str) -> int:
    if s.isdigit():
        return int(s)
    vals = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100}
    nums = [vals[c] for c in s.upper()]
    return sum(-n if n < nxt else n for n, nxt in zip(nums, nums[1:] + [0]))


def read_chapters(path: Path) -> dict[int, list[str]]:
    """Chapter number -> paragraphs (blank lines separate paragraphs; wrapped lines are joined with spaces)."""
    chapters: dict[int, list[str]] = {}
    current = None
    for block in re.split(r"\n\s*\n", path.read_text(encoding="utf-8")):
        para = " ".join(block.split())
        m = re.fullmatch(r"chapter\s+([0-9]+|[ivxlc]+)\.?", para, re.I)
        if m:
            current = chapters.setdefault(roman(m.group(1)), [])
        elif para in ("THE END", "A NOTE ON THE TEXT"):
            current = None  # end matter, not Austen's text
        elif current is not None and para and para[0] not in "[*":  # editorial notes and footnotes
            current.append(re.sub(r"_([^_]+)_", r"\1", para))  # underscores mark italics
    return chapters


def boundaries(paras: list[str]) -> list[tuple[int, int]]:
    """(paragraph, offset) where a new sentence may go: a paragraph start, or after a sentence, outside quotes."""
    out, open_quote = [], False
    for i, p in enumerate(paras):
        if i == 0 or (not open_quote and paras[i - 1][-1] in '.!?"'):  # not after "... said in reply:"
            out.append((i, 0))
        # A quotation over several paragraphs reopens each one with '"' and closes only at its end.
        open_quote = open_quote and not p.startswith('"')
        for m in SENTENCE_END.finditer(p):
            before = p[:m.start()]
            if (open_quote + before.count('"')) % 2 == 0 and before.rsplit(" ", 1)[-1] not in ABBREVIATIONS:
                out.append((i, m.start()))
        open_quote = (open_quote + p.count('"')) % 2 == 1
    return out


@dataclass(frozen=True)
class Sentence:
    para: int  # paragraph number in the haystack
    text: str
    open: bool  # a new sentence may be planted just before this one


def haystack(austen: Optional[Path] = None) -> list[Sentence]:
    """The novels' text as sentences, from ``austen`` (default: the shared copy of the novels when present,
    else the chapters bundled in data/*.parquet with their planted facts removed)."""
    folder = Path(austen) if austen is not None else DEFAULT_AUSTEN
    if all((folder / f).is_file() for f in NOVEL_FILES):
        paras = [p for f in NOVEL_FILES for _, ch in sorted(read_chapters(folder / f).items()) for p in ch]
    elif austen is not None:
        raise FileNotFoundError(f"Austen novels not found in {folder} (need {', '.join(NOVEL_FILES)})")
    else:
        paras = _bundled_paragraphs()
    out: list[Sentence] = []
    spots: dict[int, set[int]] = {}
    for i, off in boundaries(paras):
        spots.setdefault(i, set()).add(off)
    for i, p in enumerate(paras):
        mine = spots.get(i, set())
        cuts = sorted({0, len(p)} | mine)
        for a, b in zip(cuts, cuts[1:]):
            piece = p[a:b].strip()
            if piece:
                out.append(Sentence(i, piece, a in mine))
    return out


def _bundled_paragraphs() -> list[str]:
    paras = []
    for name in ("eval_set", "sample_batch"):
        for r in pq.read_table(DATA / f"{name}.parquet", columns=["text", "answers"]).to_pylist():
            for p in r["text"].split("\n\n"):
                # drop the planted sentences: only Austen's own text may be a haystack
                kept = [s for s in SENTENCE_END.split(p) if not any(a in s for a in r["answers"])]
                if kept:
                    paras.append(" ".join(kept))
    return paras


def vocabulary(hay: Sequence[Sentence]) -> list[str]:
    """Lower-case words of 5-9 letters that occur in the haystack, sorted (for common_words)."""
    return sorted({w for s in hay for w in re.findall(r"\b[a-z]{5,9}\b", s.text)})
