"""What each full-attention cache of a model holds, learned by running the model, not from its attribute names.

mlx-lm's model types write their caches in many ways: the keys may carry a rope of any variant (partial,
NTK-alpha, YaRN, Llama 4, su-scaled, proportional), no rope at all (NoPE layers, MLA latents), or absolute
positions; the attention that reads them may call mlx-lm's ``scaled_dot_product_attention`` or compute its own
(soft caps). ``probe`` feeds a few tokens three times through caches that report different start positions
(all early in the window, where no model's rope or attention temperature changes with position) and compares
the keys each full-attention cache receives:

- keys equal at every start: they carry no position (scored as they are: ``NO_ROPE``);
- keys equal once each is rotated back by one of the ropes ``mx.fast.rope`` applied during the pass (the one
  whose output the cache received first): that rope (what unrotated scoring and moving rows to new positions
  use);
- otherwise: no rope nestedkv can undo (``None``): such a layer scores its keys as cached.

It also records which module wrote each cache, whether that layer reads per-head rows right (a pass where the
caches hand out their rows as adaptive head budgets store them, ``layouts.HeadRows``, must give the same logits:
its attention must be routed through ``nestedkv.attention`` and take the rows as they come), and whether any
other code read the cache's rows (layers that reuse another layer's keys: they read plain rows only). The facts
are kept on the model, computed once.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
from mlx_lm.models.cache import KVCache, create_attention_mask

from nestedkv.attention import install_attention_hook
from nestedkv.layer_kinds import FULL, is_cache_list, kind_of, leaves
from nestedkv.layouts import PerHead
from nestedkv.rope import from_description

NO_ROPE = {"dims": 0}  # keys without position: the inverse is the identity
PROBE_TOKENS = 8
STARTS = (0, 3, 37)  # the first position of each pass
TOLERANCE = 0.05  # relative difference of keys that are the same up to rounding (half precision, deep layers)
_ATTR, _OTHERS = "_nkv_facts", "_nkv_others"


@dataclass(frozen=True)
class LayerFacts:
    """One full-attention cache of a model (in ``leaves`` order)."""

    rope: Optional[dict]  # nestedkv.rope.describe form; NO_ROPE; None when no rope found undoes it
    routed: bool  # the layer reads per-head rows right (through nestedkv.attention)
    shared: bool  # code other than its writer read its rows (KV sharing across layers)
    writer: str  # that module's class name
    writer_path: str  # its path in the model ("model.layers.3.self_attn"), "" when not found
    n_kv_heads: int
    head_dim: int
    dtype: str
    row_bytes: int = 0  # one position's keys and values, all heads (what the layer holds per context token)

    @property
    def rope_reason(self) -> Optional[str]:
        """Why scoring unrotated keys cannot apply to this layer (None when it can)."""
        if self.rope is not None:
            return None
        return f"its keys ({self.writer}) carry positions that no rope found in the model undoes"


class _Probe(KVCache):
    """A cache whose first row sits at position ``start`` (what rope reads from ``offset``) and that holds only
    the rows it was given: it records the keys and the module that wrote them."""

    def __init__(self, start: int, ropes: "_RopeCalls"):  # noqa: super().__init__ would set offset first
        self._keys = self.values = None
        self.start, self.rows, self.writer, self.rope, self.ropes = start, 0, None, None, ropes
        self.readers: set[int] = set()
        self.split = False  # hand out its rows as a per-head layer does (layouts.HeadRows)

    def _read(self) -> None:
        reader = sys._getframe(2).f_locals.get("self")
        if reader is not self and reader is not self.writer:
            self.readers.add(id(reader))

    @property
    def keys(self):
        self._read()
        return self._keys

    @keys.setter
    def keys(self, value) -> None:
        self._keys = value

    def keys_and_values(self):
        self._read()
        return self._keys, self.values

    @property
    def state(self):
        self._read()
        return self._keys, self.values, self.offset

    @property
    def offset(self) -> int:
        return self.start + self.rows

    @offset.setter
    def offset(self, value: int) -> None:
        self.rows = value - self.start

    def update_and_fetch(self, keys, values):
        if self.writer is None:
            self.writer = sys._getframe(1).f_locals.get("self")
            self.rope = self.ropes.made(keys)
        if self._keys is None:
            self._keys, self.values = keys, values
        else:
            self._keys = mx.concatenate([self._keys, keys], axis=2)
            self.values = mx.concatenate([self.values, values], axis=2)
        self.rows += keys.shape[2]
        if self.split:  # as a per-head layer hands them out (every row appended: no context rows yet)
            B, H, n, _ = self._keys.shape
            flat = [x.reshape(B, 1, H * n, x.shape[3]) for x in (self._keys, self.values)]
            return PerHead(*flat, [0] * H, [n] * H).head_rows_of(n, 0)
        return self._keys, self.values

    def make_mask(self, N, return_array=False, window_size=None):
        return create_attention_mask(N, offset=self.rows, return_array=return_array, window_size=window_size)


def _probe_caches(model, start: int, ropes: "_RopeCalls") -> list:
    """The model's own cache list, each full-attention cache (in a ``CacheList`` too) a ``_Probe``."""
    caches = model.make_cache() if hasattr(model, "make_cache") else [KVCache() for _ in model.layers]
    for i, c in enumerate(caches):
        if is_cache_list(c):
            c.caches = tuple(_Probe(start, ropes) if kind_of(s, i) == FULL else s for s in c.caches)
        elif kind_of(c, i) == FULL:
            caches[i] = _Probe(start, ropes)
    return caches


class _RopeCalls:
    """Within the block, every distinct rope ``mx.fast.rope`` applies (as ``nestedkv.rope`` descriptions)."""

    def __init__(self):
        self.seen: dict[str, dict] = {}
        self.outputs: dict[int, tuple[mx.array, dict]] = {}  # id of an output -> (it, its rope)

    def made(self, x) -> Optional[dict]:
        """The rope whose output ``x`` is, if it is one."""
        hit = self.outputs.get(id(x))
        return hit[1] if hit is not None and hit[0] is x else None

    def __enter__(self):
        self.real = real = mx.fast.rope

        def recording(a, dims, *args, **kw):
            out = real(a, dims, *args, **kw)
            freqs = kw.get("freqs")
            d = {"dims": int(dims), "traditional": bool(kw.get("traditional", False))}
            if freqs is not None:
                d.update(freqs=[float(f) for f in mx.array(freqs).astype(mx.float32).tolist()],
                         scale=float(kw.get("scale", 1.0)))
            else:
                d.update(base=float(kw["base"]), scale=float(kw.get("scale", 1.0)))
            d = self.seen.setdefault(json.dumps(d, sort_keys=True), d)
            self.outputs[id(out)] = (out, d)
            return out

        mx.fast.rope = recording
        return self

    def __exit__(self, *exc):
        mx.fast.rope = self.real


def _bounded(c) -> tuple[int, Optional[int]]:
    """A cache kept as mlx-lm has it, after the probe's few tokens: (bytes per position, the most positions it
    keeps) for a sliding or chunked window, (its bytes, None) for a state of constant size."""
    keys, values = getattr(c, "keys", None), getattr(c, "values", None)
    if keys is None or values is None:  # a state (ArraysCache): constant
        return int(c.nbytes), None
    k, v = (x[0] if isinstance(x, (tuple, list)) else x for x in (keys, values))
    limit = getattr(c, "max_size", None) or getattr(c, "chunk_size", None)
    return int((k.nbytes + v.nbytes) // max(1, k.shape[2])), limit


def bounded_bytes(model, n: int, chunk: int) -> int:
    """What the caches NestedKV leaves to mlx-lm (sliding, chunked, state) hold for ``n`` context tokens read in
    chunks of ``chunk`` (a window holds its size plus the chunk being read)."""
    probe(model)
    return sum(size if limit is None else size * min(n, limit + chunk) for size, limit in vars(model)[_OTHERS])


def _rel(a: mx.array, b: mx.array) -> float:
    return float((mx.linalg.norm((a - b).reshape(-1)) / mx.maximum(mx.linalg.norm(b.reshape(-1)), 1e-12)).item())


def _keys(c) -> mx.array:
    k = c._keys[0] if isinstance(c._keys, (tuple, list)) else c._keys
    return k.astype(mx.float32)


def _paths(model) -> dict[int, str]:
    return {id(m): name for name, m in model.named_modules()}


def _rope_of(runs: list[tuple[int, mx.array]], candidates: list[dict]) -> Optional[dict]:
    (s0, k0), rest = runs[0], runs[1:]
    if all(_rel(k, k0) < TOLERANCE for _, k in rest):
        return NO_ROPE
    D = k0.shape[-1]
    placed = [d if d["dims"] == D or not at else {**d, "at": D - d["dims"]}
              for d in candidates if d["dims"] <= D for at in (False, True)]
    for d in placed:
        inv = from_description(d)
        base = inv(k0, s0)
        if all(_rel(inv(k, s), base) < TOLERANCE for s, k in rest):
            return d
    return None


def _per_head(model, tokens, reference: mx.array, n: int, ropes: "_RopeCalls") -> list[bool]:
    """Per full-attention cache, whether the model gives ``reference``'s logits when that cache hands out its
    rows per head: all at once first (the common answer), else one cache at a time."""

    def same(split: set[int]) -> bool:
        caches = _probe_caches(model, STARTS[0], ropes)
        for j, c in enumerate(c for c in leaves(caches) if isinstance(c, _Probe)):
            c.split = j in split
        try:
            logits = model(tokens, cache=caches)
            return _rel(logits.astype(mx.float32), reference.astype(mx.float32)) < TOLERANCE
        except Exception:  # a layer that handles its rows itself (casts, reshapes, its own softmax)
            return False

    if same(set(range(n))):
        return [True] * n
    return [same({j}) for j in range(n)]


def probe(model) -> list[LayerFacts]:
    """The facts of each full-attention cache of ``model`` (``leaves`` order), computed once per model.
    Raises ``ValueError`` (one line) when the model cannot run a few tokens on this device."""
    facts = vars(model).get(_ATTR)
    if facts is not None:
        return facts
    install_attention_hook(model, required=False)  # per-head rows need it
    tokens = mx.arange(1, PROBE_TOKENS + 1, dtype=mx.int32)[None]
    runs = []
    with _RopeCalls() as ropes:
        for start in STARTS:
            caches = _probe_caches(model, start, ropes)
            try:
                logits = model(tokens, cache=caches)
                mx.eval(logits)
            except Exception as exc:
                raise ValueError(f"{model_type(model)}: a forward pass of {PROBE_TOKENS} tokens failed on "
                                 f"{mx.default_device()} ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
                                 ) from exc
            runs.append((start, [c for c in leaves(caches) if isinstance(c, _Probe)]))
            if start == STARTS[0]:
                reference, others = logits, [c for c in leaves(caches) if not isinstance(c, _Probe)]
        per_head = _per_head(model, tokens, reference, len(runs[0][1]), ropes)
    paths = _paths(model)
    facts = []
    for j, first in enumerate(runs[0][1]):
        if first._keys is None:
            raise ValueError(f"{model_type(model)}: full-attention cache {j} received no keys in a forward pass; "
                             "its layers do not write their caches as mlx-lm's KVCache protocol has it")
        keys = [(s, _keys(r[j])) for s, r in runs]
        writer = first.writer
        k = first._keys[0] if isinstance(first._keys, (tuple, list)) else first._keys
        v = first.values[0] if isinstance(first.values, (tuple, list)) else first.values
        facts.append(LayerFacts(
            rope=_rope_of(keys, [d for d in [first.rope] if d] + list(ropes.seen.values())),
            routed=per_head[j],
            shared=bool(first.readers),
            writer=type(writer).__name__ if writer is not None else "unknown",
            writer_path=paths.get(id(writer), "") if writer is not None else "",
            n_kv_heads=int(k.shape[1]), head_dim=int(k.shape[-1]), dtype=str(k.dtype).removeprefix("mlx.core."),
            row_bytes=int((k.nbytes + v.nbytes) // k.shape[2])))
    object.__setattr__(model, _ATTR, facts)  # not a module attribute: stays out of its parameters
    object.__setattr__(model, _OTHERS, [_bounded(c) for c in others])
    return facts


WINDOW_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx",
               "max_seq_len", "model_max_length")


def _settings(model) -> list:
    """The model's argument objects and dicts, the text model's first: a wrapper (Gemma 3, Mistral 3,
    Qwen3.5, Llama 4) keeps its language model's settings in ``text_config`` or on its ``language_model``."""
    out = []
    for owner in (getattr(model, "language_model", None), getattr(model, "model", None), model):
        args = getattr(owner, "args", None) if owner is not None else None
        if args is None:
            continue
        text = args.get("text_config") if isinstance(args, dict) else getattr(args, "text_config", None)
        out += [a for a in (text, args) if a is not None]
    return out


def setting(model, *names):
    """The first of ``names`` that the model's settings (``_settings``) hold, or None."""
    for args in _settings(model):
        for name in names:
            v = args.get(name) if isinstance(args, dict) else getattr(args, name, None)
            if v is not None:
                return v
    return None


def model_window(model) -> Optional[int]:
    """The context window the model was trained for (its text model's, for a wrapper), or None."""
    v = setting(model, *WINDOW_KEYS)
    return int(v) if isinstance(v, (int, float)) and v > 0 else None


def model_type(model) -> str:
    """The model's mlx-lm type for messages ("model type gemma2"), or its module's name."""
    kind = setting(model, "model_type")
    return f"model type {kind}" if kind else type(model).__module__


def aligned_lists(model, facts: list[LayerFacts]) -> list[int]:
    """Layers whose ``CacheList`` holds full-attention caches written within one module (an indexer over its
    attention's keys, as in sparse attention): evicting rows from one would misalign the other."""
    caches = model.make_cache() if hasattr(model, "make_cache") else []
    out, j = [], 0
    for i, c in enumerate(caches):
        subs = [s for s in leaves([c]) if kind_of(s, i) == FULL]
        paths = [facts[j + n].writer_path for n in range(len(subs))]
        j += len(subs)
        if is_cache_list(c) and any(_within(a, b) or _within(b, a) for n, a in enumerate(paths)
                                    for b in paths[n + 1:]):
            out.append(i)
    return out


def _within(outer: str, inner: str) -> bool:
    return bool(outer) and (inner == outer or inner.startswith(outer + "."))
