"""Benchmarks and the side-by-side kvpress comparison, one module per ``nkv bench`` command.

Above ``pipeline`` and below ``flows``: a benchmark may use anything a batch uses, and no batch needs a
benchmark. Modules load mlx only inside their functions, after ``nkv`` has enabled the CPU fast path.
"""
