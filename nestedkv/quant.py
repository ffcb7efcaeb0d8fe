"""How kept KV rows are quantized, as one value: bits, group size and rotation, with their parse, checks and
labels (which of them a configuration's hash covers: ``nestedkv.compat``).

A new quantization setting is one field here (and one store column); every consumer reads it through
``KVQuant``, so two settings can never be separated on the way from the CLI to the report.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

KV_BITS = (4, 8)  # quantized KV (mx.quantize, affine): the widths mlx-lm users pass as --kv-bits
KV_GROUP_SIZES = (32, 64, 128)  # what mx.quantize accepts; 64 is mlx-lm's default
UNQUANTIZED = ("16", "none")  # --kv-bits spellings of "the model's own dtype"
# The name each setting has in a press, a run configuration and a store column.
FIELD_NAMES = {"bits": "kv_bits", "group_size": "kv_group_size", "hadamard": "kv_hadamard"}


def check_kv_bits(kv_bits, kv_group_size) -> None:
    if kv_bits is not None and (not isinstance(kv_bits, int) or isinstance(kv_bits, bool) or kv_bits not in KV_BITS):
        raise ValueError(f"kv_bits must be one of {', '.join(map(str, KV_BITS))} (or None: no quantization), "
                         f"got {kv_bits!r}")
    if kv_group_size not in KV_GROUP_SIZES or isinstance(kv_group_size, bool):
        raise ValueError(f"kv_group_size must be one of {', '.join(map(str, KV_GROUP_SIZES))}, got {kv_group_size!r}")


@dataclass(frozen=True)
class KVQuant:
    """``bits`` None: the model's dtype, and then the other settings are their defaults (one unquantized
    configuration, not one per group size)."""

    bits: Optional[int] = None
    group_size: int = 64
    hadamard: bool = True  # keys stored rotated by a Hadamard matrix (False: mlx-lm's layout)

    def __post_init__(self):
        check_kv_bits(self.bits, self.group_size)
        if not isinstance(self.hadamard, bool):
            raise ValueError(f"kv_hadamard must be true or false, got {self.hadamard!r}")
        if self.bits is None:
            for f in fields(self):
                object.__setattr__(self, f.name, f.default)

    @classmethod
    def parse_bits(cls, text: str) -> Optional[int]:
        """A ``--kv-bits`` value: 4 or 8, or 16/none for the model's own dtype."""
        t = str(text).strip().lower()
        if t in UNQUANTIZED:
            return None
        if t not in {str(b) for b in KV_BITS}:
            raise ValueError(f"--kv-bits must be {' or '.join(map(str, KV_BITS))} (16 or none: no quantization), "
                             f"got {str(text).strip()!r}")
        return int(t)

    @classmethod
    def from_fields(cls, row) -> "KVQuant":
        """From anything with ``kv_bits``... as keys (a store row, a dump) or attributes (a press, a config);
        a missing setting takes its default (rows of stores written before it existed)."""
        get = row.get if isinstance(row, dict) else (lambda n, d=None: getattr(row, n, d))
        kw = {f: get(n) for f, n in FIELD_NAMES.items() if get(n) is not None}
        return cls(**kw)

    def as_fields(self) -> dict:
        """``kv_bits``, ``kv_group_size``, ``kv_hadamard``: what a press and a run configuration take."""
        return {n: getattr(self, f) for f, n in FIELD_NAMES.items()}

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    def label(self, unit: str = "-bit") -> str:
        """The reports' suffix: " 4-bit", " 4-bit g32 plain"; none for the model's own dtype."""
        if not self.quantized:
            return ""
        return f" {self.bits}{unit}" + (f" g{self.group_size}" if self.group_size != 64 else "") + \
            ("" if self.hadamard else " plain")

    def run_label(self) -> str:
        """A run configuration's suffix: " kv4", " kv4/g32/plain"."""
        if not self.quantized:
            return ""
        return f" kv{self.bits}" + (f"/g{self.group_size}" if self.group_size != 64 else "") + \
            ("" if self.hadamard else "/plain")

    def sort_key(self) -> tuple:
        """Unquantized first, then fewer bits last... as the report lists them: 16 bits, 8, 4."""
        return (-(self.bits or 16), self.group_size, not self.hadamard)
