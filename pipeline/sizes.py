"""Sizes of memory as users write them (``--memory-limit 8GiB``): light to import, for the settings."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40}


def parse_size(text: str) -> int:
    """Bytes from ``8GiB``, ``512MiB``, ``1.5G`` (binary: G, GiB; decimal: GB), or a plain number of bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = m and m.group(2).lower()
    if not m or unit not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"a memory size is a positive number with a unit (8GiB, 512MiB, 16GB), got {text!r}")
    return int(float(m.group(1)) * _UNITS[unit])
