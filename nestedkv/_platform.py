"""Platform setup that must run before the first ``import mlx``."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import sys
import warnings

_done = False


def load_openblas() -> bool:
    """On Linux, load the system OpenBLAS globally so mlx's CPU backend uses it.

    The ``mlx-cpu`` wheel ships a slow reference BLAS; with Debian's ``libopenblas0-pthread``
    loaded first, fp32 matmuls are about 40x faster. Returns True when OpenBLAS was loaded.
    Does nothing elsewhere (Metal on macOS needs no BLAS) or when ``NKV_NO_OPENBLAS=1``.
    """
    global _done
    if _done or platform.system() != "Linux" or os.environ.get("NKV_NO_OPENBLAS") == "1":
        return False
    _done = True
    if "mlx.core" in sys.modules:
        warnings.warn(
            "mlx was imported before nestedkv: the system OpenBLAS could not be loaded first; "
            "CPU matmuls may be slow. Import nestedkv (or pipeline) before mlx.",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    path = ctypes.util.find_library("openblas")
    if path is None:
        warnings.warn(
            "System OpenBLAS not found: mlx on CPU will use its slow reference BLAS. "
            "Fix: apt-get install libopenblas0-pthread",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    return True
