"""Settings added after configurations were stored, in one place: a stored form (a press's JSON, a run's
hash) leaves such a setting out while it has the value every configuration had in effect before the setting
existed, so runs stored then keep their hashes and resume; reading a stored form back fills it in.
"""

from __future__ import annotations

from typing import Mapping

# A setting's value before it existed: post-RoPE scoring, the model's own dtype, keys quantized unrotated.
BEFORE = {"unrotate": False, "kv_bits": None, "kv_hadamard": False}
# Settings that qualify another, left out with it (an unquantized press has no group size or rotation).
QUALIFIES = {"kv_group_size": "kv_bits", "kv_hadamard": "kv_bits"}


def left_out(values: Mapping, before: Mapping = BEFORE) -> set[str]:
    """The names of ``values`` a stored form leaves out; ``before``: the added settings and their old values."""
    out = {n for n, v in before.items() if n in values and values[n] == v}
    return out | {n for n, base in QUALIFIES.items() if base in out and n in values}


def stored(values: Mapping, before: Mapping = BEFORE) -> dict:
    """``values`` as a stored form writes them."""
    gone = left_out(values, before)
    return {k: v for k, v in values.items() if k not in gone}


def filled_in(values: Mapping) -> dict:
    """A stored form read back: what it left out, at its old value (a qualifier only beside what it qualifies,
    since without it the field's default is what was meant)."""
    fill = {n: v for n, v in BEFORE.items() if n not in QUALIFIES or QUALIFIES[n] in values}
    return {**fill, **values}
