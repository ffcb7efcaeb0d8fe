"""Whether a folder can take new files, asked before any work so that a bad path is one line, not a failure
per document. Nothing is created: a folder that does not exist yet is judged by its nearest existing parent.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Optional, Union


def writable_folder(folder: str, error: type[Exception] = ValueError) -> Path:
    """``folder`` with ``~`` expanded, or ``error`` saying why no file can be created in it. Creates nothing."""
    why = unwritable(folder)
    if why:
        raise error(f"{folder}: {why}")
    return Path(folder).expanduser()


def unwritable(folder: Union[str, Path]) -> Optional[str]:
    """Why no file can be created in ``folder`` (a file in the way, no permission, a read-only mount), or None."""
    probe = Path(folder).expanduser()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is not a folder"
    try:  # a real write: permission bits say nothing to root or on a read-only mount
        tempfile.TemporaryFile(dir=probe).close()
    except OSError as exc:
        return f"cannot write in {probe} ({exc.strerror or exc})"
    return None
