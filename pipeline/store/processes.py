"""Whether the process that recorded a run still runs it: a run records its host, pid and the pid's start
time, so a writer can mark this host's ``running`` runs whose process is gone ``interrupted``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

try:
    import psutil
except ImportError:  # optional, no dependency brings it: Linux's /proc instead (process_started_at)
    psutil = None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    except OSError:
        return False
    return True


def process_started_at(pid: int) -> Optional[float]:
    """When process ``pid`` started (epoch seconds), or None when it does not exist or cannot be told.

    Tells a reused pid from the process that recorded it: psutil where installed, else Linux's /proc.
    """
    if psutil is not None:
        try:
            return psutil.Process(pid).create_time()
        except Exception:  # NoSuchProcess, AccessDenied, ...
            return None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime; the name may hold spaces
        btime = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                     if line.startswith("btime "))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def process_is_the_run(pid: Optional[int], started_at: Optional[float]) -> bool:
    """Whether the process that started a run may still be running it."""
    if pid is None or not _pid_alive(pid):
        return False
    now = process_started_at(pid)
    # Start times are read at clock-tick and boot-time (whole second) resolution.
    return started_at is None or now is None or abs(now - started_at) < 2.0
