"""``variable_tracking``: two chains of five variables (``VAR A = 12345``, ``VAR B = VAR A``, ...); "which variables
hold 12345" (all five of that chain)."""

from __future__ import annotations

import random
import string

from pipeline.tasks.plans import Plan, Room, depths, task
from pipeline.tasks.forms import VT_FORMS, VT_QUESTIONS, draw_value



@task("variable_tracking", rank=50)
def plan_variable_tracking(rng: random.Random, room: Room, hops: int = 4, chains: int = 2) -> Plan:
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
    at = {c: depths(rng, hops + 1) for c in range(chains)}
    needles, evidence = [], [[] for _ in range(chains)]
    for c, i in steps:
        chain, v = out_chains[c]
        s = first.format(a=chain[0], v=v) if i == 0 else then.format(a=chain[i], b=chain[i - 1])
        needles.append((at[c][i], s))
        evidence[c].append(s)
    needles.sort(key=lambda x: x[0])
    return Plan(needles, [question.format(v=v) for _, v in out_chains], [chain for chain, _ in out_chains],
                ["variables"] * chains, evidence, [v for _, v in out_chains])
