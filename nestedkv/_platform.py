"""The CPU fast path (``enable_cpu_fast_path``): nothing here runs at import, and nothing here imports mlx,
so that the opt-in can run before mlx loads."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import sys
import warnings
from dataclasses import dataclass
from typing import Mapping, Optional

CORETYPE_ENV = "OPENBLAS_CORETYPE"
# OpenBLAS's idle worker threads spin (sched_yield) for 2**28 cycles after every call, taking a core from
# mlx's stream threads between matmuls; at its minimum, 2**4, they sleep at once (prefill of 1,500 tokens
# with SmolLM2 on 2 cores: 5.8 -> 5.3 s, system time 3.2 -> 0.5 s). A user's own setting wins.
THREAD_TIMEOUT_ENV, THREAD_TIMEOUT = "OPENBLAS_THREAD_TIMEOUT", "4"
# What OpenBLAS's SKYLAKEX kernels execute; Xeon Phi has avx512f without bw/dq/vl.
AVX512 = frozenset({"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"})
AVX2 = frozenset({"avx2", "fma"})
ZEN5_FAMILY = 0x1A  # Debian's OpenBLAS 0.3.21 knows AMD families up to 0x19 (Zen 3/4)

_done = False
_state: dict = {"library": None, "coretype_set": None, "thread_timeout_set": None, "malloc": None,
                "fast_path": False, "missing_openblas": False}

# glibc malloc settings for mlx's CPU backend, which has no buffer cache: with glibc's default, buffers of a
# few MiB and more are mapped afresh (the threshold moves with the history of frees) and cost a page fault
# per 4 KiB each time. Fixed: every buffer under 32 MiB (glibc's largest threshold) comes from the heap,
# and up to 1 GiB freed at its top is kept for the next buffers instead of being returned at once.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MALLOC_SETTINGS = {M_MMAP_THRESHOLD: 32 * 2**20, M_TRIM_THRESHOLD: 2**30}
MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_MAX_", "MALLOC_TOP_PAD_")


@dataclass(frozen=True)
class CpuInfo:
    """The parts of /proc/cpuinfo that decide the OpenBLAS kernel."""

    vendor: str = ""  # GenuineIntel, AuthenticAMD, HygonGenuine, ...
    family: Optional[int] = None
    flags: frozenset = frozenset()


def parse_cpuinfo(text: str) -> CpuInfo:
    """The first processor's vendor, family and flags from /proc/cpuinfo text (x86 layout)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # end of the first processor's block
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    family = fields.get("cpu family", "")
    return CpuInfo(
        vendor=fields.get("vendor_id", ""),
        family=int(family) if family.isdigit() else None,
        flags=frozenset(fields.get("flags", "").split()),
    )


def read_cpuinfo(path: str = "/proc/cpuinfo") -> CpuInfo:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return parse_cpuinfo(f.read())
    except OSError:
        return CpuInfo()


def openblas_coretype(cpu: CpuInfo, env: Mapping[str, str]) -> Optional[str]:
    """The ``OPENBLAS_CORETYPE`` to set before loading Debian's OpenBLAS 0.3.21, or None to
    leave its own detection alone.

    0.3.21 does not know recent CPUs (Sapphire Rapids and later Intel, AMD Zen 5) and falls
    back to a generic kernel, about 6x slower. Only kernel names 0.3.21 has are returned (an
    unknown name also means the generic kernel), and only ones whose fp32 GEMM is the best that
    version has for the CPU: SKYLAKEX for full AVX-512, HASWELL/ZEN for AVX2.
    A user's own ``OPENBLAS_CORETYPE`` always wins.
    """
    if CORETYPE_ENV in env:
        return None
    avx512 = AVX512 <= cpu.flags
    avx2 = AVX2 <= cpu.flags
    if cpu.vendor == "GenuineIntel":
        if avx512:
            return "SKYLAKEX"
        return "HASWELL" if avx2 else None
    if cpu.vendor in ("AuthenticAMD", "HygonGenuine"):
        # Zen 1-4 are detected natively (measured: Zen 4 EPYC -> Cooperlake, same GEMM speed
        # as a forced SKYLAKEX); newer families are not.
        if cpu.family is None or cpu.family < ZEN5_FAMILY:
            return None
        if avx512:
            return "SKYLAKEX"
        return "ZEN" if avx2 else None
    return None


def cpu_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def enable_cpu_fast_path() -> dict:
    """Opt this process in to nestedkv's CPU speed-ups; a no-op on the second call. Returns ``blas_info()``.

    On Linux: glibc malloc settings (``tune_malloc``) and the system OpenBLAS for mlx's CPU backend
    (``load_openblas``). Everywhere: the CPU replacements of attention's softmax and of SwiGLU (exp as a power
    of 2, within 1e-6 of mlx's) in the models that ``nestedkv.make_cache`` routes; they check the device per
    call, so Metal and CUDA run mlx's own functions.

    Call it before anything imports ``mlx.core``: mlx binds its BLAS functions when it loads (Python opens
    extensions with RTLD_NOW), so an OpenBLAS loaded later is never called. ``import nestedkv`` does not
    import mlx. Importing ``flows`` (the ``nkv`` CLI, a flow run) calls it, as the tests do; a library user
    opts in the same way.
    """
    if not _state["fast_path"]:
        _state["fast_path"] = True
        if platform.system() == "Linux":
            tune_malloc(os.environ)
            load_openblas()
    return blas_info()


MISSING_OPENBLAS = ("System OpenBLAS not found: mlx on CPU will use its slow reference BLAS. "
                    "Fix: apt-get install libopenblas0-pthread")


def missing_openblas() -> bool:
    """Whether ``enable_cpu_fast_path`` looked for the system OpenBLAS and found none (what a CPU run then
    loses is worth saying where a model runs, not on every command)."""
    return _state["missing_openblas"]


def fast_path_enabled() -> bool:
    return _state["fast_path"]


def load_openblas() -> bool:
    """On Linux, load the system OpenBLAS globally so mlx's CPU backend uses it (part of
    ``enable_cpu_fast_path``).

    The ``mlx-cpu`` wheel ships a slow reference BLAS; with Debian's ``libopenblas0-pthread``
    loaded first, fp32 matmuls are about 40x faster. On x86_64 the OpenBLAS kernel is chosen
    from the CPU's flags when that OpenBLAS would misdetect it (``openblas_coretype``); the
    variable is set only while the library loads. Returns True when OpenBLAS was loaded.
    Loads nothing elsewhere (Metal on macOS needs no BLAS) or when ``NKV_NO_OPENBLAS=1``.
    """
    global _done
    if _done or platform.system() != "Linux":
        return False
    _done = True
    if os.environ.get("NKV_NO_OPENBLAS") == "1":
        return False
    if "mlx.core" in sys.modules:
        warnings.warn(
            "mlx was imported before nestedkv.enable_cpu_fast_path(): mlx has bound its reference BLAS, so the "
            "system OpenBLAS cannot take its place and CPU matmuls stay slow. Call it before importing mlx.",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    path = ctypes.util.find_library("openblas")
    if path is None:
        _state["missing_openblas"] = True
        warnings.warn(MISSING_OPENBLAS, RuntimeWarning, stacklevel=3)
        return False
    coretype = None
    if platform.machine() in ("x86_64", "AMD64"):
        coretype = openblas_coretype(read_cpuinfo(), os.environ)
    load_env = openblas_load_env(coretype, os.environ)
    # OpenBLAS reads these once, while it loads; unset them afterwards so that child processes and
    # other BLAS libraries (numpy's own) decide for themselves.
    os.environ.update(load_env)
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    finally:
        for key in load_env:
            del os.environ[key]
    _state.update(library=path, coretype_set=coretype, thread_timeout_set=load_env.get(THREAD_TIMEOUT_ENV))
    return True


def openblas_load_env(coretype: Optional[str], env: Mapping[str, str]) -> dict:
    """The variables to set while OpenBLAS loads: the chosen kernel, and a short spin of idle threads
    unless the user set their own."""
    out = {} if coretype is None else {CORETYPE_ENV: coretype}
    if THREAD_TIMEOUT_ENV not in env:
        out[THREAD_TIMEOUT_ENV] = THREAD_TIMEOUT
    return out


def tune_malloc(env: Mapping[str, str]) -> Optional[dict]:
    """Apply ``MALLOC_SETTINGS`` with glibc's ``mallopt`` unless the user set any ``MALLOC_*_`` variable;
    returns what was set (None: not glibc, or left to the user)."""
    if any(k in env for k in MALLOC_ENV):
        return None
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = {param: value for param, value in MALLOC_SETTINGS.items() if mallopt(param, value) == 1}
    _state["malloc"] = done or None
    return _state["malloc"]


def blas_info() -> dict:
    """Which BLAS mlx's CPU backend uses: ``library``, ``corename`` (the OpenBLAS kernel in use),
    ``config``, ``coretype_set`` (what ``load_openblas`` chose; None = OpenBLAS's own detection
    or the user's ``OPENBLAS_CORETYPE``) and ``coretype_env`` (the user's variable)."""
    info = {
        "library": _state["library"],
        "corename": None,
        "config": None,
        "coretype_set": _state["coretype_set"],
        "coretype_env": os.environ.get(CORETYPE_ENV),
        "thread_timeout_set": _state["thread_timeout_set"],
    }
    if platform.system() == "Darwin":
        info["library"] = "Accelerate"
        return info
    if info["library"] is None:
        info["library"] = "mlx's bundled reference BLAS"
        return info
    lib = ctypes.CDLL(info["library"])
    for key, fn in (("corename", "openblas_get_corename"), ("config", "openblas_get_config")):
        f = getattr(lib, fn, None)
        if f is not None:
            f.restype = ctypes.c_char_p
            info[key] = f().decode(errors="replace").strip()
    return info
