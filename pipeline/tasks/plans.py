"""What each task plants, at what depth, and what it asks (before a haystack is sized around it)."""

from __future__ import annotations

import random
import string
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from pipeline.tasks.forms import (CONTAINERS, COUNTY_HEAD, CWE_QUESTIONS, FIRST, ITEMS, LAST, MULTI_QUESTIONS,
                                  MULTI_STATEMENTS, NOUNS, QUERY_QUESTIONS, QUESTIONS, ROOM_ADJ,
                                  ROOMS, STATEMENTS, EVENTS, TOWN_HEAD, TOWN_TAIL, TWO_HOP, VT_FORMS, VT_QUESTIONS,
                                  draw_key, draw_value)

TokenCounter = Callable[[str], int]
TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "variable_tracking", "common_words",
         "two_hop")


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


def _depths(rng: random.Random, n: int) -> list[float]:
    return sorted(rng.uniform(0.05, 0.95) for _ in range(n))


def plan_niah_single(rng: random.Random) -> Plan:
    keys, values = set(), set()
    statement, question = rng.choice(STATEMENTS), rng.choice(QUESTIONS)
    facts = []
    for kind in ("number", "word", "name"):
        key, noun, value = draw_key(rng, keys), rng.choice(NOUNS[kind]), draw_value(kind, rng, values)
        facts.append((kind, statement.format(noun=noun, key=key, value=value), question.format(noun=noun, key=key),
                      value))
    rng.shuffle(facts)
    needles = list(zip(_depths(rng, 3), [s for _, s, _, _ in facts]))
    return Plan(needles, [q for *_, q, _ in facts], [[v] for *_, v in facts], [k for k, *_ in facts],
                [[s] for _, s, _, _ in facts], [v for *_, v in facts])


def _four_facts(rng: random.Random, questions: list[str]):
    """(kind, noun, question template, four (key, value) facts, their sentences) for a multi-needle plan."""
    kind = rng.choice(sorted(NOUNS))
    noun, statement, question = rng.choice(NOUNS[kind]), rng.choice(STATEMENTS), rng.choice(questions)
    keys, values = set(), set()
    facts = [(k, draw_value(kind, rng, values)) for k in (draw_key(rng, keys) for _ in range(4))]
    return kind, noun, question, facts, [statement.format(noun=noun, key=k, value=v) for k, v in facts]


def plan_niah_multikey(rng: random.Random) -> Plan:
    kind, noun, question, facts, sentences = _four_facts(rng, QUESTIONS)
    return Plan(list(zip(_depths(rng, 4), sentences)), [question.format(noun=noun, key=k) for k, _ in facts],
                [[v] for _, v in facts], [kind] * 4, [[s] for s in sentences], [v for _, v in facts])


def plan_niah_multivalue(rng: random.Random) -> Plan:
    kind = rng.choice(("number", "word"))
    noun, statement, question = rng.choice(NOUNS[kind]), rng.choice(MULTI_STATEMENTS), rng.choice(MULTI_QUESTIONS)
    keys, values = set(), set()
    per_key = [(k, [draw_value(kind, rng, values) for _ in range(4)]) for k in (draw_key(rng, keys) for _ in range(2))]
    plants = [(k, v) for k, vs in per_key for v in vs]
    rng.shuffle(plants)
    sentences = {v: statement.format(noun=noun, key=k, value=v) for k, v in plants}
    return Plan(list(zip(_depths(rng, len(plants)), [sentences[v] for _, v in plants])),
                [question.format(noun=noun, key=k) for k, _ in per_key], [vs for _, vs in per_key], [kind] * 2,
                [[sentences[v] for v in vs] for _, vs in per_key], [v for _, v in plants])


def plan_niah_multiquery(rng: random.Random) -> Plan:
    kind, noun, question, facts, sentences = _four_facts(rng, QUERY_QUESTIONS)
    order = list(range(4))
    rng.shuffle(order)
    pairs = [order[:2], order[2:]]
    return Plan(list(zip(_depths(rng, 4), sentences)),
                [question.format(noun=noun, key=facts[i][0], key2=facts[j][0]) for i, j in pairs],
                [[facts[i][1], facts[j][1]] for i, j in pairs], [kind] * 2,
                [[sentences[i], sentences[j]] for i, j in pairs], [v for _, v in facts])


def plan_variable_tracking(rng: random.Random, hops: int = 4, chains: int = 2) -> Plan:
    first, then = rng.choice(VT_FORMS)
    question = rng.choice(VT_QUESTIONS)
    names: set[str] = set()
    values: set[str] = set()
    out_chains = []
    for _ in range(chains):
        chain = []
        while len(chain) < hops + 1:
            n = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
            if n not in names:
                names.add(n)
                chain.append(n)
        out_chains.append((chain, draw_value("number", rng, values)))
    # Each chain's statements in order, at increasing depths; the two chains interleave.
    steps = [(c, i) for c in range(chains) for i in range(hops + 1)]
    depths = {c: _depths(rng, hops + 1) for c in range(chains)}
    needles, evidence = [], [[] for _ in range(chains)]
    for c, i in steps:
        chain, v = out_chains[c]
        s = first.format(a=chain[0], v=v) if i == 0 else then.format(a=chain[i], b=chain[i - 1])
        needles.append((depths[c][i], s))
        evidence[c].append(s)
    needles.sort(key=lambda x: x[0])
    return Plan(needles, [question.format(v=v) for _, v in out_chains], [chain for chain, _ in out_chains],
                ["variables"] * chains, evidence, [v for _, v in out_chains])


def plan_two_hop(rng: random.Random, chains: int = 2) -> Plan:
    first, second, question = rng.choice(TWO_HOP)
    rooms = "room" in question
    used: set[str] = set()

    def draw(pool_fn):
        while True:
            x = pool_fn()
            if x not in used:
                used.add(x)
                return x

    needles, questions, parts, evidence, once = [], [], [], [], []
    for _ in range(chains):
        if rooms:
            a = draw(lambda: rng.choice(ITEMS))
            b = draw(lambda: rng.choice(CONTAINERS))
            c = draw(lambda: f"{rng.choice(ROOM_ADJ)} {rng.choice(ROOMS)}")
        else:
            a = draw(lambda: f"{rng.choice(FIRST)} {rng.choice(LAST)}")
            b = draw(lambda: rng.choice(TOWN_HEAD) + rng.choice(TOWN_TAIL))
            c = draw(lambda: rng.choice(COUNTY_HEAD) + "shire")
        s1, s2 = first.format(a=a, b=b), second.format(b=b, c=c)
        d1, d2 = rng.uniform(0.05, 0.95), rng.uniform(0.05, 0.95)  # either hop may come first
        needles += [(d1, s1), (d2, s2)]
        questions.append(question.format(a=a))
        parts.append([c])
        evidence.append([s1, s2])
        once += [a, c]
    needles.sort(key=lambda x: x[0])
    return Plan(needles, questions, parts, ["two_hop"] * chains, evidence, once)


def plan_common_words(rng: random.Random, length: int, vocab: Sequence[str], count: TokenCounter,
                      n_common: int = 10, freq_common: int = 30, freq_rare: int = 3) -> Plan:
    words = rng.sample(list(vocab), len(vocab))
    common, rare_pool = words[:n_common], words[n_common:]
    order = rng.random()  # one shuffle seed for every size tried, so the search sees one list growing

    def body(n_rare: int, freq: int) -> str:
        entries = [w for w in common for _ in range(freq)] + [w for w in rare_pool[:n_rare] for _ in range(freq_rare)]
        random.Random(order).shuffle(entries)
        return " ".join(f"{i}. {w}" for i, w in enumerate(entries, 1))

    # Ten common words at 30 repeats; a length that cannot hold them gets fewer (but above the rare count).
    freq = freq_common
    while freq > freq_rare + 1 and count(body(0, freq)) > length:
        freq -= 1
    n_rare = largest(lambda n: count(body(n, freq)) <= length, len(rare_pool))
    question = rng.choice(CWE_QUESTIONS).format(n=n_common)
    return Plan([], [question], [list(common)], ["common_words"], [[f"{w} x{freq}" for w in common]], [],
                body=body(n_rare, freq))


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


def plan_niah_middle(rng: random.Random) -> Plan:
    """niah_single with its needles in the middle 30-70% of the document, where a cut of the middle loses
    them and a window over the end never held them (documents longer than the model's window)."""
    plan = plan_niah_single(rng)
    depths = sorted(rng.uniform(0.3, 0.7) for _ in plan.needles)
    plan.needles = [(d, s) for d, (_, s) in zip(depths, plan.needles)]
    return plan


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


LONG_TASKS = ("niah_middle",)  # not in the suite's default set: built for documents past the window
PLANNERS = {"niah_middle": plan_niah_middle, "niah_single": plan_niah_single, "niah_multikey": plan_niah_multikey,
            "niah_multivalue": plan_niah_multivalue, "niah_multiquery": plan_niah_multiquery,
            "variable_tracking": plan_variable_tracking, "two_hop": plan_two_hop}
