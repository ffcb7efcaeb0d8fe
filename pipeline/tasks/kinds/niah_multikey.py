"""``niah_multikey``: four needles of one kind and one phrasing under four keys; one question per key, the other
three are distractors of the same kind."""

from __future__ import annotations

import random

from pipeline.tasks.plans import Plan, Room, depths, four_facts, task
from pipeline.tasks.forms import QUESTIONS



@task("niah_multikey", rank=20)
def plan_niah_multikey(rng: random.Random, room: Room) -> Plan:
    kind, noun, question, facts, sentences = four_facts(rng, QUESTIONS)
    return Plan(list(zip(depths(rng, 4), sentences)), [question.format(noun=noun, key=k) for k, _ in facts],
                [[v] for _, v in facts], [kind] * 4, [[s] for s in sentences], [v for _, v in facts])
