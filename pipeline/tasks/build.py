"""Documents: a haystack sized around each task's needles in model tokens, the document rows, and their Parquet
file."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.metrics import MIDDLE
from pipeline.prompts import encode
from pipeline.tasks.kinds import KINDS, TASKS, check_tasks
from pipeline.tasks.plans import Room, TokenCounter, largest, plan_summary_events
from pipeline.tasks.text import SENTENCE_END, Sentence, haystack, vocabulary


@dataclass(frozen=True)
class Size:
    lengths: tuple[int, ...]  # target context tokens
    per_task: int  # documents per task and length


SIZES = {
    "quick": Size((1024,), 1),
    "small": Size((2048,), 2),
    # 8k documents leave 256 tokens of SmolLM2's 8,192 window for the chat template, question and answer.
    "standard": Size((2048, 4096, 7936), 2),
}


# -- sizing a haystack around the needles --------------------------------------------------------------------
def render(sentences: Sequence[Sentence], needles: Sequence[tuple[float, str]]) -> str:
    """The sentences as paragraphs with each needle planted before the open sentence nearest its depth (the
    end only when no sentence is open), so never inside a quotation or after a cut-off last sentence."""
    n = len(sentences)
    spots = [i for i, s in enumerate(sentences) if s.open] or [n]
    at: dict[int, list[str]] = {}
    for depth, s in needles:
        want = depth * n
        at.setdefault(min(spots, key=lambda i: (abs(i - want), i)), []).append(s)
    paras: list[list[str]] = []
    last = None
    for i, sent in enumerate(sentences):
        if sent.para != last:
            paras.append([])
            last = sent.para
        paras[-1].extend(at.get(i, []))
        paras[-1].append(sent.text)
    if n in at:
        if not paras:
            paras.append([])
        paras[-1].extend(at[n])
    return "\n\n".join(" ".join(p) for p in paras)


def fit(hay: Sequence[Sentence], start: int, needles: Sequence[tuple[float, str]], length: int,
        count: TokenCounter) -> str:
    """The longest run of haystack text from ``start`` (wrapping; whole sentences, then the words of one more)
    whose text with the needles is at most ``length`` tokens."""

    def take(n: int) -> list[Sentence]:
        return [hay[(start + i) % len(hay)] for i in range(n)]

    def text(n: int, words: int = 0) -> str:
        nxt = hay[(start + n) % len(hay)]
        tail = [Sentence(nxt.para, " ".join(nxt.text.split()[:words]), False)] if words else []
        return render(take(n) + tail, needles)

    hi = max(8, length // 40)  # fewer sentences than that many tokens hold
    while count(text(hi)) <= length:
        hi *= 2
        if hi > 4 * len(hay):
            raise ValueError(f"the haystack ({len(hay)} sentences) is too short for {length} tokens")
    n = largest(lambda k: count(text(k)) <= length, hi)
    nxt = hay[(start + n) % len(hay)].text.split()
    return text(n, largest(lambda w: count(text(n, w)) <= length, len(nxt) - 1))


# -- documents ---------------------------------------------------------------------------------------------
def length_label(length: int) -> str:
    """``2k``, ``8k`` (7,936 tokens: an 8k window less room for the prompt and the answer), or the number."""
    return f"{round(length / 1024)}k" if length >= 1024 else str(length)


def make_document(task: str, length: int, index: int, seed: int, hay: Sequence[Sentence], vocab: Sequence[str],
                  count: TokenCounter) -> dict:
    check_tasks([task])
    rng = random.Random(f"{seed}:{task}:{length}:{index}")
    room = Room(length, vocab, count)
    for _ in range(100):  # redraw until every value occurs exactly once (the haystack never supplies one)
        plan = KINDS[task].plan(rng, room)
        if plan.body is not None:
            text = plan.body
        else:
            starts = [i for i, s in enumerate(hay) if s.open]
            text = fit(hay, rng.choice(starts), plan.needles, length, count)
        if all(len(re.findall(rf"\b{re.escape(v)}\b", text)) == 1 for v in plan.once):
            break
    else:
        raise RuntimeError(f"{task} at {length} tokens: could not plant values that occur once")
    label = length_label(length)
    return {
        "doc_id": f"{task}-{label}-{index:03d}", "title": f"{task} ({label} tokens) #{index}", "text": text,
        "questions": plan.questions, "answers": [", ".join(p) for p in plan.parts], "task": task,
        "length": length, "n_tokens": count(text), "kinds": plan.kinds, "parts": plan.parts,
        "evidence": plan.evidence, "depths": None,
    }


def generate(count: TokenCounter, lengths: Sequence[int] = SIZES["standard"].lengths, per_task: int = 2,
             seed: int = 0, tasks: Sequence[str] = TASKS, austen: Optional[Path] = None) -> list[dict]:
    """Every task x length x index as a document row (see the module doc); ``count(text)`` -> tokens."""
    check_tasks(tasks)
    if per_task < 1 or not lengths or any(int(n) < 256 for n in lengths):
        raise ValueError(f"need per_task >= 1 and lengths >= 256 tokens, got per_task={per_task}, lengths={lengths}")
    hay = haystack(austen)
    vocab = vocabulary(hay)
    return [make_document(t, int(n), i, seed, hay, vocab, count) for n in lengths for t in tasks
            for i in range(per_task)]


def cut_middle(text: str, middle: tuple[float, float] = MIDDLE) -> str:
    """``text`` without its sentences whose centre lies within ``middle`` (shares of its characters): what a
    reader of the ends alone sees. Paragraphs left empty go too."""
    total, at, paras = max(len(text), 1), 0, []
    for para in text.split("\n\n"):
        kept = []
        for sent in SENTENCE_END.split(para):
            if not middle[0] <= (at + len(sent) / 2) / total < middle[1]:
                kept.append(sent)
            at += len(sent) + 1
        at += 1  # the paragraph break is two characters, a sentence break one
        if kept:
            paras.append(" ".join(kept))
    return "\n\n".join(paras)


def summary_documents(count: TokenCounter, lengths: Sequence[int], per_length: int = 1, seed: int = 0,
                      austen: Optional[Path] = None, events: int = 6, middle_cut: bool = False) -> list[dict]:
    """Austen text of each length with ``events`` planted events (``plans.plan_summary_events``: ``parts`` the
    names of each one's person and town, ``depths`` where it stands), for the coverage of summaries; no questions; ``task`` is
    ``summary``. ``middle_cut``: each document again without its middle (``cut_middle``), ``task``
    ``summary_cut``, so that a summary of the ends alone shows what the measure gives for a lost middle."""
    hay = haystack(austen)
    starts = [i for i, s in enumerate(hay) if s.open]
    rows = []
    for n in lengths:
        for i in range(per_length):
            rng = random.Random(f"{seed}:summary:{n}:{i}")
            start = rng.choice(starts)
            for _ in range(100):  # redraw until every name occurs once (the novels never supply one)
                plan = plan_summary_events(rng, events) if events else None
                text = fit(hay, start, plan.needles if plan else [], int(n), count)
                if plan is None or all(len(re.findall(rf"\b{re.escape(v)}\b", text)) == 1 for v in plan.once):
                    break
            else:
                raise RuntimeError(f"summary at {n} tokens: could not plant names that occur once")
            label = length_label(int(n))
            row = {"doc_id": f"summary-{label}-{i:03d}", "title": f"summary ({label} tokens) #{i}", "text": text,
                   "questions": None, "answers": None, "task": "summary", "length": int(n), "n_tokens": count(text),
                   "kinds": plan.kinds if plan else [], "parts": plan.parts if plan else [],
                   "evidence": plan.evidence if plan else [],
                   # where each event stands in the text as written (it goes before the open sentence nearest
                   # the depth drawn), as a share of the characters before it
                   "depths": [text.index(s) / len(text) for _, s in plan.needles] if plan else []}
            rows.append(row)
            if middle_cut:
                cut = cut_middle(text)
                rows.append({**row, "doc_id": row["doc_id"] + "-cut", "title": row["title"] + ", middle cut",
                             "text": cut, "task": "summary_cut", "n_tokens": count(cut),
                             "whole_text": text})  # in memory only: what its summary's coverage is scored against
    return rows


SCHEMA = pa.schema([
    ("doc_id", pa.string()), ("title", pa.string()), ("text", pa.string()), ("questions", pa.list_(pa.string())),
    ("answers", pa.list_(pa.string())), ("task", pa.string()), ("length", pa.int32()), ("n_tokens", pa.int32()),
    ("kinds", pa.list_(pa.string())), ("parts", pa.list_(pa.list_(pa.string()))),
    ("evidence", pa.list_(pa.list_(pa.string()))),
    ("depths", pa.list_(pa.float64())),  # summary documents: where each of ``parts`` was planted
])


def write(rows: Sequence[dict], path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(list(rows), schema=SCHEMA), path, compression="zstd")
    return path


def token_counter(tokenizer) -> TokenCounter:
    """Tokens of a text under ``tokenizer``, as the runner encodes a context (no special tokens added)."""
    return lambda text: len(encode(tokenizer, text))
