"""Peak resident memory of the running process, measured the same way on both sides of ``nkv bench peer``.

Standard library only: ``bench/peer_worker.py`` imports it too, as a file beside it, in the peer environment.
"""

from __future__ import annotations

import resource
import sys


def peak_rss() -> int:
    """Peak resident bytes of this process. Linux: VmHWM, since ru_maxrss carries the forking parent's
    peak across exec (the worker would report at least the size of the benchmark that started it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    scale = 1 if sys.platform == "darwin" else 1024  # macOS reports bytes, Linux KiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
