"""Jane Austen's novels as a haystack of sentences: chapters -> paragraphs -> sentences, with the places where a
planted sentence may go (never inside a quotation). The four novels ship with the package (``austen/``,
gzip'd, public domain), so a seed builds the same documents on every machine."""

from __future__ import annotations

import gzip
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

NOVELS_DIR = Path(__file__).with_name("austen")
NOVEL_FILES = ("prideprejudice.txt", "sensesensibility.txt", "northangerabbey.txt", "mansfieldpark.txt")

ABBREVIATIONS = {"Mr.", "Mrs.", "Dr.", "St.", "Col.", "Capt.", "Esq."}
SENTENCE_END = re.compile(r'(?<=[.!?]) +(?=["A-Z])')


def roman(s: str) -> int:
    if s.isdigit():
        return int(s)
    vals = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100}
    nums = [vals[c] for c in s.upper()]
    return sum(-n if n < nxt else n for n, nxt in zip(nums, nums[1:] + [0]))


def novel_file(folder: Path, name: str) -> Optional[Path]:
    """``folder/name``, or its gzip'd copy ``name.gz`` (the package's), or None."""
    for path in (Path(folder) / name, Path(folder) / f"{name}.gz"):
        if path.is_file():
            return path
    return None


def read_chapters(path: Path) -> dict[int, list[str]]:
    """Chapter number -> paragraphs (blank lines separate paragraphs; wrapped lines are joined with spaces);
    ``path`` a novel's text, plain or gzip'd."""
    path = Path(path)
    text = gzip.decompress(path.read_bytes()).decode("utf-8") if path.suffix == ".gz" else path.read_text("utf-8")
    chapters: dict[int, list[str]] = {}
    current = None
    for block in re.split(r"\n\s*\n", text):
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
    """The novels' text as sentences, from the folder ``austen`` (``NOVEL_FILES``, plain or gzip'd; default:
    the package's copy)."""
    folder = Path(austen) if austen is not None else NOVELS_DIR
    files = [novel_file(folder, f) for f in NOVEL_FILES]
    if None in files:
        raise FileNotFoundError(f"Austen novels not found in {folder} (need {', '.join(NOVEL_FILES)})")
    paras = [p for f in files for _, ch in sorted(read_chapters(f).items()) for p in ch]
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


def vocabulary(hay: Sequence[Sentence]) -> list[str]:
    """Lower-case words of 5-9 letters that occur in the haystack, sorted (for common_words)."""
    return sorted({w for s in hay for w in re.findall(r"\b[a-z]{5,9}\b", s.text)})
