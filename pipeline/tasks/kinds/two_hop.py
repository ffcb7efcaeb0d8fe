"""``two_hop``: two chains "A is in B" ... "B is in C"; "in which C is A" (the second hop's answer)."""

from __future__ import annotations

import random

from pipeline.tasks.plans import Plan, Room, task
from pipeline.tasks.forms import CONTAINERS, COUNTY_HEAD, FIRST, ITEMS, LAST, ROOM_ADJ, ROOMS, TOWN_HEAD, TOWN_TAIL, TWO_HOP



@task("two_hop", rank=70)
def plan_two_hop(rng: random.Random, room: Room, chains: int = 2) -> Plan:
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
