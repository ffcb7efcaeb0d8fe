"""``niah_multiquery``: four keys, one value each; each question asks for two keys' values at once."""

from __future__ import annotations

import random

from pipeline.tasks.plans import Plan, Room, depths, four_facts, task
from pipeline.tasks.forms import QUERY_QUESTIONS



@task("niah_multiquery", rank=40)
def plan_niah_multiquery(rng: random.Random, room: Room) -> Plan:
    kind, noun, question, facts, sentences = four_facts(rng, QUERY_QUESTIONS)
    order = list(range(4))
    rng.shuffle(order)
    pairs = [order[:2], order[2:]]
    return Plan(list(zip(depths(rng, 4), sentences)),
                [question.format(noun=noun, key=facts[i][0], key2=facts[j][0]) for i, j in pairs],
                [[facts[i][1], facts[j][1]] for i, j in pairs], [kind] * 2,
                [[sentences[i], sentences[j]] for i, j in pairs], [v for _, v in facts])
