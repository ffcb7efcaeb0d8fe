"""One document end to end: inputs, model loading, prompts, runner, evaluation, DuckDB store."""
