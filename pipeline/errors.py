"""Errors of model references, apart from ``pipeline.models`` (which loads mlx-lm) so that commands that only
report them need not load it."""


class ModelLoadError(ValueError):
    """A model reference could not be resolved, fetched, converted or loaded."""
