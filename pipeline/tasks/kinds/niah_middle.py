"""``niah_middle``: not in the suite's default set; built for documents past the window (``nkv bench long``)."""

from __future__ import annotations

import random

from pipeline.tasks.kinds.niah_single import plan_niah_single
from pipeline.tasks.plans import Plan, Room, task



@task("niah_middle", rank=100, suite=False)
def plan_niah_middle(rng: random.Random, room: Room) -> Plan:
    """niah_single with its needles in the middle 30-70% of the document, where a cut of the middle loses
    them and a window over the end never held them (documents longer than the model's window)."""
    plan = plan_niah_single(rng, room)
    depths = sorted(rng.uniform(0.3, 0.7) for _ in plan.needles)
    plan.needles = [(d, s) for d, (_, s) in zip(depths, plan.needles)]
    return plan
