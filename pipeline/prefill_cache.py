"""An opt-in store of uncompressed prefilled caches on disk, so a re-run with a new budget or method costs
compression and decoding only.

An entry is keyed by everything its keys and values depend on: the model (its weights on disk), the exact
context token ids (document, prompt template, truncation) and the prefill chunking. It holds the cache in
the model's dtype through mlx-lm's prompt-cache files, so answers from a loaded entry are identical to
answers from a fresh prefill. Entries are evicted least recently used beyond a size cap. An entry that
cannot be read or does not match is ignored with a warning and recomputed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Optional, Sequence

log = logging.getLogger(__name__)
SUFFIX = ".safetensors"
FORMAT = 1  # bump when the entry layout changes


def model_identity(model_ref: str) -> str:
    """The model's weights on disk: the resolved directory and the size and mtime of its files."""
    from pipeline.models import model_dir

    path = Path(model_dir(model_ref))
    if not path.is_dir():  # a repo id: its name is all we know without downloading
        return str(model_ref)
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in (".safetensors", ".json"))
    return json.dumps([str(path.resolve())] + [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files])


class PrefillCache:
    """``get``/``put`` uncompressed caches under a folder, at most ``max_gb`` on disk."""

    def __init__(self, folder: str, max_gb: float = 20.0):
        self.folder = Path(folder).expanduser()
        self.max_bytes = int(max_gb * 2**30)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._models: dict[str, str] = {}

    def key(self, model_ref: str, context_ids: Sequence[int], step: int) -> str:
        if model_ref not in self._models:
            self._models[model_ref] = model_identity(model_ref)
        h = hashlib.sha256()
        h.update(json.dumps({"format": FORMAT, "model": self._models[model_ref], "step": step}).encode())
        h.update(b"\0")
        h.update(",".join(map(str, context_ids)).encode())
        return h.hexdigest()

    def _path(self, key: str) -> Path:
        return self.folder / f"{key}{SUFFIX}"

    def get(self, key: str, n_tokens: int) -> Optional[list]:
        """The cache stored under ``key``, or None (missing, unreadable, or not ``n_tokens`` positions)."""
        from mlx_lm.models.cache import load_prompt_cache

        path = self._path(key)
        if not path.is_file():
            return None
        try:
            cache, meta = load_prompt_cache(str(path), return_metadata=True)
            if meta.get("key") != key or any(c.offset != n_tokens or c.compressed for c in cache):
                raise ValueError("entry does not match its key")
        except Exception as exc:  # a damaged or foreign file costs a prefill, never the document
            log.warning("prefill cache entry %s ignored (%s: %s); prefilling again", path.name, type(exc).__name__, exc)
            path.unlink(missing_ok=True)
            return None
        os.utime(path)  # recently used
        return cache

    def put(self, key: str, cache: list) -> None:
        """Store ``cache`` (written to a temporary file, then renamed: readers never see half a file)."""
        from mlx_lm.models.cache import save_prompt_cache

        # mlx appends .safetensors to any other name, so the partial file lives in a folder of its own.
        (self.folder / "partial").mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.folder / "partial", suffix=SUFFIX)
        os.close(fd)
        try:
            save_prompt_cache(tmp, cache, {"key": key})
            os.replace(tmp, self._path(key))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self.evict()

    def evict(self) -> None:
        """Drop least recently used entries until the folder is within its cap."""
        entries = sorted(self.folder.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime)
        total = sum(p.stat().st_size for p in entries)
        for p in entries:
            if total <= self.max_bytes:
                break
            total -= p.stat().st_size
            p.unlink(missing_ok=True)
