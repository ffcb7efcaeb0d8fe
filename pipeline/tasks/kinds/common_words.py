"""``common_words``: a numbered list of words drawn from the novels' vocabulary, ten of them 30 times each (fewer when
the length cannot hold 300 entries, always more than the others), the others 3 times; "the ten most common
words". No prose, as in RULER: the plan's ``body`` is the whole context."""

from __future__ import annotations

import random

from pipeline.tasks.plans import Plan, Room, largest, task
from pipeline.tasks.forms import CWE_QUESTIONS



@task("common_words", rank=60)
def plan_common_words(rng: random.Random, room: Room, n_common: int = 10, freq_common: int = 30,
                      freq_rare: int = 3) -> Plan:
    length, count = room.length, room.count
    words = rng.sample(list(room.vocab), len(room.vocab))
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
