"""What a task plans (``Plan``: what to plant, at what depth, and what to ask, before a haystack is sized around
it), the registry of tasks, and the helpers planners share. A task is one module of ``pipeline.tasks.kinds``
whose planner registers itself with ``@task``."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from pipeline.tasks.forms import EVENTS, FIRST, LAST, NOUNS, STATEMENTS, TOWN_HEAD, TOWN_TAIL, draw_key, draw_value

TokenCounter = Callable[[str], int]


@dataclass
class Plan:
    """One document before its haystack is sized: what to plant, at what depth, and what to ask."""

    needles: list[tuple[float, str]]  # (depth in [0, 1], sentence), in reading order
    questions: list[str]
    parts: list[list[str]]
    kinds: list[str]
    evidence: list[list[str]]
    once: list[str]  # strings that must occur exactly once in the finished text
    body: Optional[str] = None  # the whole context, for tasks without a haystack (common_words)


@dataclass(frozen=True)
class Room:
    """What a planner may size its plan by: the document's target tokens, the novels' vocabulary and the
    tokenizer's counter."""

    length: int
    vocab: Sequence[str]
    count: TokenCounter


Planner = Callable[[random.Random, Room], Plan]


@dataclass(frozen=True)
class TaskKind:
    name: str
    plan: Planner
    rank: int  # the order of the suite's tables
    suite: bool  # in the suite's default set (False: built for another benchmark)


KINDS: dict[str, TaskKind] = {}


def task(name: str, *, rank: int, suite: bool = True) -> Callable[[Planner], Planner]:
    """Register a planner as task ``name``; a second task of one name is refused."""
    def register(fn: Planner) -> Planner:
        if name in KINDS:
            raise ValueError(f"task {name!r} is registered twice ({KINDS[name].plan.__module__} and {fn.__module__})")
        KINDS[name] = TaskKind(name, fn, rank, suite)
        return fn
    return register


def depths(rng: random.Random, n: int) -> list[float]:
    return sorted(rng.uniform(0.05, 0.95) for _ in range(n))


def four_facts(rng: random.Random, questions: list[str]):
    """(kind, noun, question template, four (key, value) facts, their sentences) for a multi-needle plan."""
    kind = rng.choice(sorted(NOUNS))
    noun, statement, question = rng.choice(NOUNS[kind]), rng.choice(STATEMENTS), rng.choice(questions)
    keys, values = set(), set()
    facts = [(k, draw_value(kind, rng, values)) for k in (draw_key(rng, keys) for _ in range(4))]
    return kind, noun, question, facts, [statement.format(noun=noun, key=k, value=v) for k, v in facts]


def largest(ok: Callable[[int], bool], hi: int) -> int:
    """The largest n in [0, hi] with ok(n) (ok is monotone: true up to some n), or 0."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def plan_summary_events(rng: random.Random, n: int = 6) -> Plan:
    """``n`` events, one in each of ``n`` equal bands of depth between 5% and 95% (so a document's middle and
    its ends hold some), each naming a person and a town that occur nowhere else. No questions: ``parts`` are
    each event's names (first name, last name, town; any found counts), for the coverage of a summary
    (``evaluate.coverage``)."""
    templates = rng.sample(EVENTS, n)
    firsts, lasts = rng.sample(FIRST, n), rng.sample(LAST, n)
    towns = rng.sample([h + t for h in TOWN_HEAD for t in TOWN_TAIL], n)
    band = 0.9 / n
    depths = [0.05 + band * (i + rng.uniform(0.15, 0.85)) for i in range(n)]
    sentences = [t.format(name=f"{f} {l}", town=w) for t, f, l, w in zip(templates, firsts, lasts, towns)]
    return Plan(list(zip(depths, sentences)), [], [[f, l, w] for f, l, w in zip(firsts, lasts, towns)],
                ["event"] * n, [[s] for s in sentences], firsts + lasts + towns)


