"""An opt-in store of uncompressed prefilled caches on disk, so a re-run with a new budget or method costs
compression and decoding only.

An entry is keyed by everything its keys and values depend on: the model (its revision, dtype and device), the exact
context token ids (document, prompt template, truncation) and the prefill chunking. It holds the cache in
the model's dtype through mlx-lm's prompt-cache files, so answers from a loaded entry are identical to
answers from a fresh prefill. Entries are evicted least recently used beyond a size cap. An entry that
cannot be read or does not match is ignored with a warning and recomputed.

The folder may hold other files (a user can point it at any folder): the cache reads, counts and deletes
only files named like its own entries (``nkv-prefill-<sha256>.safetensors``), never any other file.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import re
import tempfile
from pathlib import Path
from typing import NamedTuple, Optional, Sequence

from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

import nestedkv.kvcache  # noqa: F401  names NestedKVCache to mlx-lm's loader, which finds classes by name
from pipeline import models
from pipeline.paths import writable_folder

log = logging.getLogger(__name__)
SUFFIX = ".safetensors"
PREFIX = "nkv-prefill-"
ENTRY = re.compile(rf"{re.escape(PREFIX)}[0-9a-f]{{64}}{re.escape(SUFFIX)}")
PARTIAL = ".nkv-prefill-partial"  # mlx appends .safetensors to any other name: partial files live here
FORMAT = 1  # bump when the entry layout changes


class PrefillCacheError(ValueError):
    """The folder or the size cap cannot be used (checked before any work)."""


def check_cap(max_gb: float) -> float:
    if not (isinstance(max_gb, (int, float)) and math.isfinite(max_gb) and max_gb > 0):
        raise PrefillCacheError(f"the size cap must be a positive finite number of GiB, got {max_gb!r}")
    return max_gb


def check_folder(folder: str) -> Path:
    """The cache folder, ``~`` expanded, or ``PrefillCacheError``: a path that is (or lies under) a file, or
    a folder (or its nearest existing parent) that cannot be written. Creates nothing."""
    return writable_folder(folder, PrefillCacheError)


class Entry(NamedTuple):
    cache: list
    prefill_s: Optional[float]  # the seconds computing it took, which a re-run's load does not show


class PrefillCache:
    """``get``/``put`` uncompressed caches under a folder, at most ``max_gb`` on disk."""

    def __init__(self, folder: str, max_gb: float = 20.0):
        self.folder = check_folder(folder)
        self.max_bytes = int(check_cap(max_gb) * 2**30)
        self.folder.mkdir(parents=True, exist_ok=True)

    def key(self, model_key: str, context_ids: Sequence[int], step: int) -> str:
        """An entry's key: the model (``pipeline.models.model_key``: revision, dtype, device), the context's
        token ids and the prefill chunking."""
        h = hashlib.sha256()
        h.update(json.dumps({"format": FORMAT, "model": model_key, "step": step}).encode())
        h.update(b"\0")
        h.update(",".join(map(str, context_ids)).encode())
        return h.hexdigest()

    def _path(self, key: str) -> Path:
        return self.folder / f"{PREFIX}{key}{SUFFIX}"

    def entries(self) -> list[Path]:
        """The cache's own entries in the folder (every other file is the user's)."""
        return [p for p in self.folder.iterdir() if ENTRY.fullmatch(p.name) and p.is_file()]

    def load(self, key: str, n_tokens: int) -> Optional[Entry]:
        """The entry stored under ``key``, or None (missing, unreadable, or not ``n_tokens`` positions)."""
        path = self._path(key)
        if not path.is_file():
            return None
        try:
            cache, meta = load_prompt_cache(str(path), return_metadata=True)
            if meta.get("key") != key or any(getattr(c, "offset", n_tokens) != n_tokens or getattr(c, "compressed", False) for c in cache):
                raise ValueError("entry does not match its key")
            seconds = float(meta["prefill_s"]) if "prefill_s" in meta else None  # None: stored before it was kept
        except Exception as exc:  # a damaged or foreign file costs a prefill, never the document
            log.warning("prefill cache entry %s ignored (%s: %s); prefilling again", path.name, type(exc).__name__, exc)
            path.unlink(missing_ok=True)
            return None
        os.utime(path)  # recently used
        return Entry(cache, seconds if seconds is not None and math.isfinite(seconds) else None)

    def get(self, key: str, n_tokens: int) -> Optional[list]:
        entry = self.load(key, n_tokens)
        return None if entry is None else entry.cache

    def put(self, key: str, cache: list, prefill_s: Optional[float] = None) -> None:
        """Store ``cache`` and the seconds computing it took (written to a temporary file, then renamed:
        readers never see half a file)."""
        (self.folder / PARTIAL).mkdir(parents=True, exist_ok=True)  # the folder too, if removed since
        fd, tmp = tempfile.mkstemp(dir=self.folder / PARTIAL, suffix=SUFFIX)
        os.close(fd)
        meta = {"key": key} if prefill_s is None else {"key": key, "prefill_s": repr(float(prefill_s))}
        try:
            save_prompt_cache(tmp, cache, meta)
            os.replace(tmp, self._path(key))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self.evict()

    def evict(self) -> None:
        """Drop least recently used entries until the folder is within its cap."""
        sized = []
        for p in self.entries():
            try:
                st = p.stat()
            except FileNotFoundError:  # another process sharing the folder evicted it
                continue
            sized.append((st.st_mtime, st.st_size, p))
        total = sum(size for _, size, _ in sized)
        for _, size, p in sorted(sized):
            if total <= self.max_bytes:
                break
            total -= size
            p.unlink(missing_ok=True)


@functools.lru_cache(maxsize=8)
def open_cache(folder: str, max_gb: float) -> PrefillCache:
    """The process's one ``PrefillCache`` per folder and cap: the folder is checked, and each model's files
    looked at, once per batch rather than once per document."""
    return PrefillCache(folder, max_gb)
