"""One document end to end: inputs, model loading, prompts, runner, evaluation, DuckDB store."""

from nestedkv._platform import load_openblas

load_openblas()
