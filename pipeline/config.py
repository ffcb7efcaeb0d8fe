"""Settings, declared once: what a press does, how text is generated, and the run configuration they make.

``PressSettings`` (which rows survive) and ``GenerationSettings`` (prompts, lengths, chunking) are the two
halves; ``RunConfig`` joins them with the task and the model and is what a stored run is. Its hash covers
every field and the press's full parameter set (defaults included), so a changed method constant makes a
re-run recompute instead of resuming. The CLI options and the flows' parameters are built from these models.
"""

from __future__ import annotations

import hashlib
import json
from datetime import date
from importlib import metadata
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

import nestedkv
from nestedkv.quant import FIELD_NAMES as QUANT_FIELDS, KVQuant, check_kv_bits
from nestedkv.run_defaults import COMPRESSION_RATIO
from pipeline import compat
from pipeline.compat import HASHED_WHEN_SET
from pipeline.sizes import parse_size
from pipeline.metrics import HOOKED_METRICS
from pipeline.paths import writable_folder

Task = Literal["summarize", "qa"]
Dtype = Literal["auto", "stored", "float32", "float16", "bfloat16"]
HeadBudget = Literal["uniform", "adaptive"]
PrefillMode = Literal["whole", "streaming"]
# How a document longer than the model's window is read (what each output row records as read_mode).
LongDocs = Literal["stream", "truncate", "map_reduce", "refuse"]

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_INPUT = "data/sample_batch.parquet"
DEFAULT_DB = "runs.duckdb"
EVAL_INPUT, EVAL_DB = "data/eval_set.parquet", "eval.duckdb"  # the bundled evaluation set; nkv eval's store
REFERENCE_PRESS = "no_press"
INT32_MAX = 2**31 - 1  # the store's INTEGER columns

CHAT_DATE = "2024-07-26"  # Llama 3.1's own default date_string: any fixed date keeps a document's tokens
SUMMARY_INSTRUCTION = "Summarize the document above in 3 sentences."
# Asking for a phrase copied from the document made SmolLM2-135M answer 7 of the 8 sample-batch
# questions without compression, against 5 of 8 for "answer in a few words".
QA_INSTRUCTION = "Question: {question}\nAnswer with a short phrase copied from the document."
# Greedy summaries from small models loop ("The game of chance is a game of chance..."); a mild
# penalty over the last 64 generated tokens stops that. QA stays plain greedy unless asked.
SUMMARY_REPETITION_PENALTY = 1.1
REPETITION_CONTEXT = 64  # tokens the repetition penalty looks back over
MAX_DOC_TOKENS = 2**20
CHARS_PER_TOKEN = 8  # twice prose's usual 3-5, so a document refused unread is over the limit in all likelihood

# The press fields a sweep varies; every other field must be shared, or one prefill could not serve them all.
PRESS_FIELDS = ("press", "compression_ratio", "budget", "head_budget", "prefill", "press_params", "kv_bits",
                "kv_group_size", "kv_hadamard")
KV_FIELDS = tuple(QUANT_FIELDS.values())


class _Settings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class PressSettings(_Settings):
    """Which context rows survive: the method, its budget, how heads share it, when it evicts."""

    press: str = Field("nestedkv", description="the method, a press of nestedkv's registry; no_press: the "
                       "uncompressed reference")
    compression_ratio: float = Field(COMPRESSION_RATIO, ge=0.0, lt=1.0,
                                     description="fraction of context KV entries removed")
    budget: Optional[int] = Field(None, ge=1, le=INT32_MAX,
                                  description="absolute tokens kept per KV head (wins over the ratio)")
    head_budget: Optional[HeadBudget] = Field(None, description="uniform, or adaptive (the heads of a layer "
                                              "compete); default: the press's own (adaptive for nestedkv, "
                                              "uniform for the others)")
    prefill: PrefillMode = Field("whole", description="whole: compress after the last chunk; streaming: evict "
                                 "while prefilling (bounded peak)")
    press_params: dict[str, Any] = Field(default_factory=dict,
                                         description="the method's own parameters, e.g. tau=0.5 (NestedKV)")
    kv_bits: Optional[int] = Field(None, description="quantize the kept KV rows to 4 or 8 bits after compression "
                                   "(mlx-lm's --kv-bits; 16 or none: the model's dtype)")
    kv_group_size: int = Field(KVQuant().group_size, description="values per quantization scale and bias, 32, 64 or 128 (mlx-lm's "
                               "--kv-group-size)")
    kv_hadamard: bool = Field(KVQuant().hadamard, description="store quantized keys rotated by a Hadamard matrix, so that no "
                              "group holds their outlier channels (false: mlx-lm's layout)")

    @model_validator(mode="after")
    def _unquantized_kv_defaults(self):
        # The quantization settings mean nothing without kv_bits: one unquantized configuration, not one per
        # value (validated first: a typo still fails). The model is frozen, hence __dict__.
        if self.kv_bits is None:
            self.__dict__.update({n: PressSettings.model_fields[n].default for n in KV_FIELDS})
        return self

    @model_validator(mode="before")
    @classmethod
    def _default_head_budget(cls, data):
        # None: the press's own default, declared once on the press (an unknown press fails below).
        if isinstance(data, dict) and data.get("head_budget") is None:
            press = nestedkv.PRESSES.get(data.get("press", cls.model_fields["press"].default))
            if press is not None:
                data = {**data, "head_budget": press.defaults()["head_budget"]}
        return data

    @field_validator("kv_group_size")
    @classmethod
    def _group_size(cls, v: int) -> int:
        check_kv_bits(None, v)  # with or without kv_bits: a typo should not pass silently
        return v

    @field_validator("press")
    @classmethod
    def _known_press(cls, v: str) -> str:
        if v not in nestedkv.PRESSES:
            raise ValueError(f"unknown press {v!r}; allowed: {', '.join(sorted(nestedkv.PRESSES))}")
        return v

    @model_validator(mode="after")
    def _press_accepts(self):
        own = sorted(set(self.press_params) & (set(PressSettings.model_fields) - {"press", "press_params"}))
        if own:  # passed on, the press would run one way while the stored run says another
            raise ValueError(f"{', '.join(own)} is an option of its own (--{own[0].replace('_', '-')}), "
                             "not a press parameter")
        if self.press == REFERENCE_PRESS and self.press_params:
            raise ValueError(f"no_press compresses nothing and takes no press parameters, got "
                             f"{', '.join(sorted(self.press_params))}")
        self.make_press()  # the press validates its own parameters (names and ranges)
        return self

    def make_press(self):
        """The nestedkv press these settings describe; ``ValueError`` names a bad parameter."""
        fields = nestedkv.PRESSES[self.press].defaults()
        kw = {n: getattr(self, n) for n in PRESS_FIELDS if n != "press_params" and n in fields}
        try:
            return nestedkv.get_press(self.press, **kw, **self.press_params)  # the press parses its JSON values
        except TypeError as exc:  # an unknown parameter name
            raise ValueError(str(exc)) from None

    @property
    def kv_quant(self) -> KVQuant:
        return KVQuant.from_fields(self)

    def press_key(self) -> dict:
        """The press's full parameter set, defaults included (what the hash must cover)."""
        return json.loads(self.make_press().to_json())


class GenerationSettings(_Settings):
    """How each document is prompted, chunked and answered."""

    max_new_tokens: int = Field(128, ge=1, le=INT32_MAX, description="tokens generated per answer at most")
    prefill_step_size: int = Field(512, ge=1, le=INT32_MAX, description="context tokens per prefill chunk")
    # map_reduce answered more needles past the window than stream on nkv bench long (docs/long-documents.md).
    long_docs: LongDocs = Field("map_reduce", description="a document longer than the model's window: map_reduce "
                                "(answer in each part, keep the answer of the part the question is likeliest "
                                "under; summarize the parts' summaries), stream (read it whole, evicting while "
                                "prefilling, its kept rows moved within the window), truncate (cut its middle) "
                                "or refuse (a too_long row)")
    # 2**20 tokens read in about 2 hours streamed on a 2-core CPU; the tokenizer's memory grows with the text
    # (7.5 GB for 50 MB), so a text is measured in characters before it is tokenized.
    max_doc_tokens: int = Field(MAX_DOC_TOKENS, ge=1, le=INT32_MAX, json_schema_extra=HASHED_WHEN_SET,
                                description="a longer document is refused (a too_long row) before it is read; "
                                f"one over {CHARS_PER_TOKEN} characters per token of it, before it is tokenized")
    summary_instruction: str = Field(SUMMARY_INSTRUCTION, description="the instruction after the document")
    qa_instruction: str = Field(QA_INSTRUCTION, description="the question template; must contain {question}")
    repetition_penalty: Optional[float] = Field(None, gt=0, description="default 1.1 for summaries, none for qa; "
                                                "1.0 disables")
    repetition_context_size: int = Field(REPETITION_CONTEXT, ge=1, le=INT32_MAX, json_schema_extra=HASHED_WHEN_SET,
                                         description="tokens (question and answer so far) the repetition penalty "
                                         "looks back over "
                                         "(mlx-lm's --repetition-context-size)")
    thinking: bool = Field(False, json_schema_extra=HASHED_WHEN_SET,
                           description="let a hybrid-thinking chat template (Qwen3) think before it answers "
                           "(its enable_thinking); off: it answers at once")
    chat_date: str = Field(CHAT_DATE, json_schema_extra=HASHED_WHEN_SET,
                           description="the date chat templates that stamp one (Llama 3.x) are given, YYYY-MM-DD, "
                           "so a document gives the same tokens every day")
    dtype: Dtype = Field("auto", json_schema_extra=HASHED_WHEN_SET,
                         description="the model's weights: auto (float32 on a CPU, as stored on Metal/GPU), stored "
                         "(quantized or half precision as saved: what a Mac runs), float32, float16, bfloat16")

    @field_validator("chat_date")
    @classmethod
    def _iso_date(cls, v: str) -> str:
        try:
            return date.fromisoformat(v).isoformat()
        except ValueError:
            raise ValueError(f"chat_date must be a date YYYY-MM-DD, got {v!r}") from None

    def template_args(self) -> dict:
        """What the chat template is rendered with (``pipeline.prompts``): thinking and the fixed date."""
        return {"thinking": self.thinking, "day": date.fromisoformat(self.chat_date)}

    def penalty(self) -> Optional[tuple[float, int]]:
        """(repetition penalty, tokens it looks back over), or None when off (mlx-lm's logits processor)."""
        p = self.repetition_penalty
        return (p, self.repetition_context_size) if p and p != 1.0 else None

    @field_validator("qa_instruction")
    @classmethod
    def _has_question_slot(cls, v: str) -> str:
        if "{question}" not in v:
            raise ValueError("qa_instruction must contain the placeholder {question}")
        return v


class RunConfig(GenerationSettings, PressSettings):
    """Everything that changes a document's output. Two runs with equal hashes are the same work."""

    task: Task = "summarize"
    model: str = DEFAULT_MODEL
    # What the outputs depend on of the model (pipeline.models.model_key: revision, dtype, device), filled in
    # when a batch is planned: changed weights, another dtype or device are other work, never "already done".
    model_key: Optional[str] = Field(None, json_schema_extra=HASHED_WHEN_SET)

    @model_validator(mode="before")
    @classmethod
    def _summary_penalty(cls, data):
        if isinstance(data, dict) and data.get("repetition_penalty") is None and data.get("task", "summarize") == "summarize":
            data = {**data, "repetition_penalty": SUMMARY_REPETITION_PENALTY}
        return data

    # The hash builds the press (its full parameter set), and plans ask for it per document: computed once.
    _hash: Optional[str] = PrivateAttr(None)

    def __hash__(self) -> int:  # press_params is a dict: hash what identifies the run
        return hash(self.config_hash())

    def __eq__(self, other) -> bool:  # the fields only, not the cached hash
        return type(other) is type(self) and self.__dict__ == other.__dict__

    def model_copy(self, *, update=None, deep: bool = False) -> "RunConfig":
        copy = super().model_copy(update=update, deep=deep)
        if update:
            copy._hash = None  # other fields, another hash
        return copy

    def canonical_json(self) -> str:
        dump = compat.hashed_settings(self)  # settings added since runs were stored hash as before
        dump["press_params"] = self.make_press().hashed_params(self.press_params)
        return json.dumps({**dump, "press_resolved": self.press_key()}, sort_keys=True, separators=(",", ":"))

    def config_hash(self) -> str:
        if self._hash is None:
            self._hash = hashlib.sha256(self.canonical_json().encode()).hexdigest()
        return self._hash

    @property
    def is_reference(self) -> bool:
        return self.press == REFERENCE_PRESS and not self.kv_quant.quantized

    def reference(self) -> "RunConfig":
        """The uncompressed twin of this configuration (what quality is measured against)."""
        return self.model_copy(update={"press": REFERENCE_PRESS, "compression_ratio": 0.0, "budget": None,
                                       "head_budget": "uniform", "prefill": "whole", "press_params": {},
                                       **{n: PressSettings.model_fields[n].default for n in KV_FIELDS}})

    def shared(self) -> dict:
        """The fields one prefill depends on (all but the press fields)."""
        return self.model_dump(exclude=set(PRESS_FIELDS))

    def label(self) -> str:
        size = f"budget {self.budget}" if self.budget else f"r={self.compression_ratio:g}"
        extra = "".join(f" {k}={v}" for k, v in sorted(self.press_params.items()))
        mode = " streaming" if self.prefill == "streaming" else ""
        quant = self.kv_quant.run_label()
        if self.press == REFERENCE_PRESS:
            return f"{self.press}{quant}"
        return f"{self.press} {size} {self.head_budget}{mode}{quant}{extra}"


class EngineSettings(_Settings):
    """How the engine works through a batch, beyond what each answer depends on."""

    batch_decode: bool = Field(False, description="decode the configurations of a document together")
    batch_size: int = Field(1, ge=1, le=4096, description="documents decoded together (each prefilled and "
                            "compressed on its own; same answers, one transaction per document)")
    prefill_cache: Optional[str] = Field(None, description="folder of reusable uncompressed prefills: a re-run "
                                         "with a new budget or method skips the prefill")
    prefill_cache_gb: float = Field(20.0, gt=0, allow_inf_nan=False, description="size cap of the prefill cache "
                                    "(least recently used entries go first)")
    memory_limit: Optional[str] = Field(None, description="the most a run may use for weights, KV and the "
                                        "prefill's working buffers (8GiB, 512MiB, 16GB): each document is read "
                                        "whole, streaming or in parts to fit it; default: 85% of the memory "
                                        "available when the batch starts (Metal's recommended working set)")
    on_oom: Literal["fail", "streaming"] = Field("fail", description="streaming: a document whose whole-context "
                                                 "prefill runs out of memory is redone evicting while prefilling")

    @field_validator("memory_limit")
    @classmethod
    def _memory_size(cls, v: Optional[str]) -> Optional[str]:
        if v is not None:
            parse_size(v)
        return v

    @field_validator("prefill_cache")
    @classmethod
    def _usable_folder(cls, v: Optional[str]) -> Optional[str]:
        if v is not None:
            writable_folder(v)
        return v


class EngineOptions(EngineSettings):
    """The engine's options: its settings, and what kind of batch it is. ``reference`` stores the no_press
    twin as its own run; ``evaluate`` scores each configuration against it (and implies it); ``metrics``
    names extra metric hooks (``pipeline.metrics.HOOKED_METRICS``)."""

    reference: bool = False
    evaluate: bool = False
    metrics: tuple[str, ...] = ()

    @field_validator("metrics")
    @classmethod
    def _known_metrics(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [m for m in v if m not in HOOKED_METRICS]
        if unknown:
            raise ValueError(f"unknown metrics {unknown}; known: {', '.join(HOOKED_METRICS)}")
        return v

    @property
    def with_reference(self) -> bool:
        return self.reference or self.evaluate


class BatchOptions(GenerationSettings, EngineSettings):
    """Generation and engine settings plus how a batch is retried and waits (the flows' ``options``)."""

    retries: int = Field(2, ge=0, le=100, description="task retries for transient errors (device memory, I/O)")
    retry_delay_s: float = Field(5.0, ge=0, allow_inf_nan=False, description="seconds between retries")
    wait: float = Field(0.0, ge=0, description="seconds to wait for another writer to release the store")

    def generation(self) -> dict:
        return self.model_dump(include=set(GenerationSettings.model_fields))

    def engine(self, **kind) -> EngineOptions:
        """The engine's options for this batch; ``kind``: reference, evaluate, metrics."""
        return EngineOptions(**self.model_dump(include=set(EngineSettings.model_fields)), **kind)


def parse_kv_bits(text: str) -> Optional[int]:
    """A ``--kv-bits`` value (one axis of a sweep): see ``KVQuant.parse_bits``."""
    return KVQuant.parse_bits(text)


def parse_press_param(text: str) -> tuple[str, Any]:
    """``name=value`` with a JSON value (``tau=0.5``, ``scales=[true,false,false]``) or a bare string."""
    name, sep, raw = text.partition("=")
    name = name.strip()
    if not sep or not name:
        raise ValueError(f"press parameter {text!r}: expected name=value")
    try:
        return name, json.loads(raw)
    except json.JSONDecodeError:
        return name, raw.strip()


def code_version() -> str:
    try:
        return metadata.version("nestedkv-pipeline")
    except metadata.PackageNotFoundError:
        return "0+unknown"
