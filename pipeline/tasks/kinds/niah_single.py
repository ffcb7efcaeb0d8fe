"""``niah_single``: three needles of different kinds (a number, a code word, a name), each under its own key; one
question per needle."""

from __future__ import annotations

import random

from pipeline.tasks.plans import Plan, Room, depths, task
from pipeline.tasks.forms import NOUNS, QUESTIONS, STATEMENTS, draw_key, draw_value



@task("niah_single", rank=10)
def plan_niah_single(rng: random.Random, room: Room) -> Plan:
    keys, values = set(), set()
    statement, question = rng.choice(STATEMENTS), rng.choice(QUESTIONS)
    facts = []
    for kind in ("number", "word", "name"):
        key, noun, value = draw_key(rng, keys), rng.choice(NOUNS[kind]), draw_value(kind, rng, values)
        facts.append((kind, statement.format(noun=noun, key=key, value=value), question.format(noun=noun, key=key),
                      value))
    rng.shuffle(facts)
    needles = list(zip(depths(rng, 3), [s for _, s, _, _ in facts]))
    return Plan(needles, [q for *_, q, _ in facts], [[v] for *_, v in facts], [k for k, *_ in facts],
                [[s] for _, s, _, _ in facts], [v for *_, v in facts])
