"""``niah_multivalue``: two keys with four values each; "what are all the values of key k" (all four)."""

from __future__ import annotations

import random

from pipeline.tasks.plans import Plan, Room, depths, task
from pipeline.tasks.forms import MULTI_QUESTIONS, MULTI_STATEMENTS, NOUNS, draw_key, draw_value



@task("niah_multivalue", rank=30)
def plan_niah_multivalue(rng: random.Random, room: Room) -> Plan:
    kind = rng.choice(("number", "word"))
    noun, statement, question = rng.choice(NOUNS[kind]), rng.choice(MULTI_STATEMENTS), rng.choice(MULTI_QUESTIONS)
    keys, values = set(), set()
    per_key = [(k, [draw_value(kind, rng, values) for _ in range(4)]) for k in (draw_key(rng, keys) for _ in range(2))]
    plants = [(k, v) for k, vs in per_key for v in vs]
    rng.shuffle(plants)
    sentences = {v: statement.format(noun=noun, key=k, value=v) for k, v in plants}
    return Plan(list(zip(depths(rng, len(plants)), [sentences[v] for _, v in plants])),
                [question.format(noun=noun, key=k) for k, _ in per_key], [vs for _, vs in per_key], [kind] * 2,
                [[sentences[v] for v in vs] for _, vs in per_key], [v for _, v in plants])
