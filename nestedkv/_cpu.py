"""CPU streams: mlx runs each CPU stream's element-wise work on one thread, so work spread over streams uses
more cores (matmuls already use every core through BLAS)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx

from nestedkv._platform import cpu_cores, fast_path_enabled

MAX_STREAMS = 4
# fp32 intermediates worked on at once: mlx's CPU backend has no buffer cache and glibc maps every buffer of
# 32 MiB or more afresh, so each such buffer costs a page fault per 4 KiB.
CHUNK_BYTES = 16 * 2**20
_STREAMS: list = []
_POOL: list = []


def pool() -> ThreadPoolExecutor:
    """Threads for NumPy work over the cores (created once per process, on first use)."""
    if not _POOL:
        _POOL.append(ThreadPoolExecutor(MAX_STREAMS, thread_name_prefix="nkv-cpu"))
    return _POOL[0]


def stream(i: int) -> mx.Stream:
    """The i-th extra CPU stream (created once per process)."""
    while len(_STREAMS) <= i:
        _STREAMS.append(mx.new_stream(mx.cpu))
    return _STREAMS[i]


def on_cpu() -> bool:
    return mx.default_device() == mx.cpu


def fast() -> bool:
    """Whether the CPU replacements of attention's softmax and SwiGLU apply here: opted in
    (``nestedkv.enable_cpu_fast_path``) and running on the CPU."""
    return fast_path_enabled() and on_cpu()


def streams_for(parts: int, cores: int | None = None) -> int:
    """How many CPU streams ``parts`` independent pieces of work spread over (``cores``: this process's)."""
    return max(1, min(parts, cpu_cores() if cores is None else cores, MAX_STREAMS))
