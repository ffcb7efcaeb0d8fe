"""OpenBLAS kernel choice (pure, no hardware needed) and what loading it does (in subprocesses)."""

import ctypes.util
import json
import logging
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from nestedkv import _platform as P
from bench import blas as gemm
from bench import kernels as bench

SPR = P.CpuInfo("GenuineIntel", 6, P.AVX512 | P.AVX2 | {"avx512_bf16", "amx_tile", "sse4_2"})
SKYLAKE_CLIENT = P.CpuInfo("GenuineIntel", 6, P.AVX2 | {"avx", "sse4_2"})
KNL = P.CpuInfo("GenuineIntel", 6, P.AVX2 | {"avx512f", "avx512cd", "avx512er"})  # no bw/dq/vl
ZEN3 = P.CpuInfo("AuthenticAMD", 25, P.AVX2)
ZEN4 = P.CpuInfo("AuthenticAMD", 25, P.AVX512 | P.AVX2 | {"avx512_bf16"})
ZEN5 = P.CpuInfo("AuthenticAMD", 26, P.AVX512 | P.AVX2 | {"avx512_bf16"})
ZEN5_NO512 = P.CpuInfo("AuthenticAMD", 26, P.AVX2)
OLD_INTEL = P.CpuInfo("GenuineIntel", 6, frozenset({"sse4_2", "avx"}))
UNKNOWN_FAMILY = P.CpuInfo("AuthenticAMD", None, P.AVX512 | P.AVX2)
VIA = P.CpuInfo("CentaurHauls", 6, P.AVX2)


@pytest.mark.parametrize(
    "cpu,expected",
    [
        (SPR, "SKYLAKEX"),
        (SKYLAKE_CLIENT, "HASWELL"),
        (KNL, "HASWELL"),
        (ZEN3, None),
        (ZEN4, None),
        (ZEN5, "SKYLAKEX"),
        (ZEN5_NO512, "ZEN"),
        (OLD_INTEL, None),
        (UNKNOWN_FAMILY, None),
        (VIA, None),
        (P.CpuInfo(), None),
    ],
    ids=["sapphire-rapids", "avx2-intel", "xeon-phi", "zen3", "zen4", "zen5", "zen5-no512", "old-intel",
         "amd-no-family", "via", "nothing-known"],
)
def test_coretype_follows_the_cpu(cpu, expected):
    assert P.openblas_coretype(cpu, {}) == expected


@pytest.mark.parametrize("value", ["HASWELL", "", "prescott"])
def test_users_coretype_always_wins(value):
    assert P.openblas_coretype(SPR, {"OPENBLAS_CORETYPE": value}) is None
    assert P.openblas_coretype(SPR, {"OTHER": "1"}) == "SKYLAKEX"


CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
flags\t\t: fpu sse avx2 fma avx512f avx512dq avx512cd avx512bw avx512vl avx512_bf16

processor\t: 1
vendor_id\t: GenuineIntel
cpu family\t: 6
flags\t\t: fpu
"""


def test_parse_cpuinfo_reads_the_first_processor():
    cpu = P.parse_cpuinfo(CPUINFO)
    assert cpu == P.CpuInfo("AuthenticAMD", 25, P.AVX512 | P.AVX2 | {"fpu", "sse", "avx512_bf16"})
    assert P.parse_cpuinfo("") == P.CpuInfo()
    assert P.parse_cpuinfo("vendor_id : X\ncpu family : ?\n").family is None


def test_read_cpuinfo_of_a_missing_file_is_empty(tmp_path):
    assert P.read_cpuinfo(str(tmp_path / "none")) == P.CpuInfo()


# -- loading, in a fresh interpreter (OpenBLAS reads the variable once, when it loads) -----------
needs_openblas = pytest.mark.skipif(
    platform.system() != "Linux" or platform.machine() != "x86_64" or ctypes.util.find_library("openblas") is None,
    reason="needs Linux x86_64 with a system OpenBLAS",
)

CHILD = """
import importlib.util, json, os, sys
spec = importlib.util.spec_from_file_location("nkv_platform", sys.argv[1])
m = importlib.util.module_from_spec(spec)
sys.modules["nkv_platform"] = m  # dataclasses look their module up
spec.loader.exec_module(m)
if sys.argv[2] == "spr":
    m.read_cpuinfo = lambda path="/proc/cpuinfo": m.CpuInfo("GenuineIntel", 6, m.AVX512 | m.AVX2)
loaded = m.load_openblas()
print(json.dumps({"loaded": loaded, "env_after": os.environ.get("OPENBLAS_CORETYPE"),
                  "timeout_after": os.environ.get("OPENBLAS_THREAD_TIMEOUT"), **m.blas_info()}))
"""


def _child(cpu: str, env: dict) -> dict:
    path = Path(P.__file__)
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), cpu], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@needs_openblas
def test_misdetected_cpu_gets_the_kernel_only_while_loading():
    env = {k: v for k, v in os.environ.items() if k != "NKV_NO_OPENBLAS"}
    got = _child("spr", env)
    assert got["loaded"]
    user = os.environ.get("OPENBLAS_CORETYPE")
    if user is None:
        assert got["coretype_set"] == "SKYLAKEX"
        assert got["env_after"] is None  # children and numpy's OpenBLAS decide for themselves
        if "DYNAMIC_ARCH" in (got["config"] or ""):
            assert got["corename"].upper() == "SKYLAKEX"
    else:  # this machine's own setting is left alone
        assert got["coretype_set"] is None and got["env_after"] == user


def test_idle_openblas_threads_sleep_unless_the_user_says_otherwise():
    assert P.openblas_load_env(None, {}) == {"OPENBLAS_THREAD_TIMEOUT": "4"}
    assert P.openblas_load_env("SKYLAKEX", {"OPENBLAS_THREAD_TIMEOUT": "28"}) == {"OPENBLAS_CORETYPE": "SKYLAKEX"}


@needs_openblas
def test_thread_timeout_is_set_only_while_loading():
    env = {k: v for k, v in os.environ.items() if k not in ("NKV_NO_OPENBLAS", "OPENBLAS_THREAD_TIMEOUT")}
    got = _child("spr", env)
    assert got["loaded"] and got["thread_timeout_set"] == "4" and got["timeout_after"] is None
    got = _child("spr", dict(env, OPENBLAS_THREAD_TIMEOUT="20"))
    assert got["thread_timeout_set"] is None and got["timeout_after"] == "20"


@needs_openblas
def test_users_variable_is_used_and_kept():
    env = {k: v for k, v in os.environ.items() if k != "NKV_NO_OPENBLAS"}
    env["OPENBLAS_CORETYPE"] = "Haswell"
    got = _child("spr", env)
    assert got["loaded"] and got["coretype_set"] is None and got["env_after"] == "Haswell"
    assert got["coretype_env"] == "Haswell"
    if "DYNAMIC_ARCH" in (got["config"] or ""):
        assert got["corename"] == "Haswell"


@needs_openblas
def test_opt_out_loads_nothing():
    env = dict(os.environ, NKV_NO_OPENBLAS="1")
    got = _child("spr", env)
    assert not got["loaded"] and got["coretype_set"] is None
    assert got["library"] == "mlx's bundled reference BLAS"


def _glibc() -> bool:
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def test_users_malloc_variables_win():
    assert P.tune_malloc({"MALLOC_TRIM_THRESHOLD_": "0"}) is None
    assert P.tune_malloc({"MALLOC_MMAP_MAX_": "0"}) is None


@pytest.mark.skipif(not _glibc(), reason="glibc's mallopt")
def test_malloc_keeps_buffers_under_32_mib_on_the_heap():
    want = {P.M_MMAP_THRESHOLD: 32 * 2**20, P.M_TRIM_THRESHOLD: 2**30}
    if not any(k in os.environ for k in P.MALLOC_ENV):
        assert P._state["malloc"] == want  # enable_cpu_fast_path (conftest) applied it
    assert P.tune_malloc({}) == want


# -- import changes nothing; the opt-in does (in fresh interpreters) ----------------------------------
PROBE = r"""
import ctypes, json, os, sys
env = dict(os.environ)
exec(sys.argv[1])
libc = ctypes.CDLL(None)


class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


libc.mallinfo2.restype, libc.malloc.restype, libc.malloc.argtypes = MallInfo2, ctypes.c_void_p, [ctypes.c_size_t]
before = libc.mallinfo2().hblks
libc.malloc(8 * 2**20)  # glibc maps 8 MiB afresh by default; the fast path's settings keep it on the heap
maps = open("/proc/self/maps").read().lower()
print(json.dumps({"env_same": dict(os.environ) == env, "mapped": libc.mallinfo2().hblks - before,
                  "mlx": "mlx.core" in sys.modules, "openblas": "openblas" in maps}))
"""


def _probe(code: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "NKV_NO_OPENBLAS"}
    out = subprocess.run([sys.executable, "-c", PROBE, code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not _glibc(), reason="glibc's mallinfo2")
def test_importing_the_packages_changes_nothing_in_the_process():
    nothing = _probe("pass")
    imported = _probe("import nestedkv, pipeline")
    assert imported == nothing == {"env_same": True, "mapped": 1, "mlx": False, "openblas": False}


@pytest.mark.skipif(not _glibc(), reason="glibc's mallinfo2")
def test_the_opt_in_sets_malloc_and_loads_openblas_and_restores_the_environment():
    got = _probe("import nestedkv; nestedkv.enable_cpu_fast_path(); nestedkv.enable_cpu_fast_path()")
    assert got["env_same"] and got["mapped"] == 0 and not got["mlx"]
    assert got["openblas"] == (ctypes.util.find_library("openblas") is not None)


@needs_openblas
def test_the_opt_in_after_mlx_says_it_is_too_late_for_the_blas():
    code = ("import warnings, json, mlx.core, nestedkv\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always'); info = nestedkv.enable_cpu_fast_path()\n"
            "print(json.dumps([info['library'], [str(x.message) for x in w]]))")
    env = {k: v for k, v in os.environ.items() if k != "NKV_NO_OPENBLAS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    library, warned = json.loads(out.stdout.strip().splitlines()[-1])
    assert library == "mlx's bundled reference BLAS" and "before importing mlx" in warned[0]


# Runs nkv as its entry point does, on a machine without the system OpenBLAS (find_library finds none).
WITHOUT_OPENBLAS = ("import ctypes.util, sys; ctypes.util.find_library = lambda name: None\n"
                    "from flows.cli import main; sys.argv = ['nkv', *sys.argv[1:]]; main()")


@pytest.mark.skipif(platform.system() != "Linux", reason="the system OpenBLAS is looked for on Linux only")
def test_without_openblas_a_refused_command_still_says_one_line(tmp_path):
    """The README's install leaves OpenBLAS optional: a machine without it gets no extra lines on commands that
    run no model (the CLI's one-line errors stay one line)."""
    env = {k: v for k, v in os.environ.items() if k != "NKV_NO_OPENBLAS"}
    out = subprocess.run([sys.executable, "-c", WITHOUT_OPENBLAS, "run", "--kv-bits", "3", "--db",
                          str(tmp_path / "x.duckdb")], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert [x for x in out.stderr.splitlines() if x.strip()] == [
        "error: invalid options: --kv-bits must be 4 or 8 (16 or none: no quantization), got '3'"], out.stderr


@pytest.mark.skipif(platform.system() != "Linux", reason="the system OpenBLAS is looked for on Linux only")
def test_without_openblas_loading_a_model_on_the_cpu_says_so_once(monkeypatch, caplog):
    import pipeline.models as models
    from nestedkv import _platform

    monkeypatch.setitem(_platform._state, "missing_openblas", True)
    monkeypatch.setitem(models._state, "warned_blas", False)
    with caplog.at_level(logging.WARNING, logger="pipeline.models"):
        models._warn_slow_blas()
        models._warn_slow_blas()
    said = [r.getMessage() for r in caplog.records if r.name == "pipeline.models"]
    assert len(said) == 1 and "apt-get install libopenblas0-pthread" in said[0], said
    monkeypatch.setitem(_platform._state, "missing_openblas", False)
    monkeypatch.setitem(models._state, "warned_blas", False)
    caplog.clear()
    models._warn_slow_blas()
    assert not [r for r in caplog.records if r.name == "pipeline.models"]


# -- bench -------------------------------------------------------------------------------------
def test_gemm_gflops_is_a_positive_rate():
    assert gemm.gemm_gflops(n=64, repeats=2) > 0


def test_expected_gflops_floor():
    assert gemm.expected_gflops("x86_64", SPR.flags, 2) == 100.0
    assert gemm.expected_gflops("x86_64", SKYLAKE_CLIENT.flags, 4) == 100.0
    assert gemm.expected_gflops("x86_64", OLD_INTEL.flags, 2) is None
    assert gemm.expected_gflops("arm64", SPR.flags, 2) is None


def test_gemm_warning_only_below_the_floor():
    assert gemm.gemm_warning(36.0, 100.0).startswith("WARNING: fp32 GEMM runs at 36 GFLOP/s")
    assert "OPENBLAS_CORETYPE" in gemm.gemm_warning(36.0, 100.0)
    assert gemm.gemm_warning(239.0, 100.0) is None
    assert gemm.gemm_warning(5.0, None) is None


def test_report_shows_the_blas_and_the_warning():
    blas = {
        "gemm_n": 2048, "gemm_gflops": 36.0, "library": "libopenblas.so.0", "corename": "Prescott",
        "config": "", "coretype_set": None, "coretype_env": None, "floor_gflops": 100.0,
        "warning": gemm.gemm_warning(36.0, 100.0),
    }
    out = {"device": "Device(cpu, 0)", "mlx": "x", "repeats": 1, "blas": blas,
           "scoring": [{"method": "keydiff", "n": 8, "seconds": 0.001}]}
    text = bench.report(out)
    assert "BLAS libopenblas.so.0  kernel Prescott (detected by OpenBLAS)" in text
    assert "36.0 GFLOP/s  (expected >= 100)" in text and "WARNING" in text
    blas.update(coretype_set="SKYLAKEX", corename="SkylakeX", gemm_gflops=239.0, warning=None)
    text = bench.report(out)
    assert "SkylakeX (OPENBLAS_CORETYPE=SKYLAKEX set by nestedkv)" in text and "WARNING" not in text
