"""What a suite runs: its options (documents, press grid, calibration, ablation, summaries), the files it
writes, and its result."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

import nestedkv
from pipeline import models
from pipeline.config import DEFAULT_MODEL, REFERENCE_PRESS, BatchOptions, EngineOptions, RunConfig
from pipeline.spec import PressGrid
from pipeline.suite.variants import VARIANTS, variant_configs
from pipeline.tasks import KNOWN, SIZES, TASKS, check_tasks, summary_documents


def nestedkv_variants() -> tuple[str, ...]:
    """NestedKV's per-scale variants, by name (the ablation's choices)."""
    return tuple(n for n, v in VARIANTS.items() if v[0] == "nestedkv")


def methods() -> tuple[str, ...]:
    """The methods a suite compares by default: the registry's (loaded on first use, not at import)."""
    return nestedkv.compared_methods()


def default_grid() -> PressGrid:
    """What a suite runs unless told: every compared method at three ratios, both budget modes, whole prefill."""
    return PressGrid(press=methods(), compression_ratio=SUITE_RATIOS, head_budget=["uniform", "adaptive"])


def default_options() -> BatchOptions:
    """The suite's generation and engine settings unless told: short answers, configurations decoded together."""
    return BatchOptions(max_new_tokens=32, batch_decode=True)


SUITE_RATIOS = (0.5, 0.75, 0.9)
HEADLINE_RATIOS = (0.75, 0.9)
LONG_FROM = 4096  # the headline, ablation and summaries use documents of this many tokens and more
SUITE_FILE, QUESTIONS_FILE = "suite.parquet", "questions.parquet"
METHODS_FILE, ABLATION_FILE, SUMMARY_FILE = "methods.parquet", "methods_ablation.parquet", "summaries.parquet"
CUT_FILE = "summaries_middle_cut.parquet"
MARKDOWN_NAME, PLOT_NAME, PREFILLS_DIR = "suite_report.md", "frontier.png", "prefills"


class SuiteOptions(BaseModel):
    """A suite's settings, declared once: ``nkv suite`` and ``nkv tasks`` generate their options from these
    fields."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    model: str = DEFAULT_MODEL  # the CLI's --model is the batch spec's option
    db: str = Field("suite.duckdb", description="DuckDB file")
    out: str = Field("reports/suite", description="folder for suite.parquet, suite_report.md, frontier.png")
    size: str = Field("standard", description="quick (1k, 1 per task), small (2k, 2), standard (2k/4k/8k, 2)")
    lengths: Optional[tuple[int, ...]] = Field(None, description="target context tokens, e.g. 2048,4096 "
                                               "(default: the size's)")
    per_task: Optional[int] = Field(None, description="documents per task and length (default: the size's)")
    tasks: tuple[str, ...] = Field(TASKS, description="a subset of the tasks",
                                   json_schema_extra={"choices": lambda: KNOWN})
    seed: int = Field(0, description="the documents' seed")
    # the press grid of the methods (streaming prefill runs each configuration's own prefill) and the
    # generation and engine settings: the same models as every batch command's
    grid: PressGrid = Field(default_factory=default_grid)
    options: BatchOptions = Field(default_factory=default_options)
    threshold: float = Field(0.6, description="least uncompressed accuracy for a task x length cell to enter "
                             "the headline")
    all_tasks: bool = Field(False, description="run the methods on the cells below the threshold too")
    austen: Optional[str] = Field(None, description="folder with the Austen .txt files")
    ablation: bool = Field(True, description="NestedKV's per-scale variants on the long documents, at the "
                           "headline ratios")
    variants: Optional[tuple[str, ...]] = Field(None, description="a subset of those variants (default: all)",
                                                json_schema_extra={"choices": nestedkv_variants})
    summaries: int = Field(0, ge=0, description="plain documents per long length whose compressed summaries "
                           "are compared with the uncompressed one")
    summary_tokens: int = Field(128, ge=1, description="tokens of a summary at most")
    long_from: int = Field(LONG_FROM, ge=1, description="documents of at least this many tokens make the "
                           "headline, the ablation and the summaries")
    summaries_only: bool = Field(False, description="only the summaries: no task documents, calibration or "
                                 "methods")

    @model_validator(mode="after")
    def _check(self):
        if self.size not in SIZES:
            raise ValueError(f"size must be one of {', '.join(SIZES)}, got {self.size!r}")
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {self.threshold!r}")
        check_tasks(self.tasks)
        if self.lengths is not None and (not self.lengths or any(int(n) < 256 for n in self.lengths)):
            raise ValueError(f"lengths: need at least one length of 256 tokens or more, got {self.lengths!r}")
        if self.per_task is not None and self.per_task < 1:
            raise ValueError(f"per_task must be >= 1, got {self.per_task!r}")
        if self.summaries_only and not self.summaries:
            raise ValueError("summaries_only needs summaries >= 1 (documents per length)")
        if REFERENCE_PRESS in self.grid.press:
            raise ValueError("press: no_press is the calibration reference and always runs; leave it out")
        if self.grid.budget:
            raise ValueError("budget: the suite compares ratios across lengths; give --compression-ratio")
        if self.variants is not None:
            unknown = [v for v in self.variants if v not in nestedkv_variants()]
            if unknown:
                raise ValueError(f"variants: unknown {unknown}; known: {', '.join(nestedkv_variants())}")
        return self

    @property
    def out_dir(self) -> Path:
        return Path(self.out)

    @property
    def presses(self) -> tuple[str, ...]:
        return tuple(self.grid.press)

    @property
    def ratios(self) -> tuple[float, ...]:
        return tuple(self.grid.compression_ratio)

    def base(self) -> RunConfig:
        return models.keyed(RunConfig(task="qa", model=self.model, **self.options.generation()))

    def summary_base(self) -> RunConfig:
        return models.keyed(RunConfig(task="summarize", model=self.model,
                                      **{**self.options.generation(), "max_new_tokens": self.summary_tokens}))

    def engine(self) -> EngineOptions:
        """Every stage scores against no_press; calibration and the methods share one prefill per document
        (the second pass loads the first's from OUT/prefills unless another cache folder is given)."""
        engine = self.options.engine(evaluate=True)
        return engine if engine.prefill_cache else engine.model_copy(
            update={"prefill_cache": str(self.out_dir / PREFILLS_DIR)})

    def ablation_configs(self) -> dict[RunConfig, str]:
        """NestedKV's variants (each scale alone, no gate, ...) at the headline ratios: config -> variant name."""
        if not self.ablation:
            return {}
        ratios = [r for r in HEADLINE_RATIOS if r in self.ratios] or list(self.ratios)
        names = list(nestedkv_variants()) if self.variants is None else \
            list(dict.fromkeys(["nestedkv", *self.variants]))  # the full method: what each variant is paired with
        got = variant_configs(self.base(), list(names), ratios)
        return {c: name for c, (name, _) in got.items() if not c.is_reference}

    def configs(self, base: Optional[RunConfig] = None) -> list[RunConfig]:
        """Every combination of the grid (questions; ``base``: another task's settings)."""
        if not self.grid.press:
            return []
        return self.grid.configs(base or self.base())

    def summary_documents(self, count) -> list[dict]:
        lengths = [n for n in (self.lengths or SIZES[self.size].lengths) if n >= self.long_from]
        if not self.summaries or not lengths:
            return []
        return summary_documents(count, lengths, self.summaries, self.seed,
                                 Path(self.austen) if self.austen else None, middle_cut=True)


@dataclass
class SuiteResult:
    suite_path: Path
    markdown_path: Path
    plot_path: Optional[Path]
    calibration: list[dict]
    headline: list[dict]
    stage_s: dict = field(default_factory=dict)  # wall seconds per stage
