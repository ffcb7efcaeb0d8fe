"""The press contract: a key scorer bundled with its budget settings (names follow kvpress), and the registry
every press joins by subclassing ``BasePress`` with a ``name``."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from typing import ClassVar, Optional

import mlx.core as mx

from nestedkv import compat, rope, scoring
from nestedkv.quant import KV_BITS, KV_GROUP_SIZES, KVQuant, check_kv_bits  # noqa: F401 (re-exported)
from nestedkv.run_defaults import COMPRESSION_RATIO
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
from nestedkv.streaming import StreamScorer

PREFILL_MODES = ("whole", "streaming")
# The fields that pick rows from a press's scores, or store the picked rows, without changing the scores.
SELECTION_FIELDS = ("compression_ratio", "budget", "head_budget", "kv_bits", "kv_group_size", "kv_hadamard")
INT32_MAX = 2**31 - 1  # lengths and positions are int32 in the cache's arrays
SEED_MAX = 2**64 - 1  # mx.random.key takes a uint64

# name -> press class, filled by BasePress.__init_subclass__ and ordered by rank once the presses are loaded.
PRESSES: dict[str, type["BasePress"]] = {}


@dataclass(frozen=True)
class BasePress:
    """``compression_ratio`` is the fraction of context entries REMOVED (kvpress and the paper);
    ``budget`` is an absolute per-head token budget and wins over the ratio when given.

    A press is a ``name``, its own fields (validated in ``__post_init__``), ``score(keys) -> [B, H, N]``
    and, when streaming needs more than the stored keys, a ``stream_scorer``."""

    name: ClassVar[str] = ""
    rank: ClassVar[int] = 100  # position in method lists and report rows
    compared: ClassVar[bool] = False  # one of the default methods of `nkv eval` and the suite
    stream_scorer: ClassVar[type] = StreamScorer  # its state during a streaming prefill (see streaming.py)
    # Scores need the model, not only the keys: ``model_scores`` runs after the prefill, inside compression
    # (``nestedkv.compress(cache, model=..., tokens=...)``), and the press cannot stream unless it ``streams``.
    needs_model: ClassVar[bool] = False
    # Scores read the document's questions (``model_scores(..., questions=)``): the rows kept are those these
    # questions need, so later questions may find less. Runs record it (``saw_questions``).
    needs_questions: ClassVar[bool] = False
    # A run's settings for this press where they differ from the fields' defaults, which keep the library's
    # contract (a press built bare compresses nothing, as kvpress's; a uniform budget works with every model,
    # adaptive needs the attention routed). A subclass adds its own to its bases' (``defaults``); the ratio is
    # every press's (``nestedkv.run_defaults``; a sweep's grid shares it). The pipeline reads them here.
    run_defaults: ClassVar[dict] = {"compression_ratio": COMPRESSION_RATIO}

    compression_ratio: float = 0.0
    budget: Optional[int] = None
    head_budget: str = "uniform"
    n_sink: int = N_SINK
    safeguard: float = SAFEGUARD
    # "whole": compress once after the last prefill chunk. "streaming": also evict down to the budget during
    # the chunked prefill whenever a layer holds more than budget + one chunk (bounded peak; see kvcache.py).
    prefill: str = "whole"
    # Score the keys with the model's rotary embedding undone (each key rotated back by its position);
    # the cache keeps the rotated keys. Needs the cache built by make_cache (or clone) with the model.
    # Off here; the presses whose scores follow the keys' direction (NestedKV, KeyDiff) turn it on.
    unrotate: bool = False
    # Quantize the kept rows (and rows appended later) to kv_bits, in groups of kv_group_size along the head
    # dimension, once compression is done; None: keep the model's dtype. Scoring always sees the real keys.
    kv_bits: Optional[int] = None  # defaults: KVQuant's, declared once
    kv_group_size: int = KVQuant().group_size
    # Quantized keys are stored rotated by a Hadamard matrix (queries are rotated alike at attention), so no
    # quantization group holds a key's outlier channels. False: mlx-lm's QuantizedKVCache layout, unrotated.
    kv_hadamard: bool = KVQuant().hadamard

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("name")
        if not name:
            return  # an abstract or helper subclass
        old = PRESSES.get(name)
        if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(f"press name {name!r} is taken by {old.__module__}.{old.__qualname__}")
        PRESSES[name] = cls

    def __post_init__(self):
        check_ratio(self.compression_ratio)
        check_budget(self.budget)
        check_head_budget(self.head_budget)
        if not int_in(self.n_sink, 0, INT32_MAX):
            raise ValueError(f"n_sink must be an int in 0..{INT32_MAX}, got {self.n_sink!r}")
        if not (is_number(self.safeguard) and 0.0 <= self.safeguard <= 1.0):
            raise ValueError(f"safeguard must be in [0, 1], got {self.safeguard!r}")
        if self.prefill not in PREFILL_MODES:
            raise ValueError(f"prefill must be one of {', '.join(PREFILL_MODES)}; got {self.prefill!r}")
        if not isinstance(self.unrotate, bool):
            raise ValueError(f"unrotate must be true or false, got {self.unrotate!r}")
        check_kv_bits(self.kv_bits, self.kv_group_size)
        if not isinstance(self.kv_hadamard, bool):
            raise ValueError(f"kv_hadamard must be true or false, got {self.kv_hadamard!r}")
        self.check_whole_prefill()

    @property
    def kv_quant(self) -> KVQuant:
        return KVQuant.from_fields(self)

    def score(self, keys: mx.array) -> mx.array:
        if self.needs_model:
            raise ValueError(f"press {self.name!r} scores keys with the model: compress with "
                             "nestedkv.compress(cache, model=model, tokens=context_ids) after the prefill")
        raise NotImplementedError

    def model_scores(self, model, cache: list, tokens: list[int], prompt) -> list[mx.array]:
        """One ``[B, H, N]`` score per layer of an uncompressed ``cache`` holding ``tokens`` (the context);
        ``prompt``: the ``nestedkv.Instruction`` a press may feed (e.g. "repeat the context")."""
        raise NotImplementedError

    def scoring_key(self) -> str:
        """What this press's scores depend on: its JSON less the fields that only choose among the scores
        (ratio, budget, head budget) or store the kept rows (quantization). Presses with one key may share
        one scoring pass (``nestedkv.compress(..., scores=)``)."""
        params = json.loads(self.to_json())
        return json.dumps({k: v for k, v in params.items() if k not in SELECTION_FIELDS}, sort_keys=True)

    @property
    def streams(self) -> bool:
        """Whether it can evict while prefilling (``prefill="streaming"``, documents past the window): key-only
        presses can; one scoring with the model only where it steers each chunk itself (``steer``)."""
        return not self.needs_model

    def check_whole_prefill(self) -> None:
        if not self.streams and self.prefill != "whole":
            raise ValueError(f"press {self.name!r} scores the whole context with the model after the prefill, so "
                             "it cannot evict while prefilling (prefill='streaming', documents past the window); "
                             "use prefill='whole', or a key-only press (nestedkv, keydiff) to stream")

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
        return self.select_scores(self.score(keys), keep)

    def select_model_scores(self, scores: mx.array, keep: Optional[int] = None) -> Optional[Selection]:
        """``select`` for scores a ``needs_model`` press computed; ``keep``: rows per head on average in this
        layer (``layer_keeps``), else the press's budget; None when nothing needs evicting."""
        budget = self.n_keep(scores.shape[2])
        if budget is None:
            return None
        return self.select_scores(scores, budget if keep is None else keep)

    def layer_keeps(self, scores: list) -> list[Optional[int]]:
        """Per layer, the rows per head to keep from these ``model_scores`` (None: the press's budget, the
        same in every layer). A press whose scores are comparable across layers may move budget between them."""
        return [None] * len(scores)

    def select_scores(self, scores: mx.array, keep: int, cap: Optional[int] = None) -> Selection:
        """The head budget around any scorer's ``[B, H, N]`` scores (uniform, or adaptive head competition);
        ``cap``: the most rows one head may keep."""
        return select(scores, keep, self.head_budget, n_sink=self.n_sink, safeguard=self.safeguard, cap=cap)

    @classmethod
    def defaults(cls) -> dict:
        """Every field's default, with the run's own where ``run_defaults`` gives one (what a run takes)."""
        own = {}
        for klass in reversed(cls.__mro__):
            own.update(vars(klass).get("run_defaults", {}))
        return {**{f.name: f.default for f in fields(cls)}, **own}

    @classmethod
    def parse_params(cls, params: dict) -> dict:
        """Field values from JSON values (a stored press, ``--press-param``): JSON has no tuples, so a list
        given for a tuple field becomes one. A press with other encoded fields overrides this."""
        tuples = {f.name for f in fields(cls) if isinstance(f.default, tuple)}
        return {k: tuple(v) if k in tuples and isinstance(v, list) else v for k, v in params.items()}

    def hashed_params(self, given: dict) -> dict:
        """The parameters ``given`` for this press, as a run's hash sees them: ``unrotate`` resolved (its
        default changed since runs were stored), so a run that computes what a stored one computed keeps that
        run's hash."""
        return compat.stored({**given, "unrotate": self.unrotate})

    def to_json(self) -> str:
        return json.dumps({"press": self.name, **compat.stored(asdict(self))}, sort_keys=True)

    @staticmethod
    def from_json(text: str) -> "BasePress":
        params = json.loads(text)
        name = params.pop("press")
        return get_press(name, **compat.filled_in(params))


def get_press(name: str, **params) -> BasePress:
    """Build a press by its kvpress name; parameters the press does not take are rejected."""
    if name not in PRESSES:
        raise ValueError(f"unknown press {name!r}; allowed: {', '.join(PRESSES)}")
    cls = PRESSES[name]
    allowed = {f.name for f in fields(cls)}
    unknown = set(params) - allowed
    if unknown:
        raise TypeError(f"press {name!r} does not take {sorted(unknown)}; allowed: {sorted(allowed)}")
    return cls(**cls.parse_params(params))


def compared_methods() -> tuple[str, ...]:
    """The methods `nkv eval` and the suite compare by default, in report order."""
    return tuple(n for n, cls in PRESSES.items() if cls.compared)


@dataclass(frozen=True)
class NoPress(BasePress):
    """The uncompressed reference: never evicts anything."""

    name: ClassVar[str] = "no_press"
    rank: ClassVar[int] = 1000  # the reference lists after the methods

    def n_keep(self, n: int) -> Optional[int]:
        return None


def is_number(v) -> bool:
    """A finite int or float (NaN and infinities would reach the stored configuration and the scores)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def int_in(v, lo: int, hi: int) -> bool:
    """An int (not a bool) in ``lo..hi``: a press's own integer field, as ``__post_init__`` checks it."""
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def check(ok: bool, name: str, want: str, got, press: str) -> None:
    if not ok:
        raise ValueError(f"{press} parameter {name} must be {want}, got {got!r}")


def check_ints(press: BasePress, **least: int) -> None:
    """Each named field of ``press`` an int of at least its given value."""
    for field, lo in least.items():
        v = getattr(press, field)
        check(int_in(v, lo, INT32_MAX), field, f"an int >= {lo}", v, press.name)
