"""The BLAS in use and its fp32 GEMM speed, against the floor a working kernel reaches on this CPU
(``nkv bench kernels`` prints it first: a misdetected OpenBLAS kernel makes every other figure slow)."""

from __future__ import annotations

import platform
import time

import mlx.core as mx

from nestedkv._platform import AVX2, AVX512, blas_info, cpu_cores, read_cpuinfo

# Conservative fp32 GEMM per core that a working OpenBLAS kernel reaches. Measured on 2-core machines:
# AVX-512 Xeon and EPYC 190-240 GFLOP/s (about 100 per core); the generic kernel that a misdetected
# CPU gets, 36-39.
GFLOPS_PER_CORE = {"avx512": 50.0, "avx2": 25.0}


def gemm_gflops(n: int = 2048, repeats: int = 5) -> float:
    """Achieved fp32 GEMM GFLOP/s of an ``n x n`` matmul in mlx on the default device (best run)."""
    a = mx.random.normal((n, n), key=mx.random.key(1))
    b = mx.random.normal((n, n), key=mx.random.key(2))
    mx.eval(a, b)
    best = float("inf")
    for i in range(repeats + 1):
        t = time.perf_counter()
        mx.eval(a @ b)
        if i:  # the first run is a warm-up (thread pool, page faults)
            best = min(best, time.perf_counter() - t)
    return 2.0 * n**3 / best / 1e9


def expected_gflops(machine: str, flags: frozenset, cores: int) -> float | None:
    """Floor below which the CPU BLAS is misconfigured; None where there is no reference figure."""
    if machine not in ("x86_64", "AMD64"):
        return None
    if AVX512 <= flags:
        return GFLOPS_PER_CORE["avx512"] * cores
    if AVX2 <= flags:
        return GFLOPS_PER_CORE["avx2"] * cores
    return None


def gemm_warning(gflops: float, floor: float | None) -> str | None:
    if floor is None or gflops >= floor:
        return None
    return (
        f"WARNING: fp32 GEMM runs at {gflops:.0f} GFLOP/s, far below the >= {floor:.0f} this CPU should give. "
        "Check the BLAS line: the system OpenBLAS missing (apt-get install libopenblas0-pthread), a generic "
        "OpenBLAS kernel (set OPENBLAS_CORETYPE, e.g. SKYLAKEX on AVX-512), or other load on the machine."
    )


def bench_blas(n: int = 2048) -> dict:
    """The BLAS in use and its fp32 GEMM speed; ``warning`` is set when far below the CPU's floor."""
    out = {"gemm_n": n, "gemm_gflops": gemm_gflops(n), **blas_info(), "floor_gflops": None}
    if mx.default_device() == mx.cpu:
        cores = cpu_cores()
        out["cores"] = cores
        out["floor_gflops"] = expected_gflops(platform.machine(), read_cpuinfo().flags, cores)
    out["warning"] = gemm_warning(out["gemm_gflops"], out["floor_gflops"])
    return out
