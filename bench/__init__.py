"""Benchmarks and the side-by-side kvpress comparison, one module per ``nkv bench`` command.

Above ``pipeline`` and below ``flows``: a benchmark may use anything a batch uses, and no batch needs a
benchmark. The process opted in to the CPU fast path when ``flows`` was imported (``flows/__init__.py``), so
modules import mlx at their top.
"""
