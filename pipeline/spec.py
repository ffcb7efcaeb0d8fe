"""The batch spec: one model of a whole batch, built once (from the CLI, a flow's parameters or Python) and
passed whole to the flows, the engine, the suite and the benchmarks.

``BatchSpec`` holds what the batch reads and writes, the press grid (every press setting as a list of
values: each combination is one configuration), and ``BatchOptions`` (generation, engine and retry
settings). The grid's fields are made from ``PressSettings``, so a new press setting is a grid axis, a CLI
option and a flow parameter without another edit. The configurations are expanded once and cached.
"""

from __future__ import annotations

import typing
from itertools import product
from typing import Any, Iterable, Optional, Sequence

from pydantic import Field, PrivateAttr, create_model, field_validator

from pipeline.config import (DEFAULT_DB, DEFAULT_INPUT, DEFAULT_MODEL, KV_FIELDS, REFERENCE_PRESS, BatchOptions,
                             EngineOptions, PressSettings, RunConfig, Task, _Settings)

# Axes whose values combine; the sizes (a budget, or else a ratio) and the press's own parameters do not.
SIZE_FIELDS = ("compression_ratio", "budget")
FIXED_FIELDS = ("press_params",)


def _axis(name: str):
    """A press setting as a grid axis: a list of its values (a single value is a list of one)."""
    field = PressSettings.model_fields[name]
    default = field.get_default(call_default_factory=True)
    # A budget replaces the ratios only when given: no budget is an empty list, not [None].
    values = [] if name == "budget" else [default]
    return (list[field.annotation], Field(default_factory=lambda: list(values), description=field.description))


_GridBase = create_model(
    "_GridBase", __base__=_Settings,
    **{n: _axis(n) for n in PressSettings.model_fields if n not in FIXED_FIELDS},
    press_params=(dict[str, Any], Field(default_factory=dict,
                                        description=PressSettings.model_fields["press_params"].description)))


class PressGrid(_GridBase):
    """The press settings of a batch, each a list of values; every combination is one configuration."""

    @field_validator(*(n for n in PressSettings.model_fields if n not in FIXED_FIELDS), mode="before")
    @classmethod
    def _listed(cls, v, info):
        if v is None and info.field_name == "budget":
            return []  # no budget: the ratios
        return list(v) if isinstance(v, (list, tuple)) else [v]

    @field_validator("press_params", mode="before")
    @classmethod
    def _no_params(cls, v):
        return {} if v is None else v

    def configs(self, base: RunConfig) -> list[RunConfig]:
        """Every press x size x other axis (sizes: the budgets when given, else the ratios; head budget
        None: each press's default; kv bits None: the model's dtype); ``no_press`` once per KV width.
        Validation errors name the bad value."""
        sizes = [{"budget": int(b), "compression_ratio": 0.0} for b in self.budget] or [
            {"compression_ratio": float(r), "budget": None} for r in self.compression_ratio]
        if not sizes and any(p != REFERENCE_PRESS for p in self.press):
            raise ValueError("give at least one compression ratio or budget")
        axes = [n for n in PressGrid.model_fields if n not in ("press", *SIZE_FIELDS, *FIXED_FIELDS)]
        kv = [n for n in axes if n in KV_FIELDS]
        out = []
        for press in self.press:
            if press == REFERENCE_PRESS:
                if self.press_params:  # refused by the settings, not silently dropped by reference()
                    RunConfig.model_validate({**base.model_dump(), "press": press, "press_params": self.press_params})
                ref = base.reference().model_dump()
                out.extend(RunConfig.model_validate({**ref, **dict(zip(kv, combo))})
                           for combo in product(*(getattr(self, n) for n in kv)))
                continue
            for size, *combo in product(sizes, *(getattr(self, n) for n in axes)):
                # model_validate, not model_copy: the new press settings must be validated.
                out.append(RunConfig.model_validate({**base.model_dump(), "press": press, **size,
                                                     "press_params": self.press_params, **dict(zip(axes, combo))}))
        return check_configs(out)


class BatchSpec(PressGrid):
    """One batch: its input and store, the press grid, and every other setting. ``reference``,
    ``evaluate`` and ``metrics`` say what kind of batch it is (``EngineOptions``)."""

    input: str = Field(DEFAULT_INPUT, description="Parquet file, glob or folder")
    task: Task = Field("summarize", description="summarize or qa")
    model: str = Field(DEFAULT_MODEL, description="smollm2-135m, an mlx-lm directory, a .gguf file or a HF repo id")
    db: str = Field(DEFAULT_DB, description="DuckDB file, or a lake: ducklake:sqlite:PATH, ducklake:postgres:CONNINFO")
    options: BatchOptions = Field(default_factory=BatchOptions)
    reference: bool = Field(False, description="also store the uncompressed no_press run")
    evaluate: bool = Field(False, description="score each configuration against no_press")
    metrics: tuple[str, ...] = ()

    _configs: Optional[list[RunConfig]] = PrivateAttr(None)

    @field_validator("options", mode="before")
    @classmethod
    def _default_options(cls, v):
        return BatchOptions() if v is None else v

    def base(self) -> RunConfig:
        return RunConfig(task=self.task, model=self.model, **self.options.generation())

    def configs(self, base: Optional[RunConfig] = None) -> list[RunConfig]:
        """The configurations, expanded (and validated) once."""
        if base is not None:
            return super().configs(base)
        if self._configs is None:
            self._configs = super().configs(self.base())
        return list(self._configs)

    def config(self) -> RunConfig:
        """The one configuration of a single-configuration batch (a deployment, a fan-out)."""
        (cfg, *more) = self.configs()
        if more:
            raise ValueError(f"this batch has {1 + len(more)} configurations; give one value per press option")
        return cfg

    def engine_options(self) -> EngineOptions:
        return self.options.engine(reference=self.reference, evaluate=self.evaluate, metrics=self.metrics)

    @classmethod
    def of(cls, config: RunConfig, **spec) -> "BatchSpec":
        """The spec of one configuration (``spec``: input, db, options, ...)."""
        press = {n: getattr(config, n) for n in PressSettings.model_fields}
        return cls(task=config.task, model=config.model, **press, **spec)

    def press_values(self) -> dict:
        """The press settings of a one-configuration batch, one value each (a deployment's parameters)."""
        cfg = self.config()
        return {n: getattr(cfg, n) for n in PressSettings.model_fields}


def check_configs(configs: Iterable[RunConfig]) -> list[RunConfig]:
    """Deduplicated configurations; ``ValueError`` unless they differ only in their press settings."""
    out: list[RunConfig] = []
    for cfg in configs:
        if not isinstance(cfg, RunConfig):
            raise TypeError(f"configs must be RunConfig objects, got {type(cfg).__name__}")
        if cfg.is_reference:
            cfg = cfg.reference()  # one canonical reference whatever ratio or budget it was given
        if cfg not in out:
            out.append(cfg)
    if not out:
        raise ValueError("a batch needs at least one configuration")
    want = out[0].shared()
    for cfg in out[1:]:
        got = cfg.shared()
        diff = sorted(k for k in want if want[k] != got[k])
        if diff:
            detail = ", ".join(f"{k}={got[k]!r} (first: {want[k]!r})" for k in diff)
            raise ValueError(f"the configurations of one batch share one prefill per document, so they may "
                             f"differ only in their press settings; {cfg.label()} differs in {detail}")
    return out


def make_configs(base: RunConfig, presses: Sequence[str], compression_ratios: Sequence[float] = (),
                 budgets: Sequence[int] = (), head_budgets: Sequence[Optional[str]] = (None,),
                 prefills: Sequence[str] = ("whole",), press_params: Optional[dict] = None,
                 kv_bits: Sequence[Optional[int]] = (None,), kv_group_sizes: Sequence[int] = (64,)) -> list[RunConfig]:
    """``PressGrid.configs`` with the grid as arguments."""
    return PressGrid(press=presses, compression_ratio=compression_ratios, budget=budgets or (),
                     head_budget=head_budgets, prefill=prefills, press_params=press_params or {},
                     kv_bits=kv_bits or (None,), kv_group_size=kv_group_sizes or (64,)).configs(base)


def scalar_type(annotation) -> Any:
    """``Optional[int]`` -> int, a ``Literal`` -> str: the type one value of a setting is read as. A bool is
    read as the word (``bool("false")`` is True): the spec's validation parses it and names a bad one."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Literal or annotation is bool:
        return str
    if typing.get_origin(annotation) is typing.Union and len(args) == 1:
        return scalar_type(args[0])
    return annotation
