"""Presses: a scorer bundled with its budget settings (names follow kvpress)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from typing import ClassVar, Optional

import mlx.core as mx

from nestedkv import rope, scoring
from nestedkv.selection import (
    N_SINK,
    SAFEGUARD,
    Selection,
    check_budget,
    check_head_budget,
    check_ratio,
    n_keep,
    select,
)


PREFILL_MODES = ("whole", "streaming")
KV_BITS = (4, 8)  # quantized KV (mx.quantize, affine): the widths mlx-lm users pass as --kv-bits
KV_GROUP_SIZES = (32, 64, 128)  # what mx.quantize accepts; 64 is mlx-lm's default
INT32_MAX = 2**31 - 1  # lengths and positions are int32 in the cache's arrays
SEED_MAX = 2**64 - 1  # mx.random.key takes a uint64


@dataclass(frozen=True)
class BasePress:
    """``compression_ratio`` is the fraction of context entries REMOVED (kvpress and the paper);
    ``budget`` is an absolute per-head token budget and wins over the ratio when given."""

    name: ClassVar[str] = ""

    compression_ratio: float = 0.0
    budget: Optional[int] = None
    head_budget: str = "uniform"
    n_sink: int = N_SINK
    safeguard: float = SAFEGUARD
    # "whole": compress once after the last prefill chunk. "streaming": also evict down to the budget during
    # the chunked prefill whenever a layer holds more than budget + one chunk (bounded peak; see cache.py).
    prefill: str = "whole"
    # Score the keys with the model's rotary embedding undone (each key rotated back by its position);
    # the cache keeps the rotated keys. Needs the cache built by make_cache (or clone) with the model.
    # Off here; the presses whose scores follow the keys' direction (NestedKV, KeyDiff) turn it on.
    unrotate: bool = False
    # Quantize the kept rows (and rows appended later) to kv_bits, in groups of kv_group_size along the head
    # dimension, once compression is done; None: keep the model's dtype. Scoring always sees the real keys.
    kv_bits: Optional[int] = None
    kv_group_size: int = 64

    def __post_init__(self):
        check_ratio(self.compression_ratio)
        check_budget(self.budget)
        check_head_budget(self.head_budget)
        if not _int_in(self.n_sink, 0, INT32_MAX):
            raise ValueError(f"n_sink must be an int in 0..{INT32_MAX}, got {self.n_sink!r}")
        if not (_number(self.safeguard) and 0.0 <= self.safeguard <= 1.0):
            raise ValueError(f"safeguard must be in [0, 1], got {self.safeguard!r}")
        if self.prefill not in PREFILL_MODES:
            raise ValueError(f"prefill must be one of {', '.join(PREFILL_MODES)}; got {self.prefill!r}")
        if not isinstance(self.unrotate, bool):
            raise ValueError(f"unrotate must be true or false, got {self.unrotate!r}")
        check_kv_bits(self.kv_bits, self.kv_group_size)

    def score(self, keys: mx.array) -> mx.array:
        raise NotImplementedError

    def n_keep(self, n: int) -> Optional[int]:
        return n_keep(n, self.compression_ratio, self.budget, self.n_sink)

    def select(self, keys: mx.array, unrope=None) -> Optional[Selection]:
        """Rows to keep for cached keys ``[B, H, N, D]`` at positions 0..N-1; None when nothing needs
        evicting. ``unrope``: the model's inverse rope (``nestedkv.rope``), used when ``unrotate``."""
        scoring.check_keys(keys)
        keep = self.n_keep(keys.shape[2])
        if keep is None:
            return None
        if self.unrotate:
            keys = rope.required(unrope, self.name)(keys, 0)
        return select(self.score(keys), keep, self.head_budget, n_sink=self.n_sink, safeguard=self.safeguard)

    def to_json(self) -> str:
        params = asdict(self)
        # Fields added after runs were stored leave the JSON (and run hashes) as it was while unused.
        if not self.unrotate:
            del params["unrotate"]
        if self.kv_bits is None:
            del params["kv_bits"], params["kv_group_size"]
        return json.dumps({"press": self.name, **params}, sort_keys=True)

    @staticmethod
    def from_json(text: str) -> "BasePress":
        params = json.loads(text)
        name = params.pop("press")
        params.setdefault("unrotate", False)  # stored before the parameter existed: post-RoPE scoring
        if "scales" in params:
            params["scales"] = tuple(params["scales"])
        if "prior" in params:
            params["prior"] = tuple(params["prior"])
        return get_press(name, **params)


def check_kv_bits(kv_bits, kv_group_size) -> None:
    if kv_bits is not None and (not isinstance(kv_bits, int) or isinstance(kv_bits, bool) or kv_bits not in KV_BITS):
        raise ValueError(f"kv_bits must be one of {', '.join(map(str, KV_BITS))} (or None: no quantization), "
                         f"got {kv_bits!r}")
    if kv_group_size not in KV_GROUP_SIZES or isinstance(kv_group_size, bool):
        raise ValueError(f"kv_group_size must be one of {', '.join(map(str, KV_GROUP_SIZES))}, got {kv_group_size!r}")


@dataclass(frozen=True)
class NoPress(BasePress):
    """The uncompressed reference: never evicts anything."""

    name: ClassVar[str] = "no_press"

    def n_keep(self, n: int) -> Optional[int]:
        return None


def _number(v) -> bool:
    """A finite int or float (NaN and infinities would reach the stored configuration and the scores)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _int_in(v, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _check(ok: bool, name: str, want: str, got, press: str = "nestedkv") -> None:
    if not ok:
        raise ValueError(f"{press} parameter {name} must be {want}, got {got!r}")


@dataclass(frozen=True)
class NestedKVPress(BasePress):
    name: ClassVar[str] = "nestedkv"

    # On by default: unrotated scoring did better on the bundled evaluation set and the long-context suite
    # (README, "Unrotated scoring"); unrotate=False is the paper's post-RoPE scoring.
    unrotate: bool = True
    window: int = scoring.WINDOW
    block: Optional[int] = None
    prior: tuple = scoring.PRIOR
    beta: float = scoring.BETA
    tail: float = scoring.TAIL
    tau: float = scoring.TAU
    kappa: float = scoring.KAPPA
    use_gate: bool = True
    scales: tuple = (True, True, True)

    def __post_init__(self):
        super().__post_init__()
        _check(_int_in(self.window, 1, INT32_MAX), "window", f"an int in 1..{INT32_MAX}", self.window)
        _check(self.block is None or _int_in(self.block, 1, INT32_MAX), "block", f"None or an int in 1..{INT32_MAX}",
               self.block)
        _check(isinstance(self.prior, tuple) and len(self.prior) == 3 and all(_number(p) and p > 0 for p in self.prior),
               "prior", "three positive numbers", self.prior)
        for name in ("beta", "tau", "kappa"):
            _check(_number(getattr(self, name)), name, "a finite number", getattr(self, name))
        _check(_number(self.tail) and 0 < self.tail <= 0.5, "tail", "a number in (0, 0.5]", self.tail)
        _check(isinstance(self.use_gate, bool), "use_gate", "true or false", self.use_gate)
        _check(isinstance(self.scales, tuple) and len(self.scales) == 3 and all(isinstance(x, bool) for x in self.scales)
               and any(self.scales), "scales", "three booleans, at least one true", self.scales)

    def score(self, keys):
        return scoring.nestedkv_scores(
            keys,
            window=self.window,
            block=self.block,
            prior=self.prior,
            beta=self.beta,
            tail=self.tail,
            tau=self.tau,
            kappa=self.kappa,
            use_gate=self.use_gate,
            scales=self.scales,
        )


@dataclass(frozen=True)
class KeyDiffPress(BasePress):
    name: ClassVar[str] = "keydiff"

    unrotate: bool = True  # as NestedKV's, so the two compare like for like; False: the paper's post-RoPE KeyDiff

    def score(self, keys):
        return scoring.keydiff_scores(keys)


@dataclass(frozen=True)
class KnormPress(BasePress):
    name: ClassVar[str] = "knorm"

    def score(self, keys):
        return scoring.knorm_scores(keys)


@dataclass(frozen=True)
class StreamingLLMPress(BasePress):
    name: ClassVar[str] = "streaming_llm"

    def score(self, keys):
        return scoring.streaming_scores(keys)


@dataclass(frozen=True)
class RandomPress(BasePress):
    name: ClassVar[str] = "random"

    seed: int = 0

    def __post_init__(self):
        super().__post_init__()
        _check(_int_in(self.seed, 0, SEED_MAX), "seed", f"an int in 0..{SEED_MAX}", self.seed, press=self.name)

    def score(self, keys):
        return scoring.random_scores(keys, self.seed)


PRESSES: dict[str, type[BasePress]] = {
    cls.name: cls for cls in (NestedKVPress, KeyDiffPress, KnormPress, StreamingLLMPress, RandomPress, NoPress)
}


def get_press(name: str, **params) -> BasePress:
    """Build a press by its kvpress name; parameters the press does not take are rejected."""
    if name not in PRESSES:
        raise ValueError(f"unknown press {name!r}; allowed: {', '.join(PRESSES)}")
    cls = PRESSES[name]
    allowed = {f.name for f in fields(cls)}
    unknown = set(params) - allowed
    if unknown:
        raise TypeError(f"press {name!r} does not take {sorted(unknown)}; allowed: {sorted(allowed)}")
    return cls(**params)
