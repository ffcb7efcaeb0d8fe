"""Chat templates as the models ship them (tests/chat_templates: Qwen3, Llama 3.1 and 3.2, Gemma 3, Mistral, each
with its public source), in a tiny model's tokenizer config, through the runner's prompts: thinking off unless
asked, the date fixed so a document gives the same tokens every day, and a BOS token where the model expects one."""

import json
from datetime import datetime
from pathlib import Path

import pytest

from pipeline import models
from pipeline.config import RunConfig
from pipeline.documents import Document
from pipeline.prompts import build_prompt
from pipeline.runner import Runner
from tiny import BOS, save_tiny_model_dir, write_byte_tokenizer

TEMPLATES = Path(__file__).resolve().parent / "chat_templates"
DOC = Document(doc_id="d", text="The lamp was lit at nine. " * 8, questions=["When was the lamp lit?"])


def template(name: str) -> dict:
    t = json.loads((TEMPLATES / f"{name}.json").read_text())
    return {"chat_template": t["chat_template"], "bos_token": t["bos_token"], "eos_token": t["eos_token"]}


@pytest.fixture
def tokenizer_with(tmp_path):
    """Factory: a tiny model saved with these tokenizer_config.json entries, loaded (model, tokenizer)."""

    def make(adds_bos: bool = False, **config):
        path = save_tiny_model_dir(tmp_path / f"m{len(list(tmp_path.iterdir()))}")
        write_byte_tokenizer(path, adds_bos=adds_bos, **config)
        models.clear_loaded()
        return models.load_model(str(path))

    yield make
    models.clear_loaded()


def prepare(loaded, **config) -> tuple[list[int], list[int]]:
    """The context and the question's token ids the runner prefills and appends, for ``DOC``."""
    prepared = Runner(*loaded, RunConfig(task="qa", **config)).prepare(DOC, fit=False)
    return prepared.context_ids, prepared.questions[0][1]


@pytest.fixture
def today(monkeypatch):
    """Set the renderer's clock (transformers' ``strftime_now`` reads ``datetime.now``)."""
    import transformers.utils.chat_template_utils as ctu

    def set_day(day: datetime):
        class Clock(datetime):
            @classmethod
            def now(cls, tz=None):
                return day

        monkeypatch.setattr(ctu, "datetime", Clock)

    return set_day


@pytest.mark.parametrize("name", ["llama3_1", "llama3_2"])
def test_a_llama_template_gives_the_same_ids_on_two_dates(name, tokenizer_with, today):
    loaded = tokenizer_with(**template(name))
    today(datetime(2026, 12, 7))
    first = prepare(loaded)
    today(datetime(2027, 3, 1))
    assert prepare(loaded) == first
    assert prepare(loaded, chat_date="2025-01-31") != first  # the date is a setting, and it reaches the template
    # without the fixed date the template stamps today's (Llama 3.2) or its own default (3.1)
    rendered = loaded[1].apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                       add_generation_prompt=True)
    assert ("01 Mar 2027" in rendered) == (name == "llama3_2")


def test_qwen3_answers_without_thinking_unless_asked(tokenizer_with):
    loaded = tokenizer_with(**template("qwen3"))
    question = loaded[1].decode(prepare(loaded)[1])
    assert question.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # the empty thought: answer at once
    thinking = loaded[1].decode(prepare(loaded, thinking=True)[1])
    assert thinking.endswith("<|im_start|>assistant\n") and "<think>" not in thinking


@pytest.mark.parametrize("name, bos", [("gemma3", "<bos>"), ("mistral", "<s>"), ("llama3_1", "<|begin_of_text|>")])
def test_templates_that_hold_their_bos_keep_exactly_one(name, bos, tokenizer_with):
    loaded = tokenizer_with(**template(name))
    context = loaded[1].decode(prepare(loaded)[0])
    assert context.startswith(bos) and context.count(bos) == 1


def test_a_tokenizer_that_adds_a_bos_gets_one_without_a_template(tokenizer_with):
    assert prepare(tokenizer_with())[0][0] != BOS  # no BOS expected, none added
    ids = prepare(tokenizer_with(adds_bos=True))[0]
    assert ids[0] == BOS and BOS not in ids[1:]
    # and a template without one (Qwen3's) gets the model's BOS too
    ids = prepare(tokenizer_with(adds_bos=True, chat_template=template("qwen3")["chat_template"]))[0]
    assert ids[0] == BOS and BOS not in ids[1:]


def test_build_prompt_passes_the_date_to_strftime_now():
    class Tokenizer:
        chat_template = "x"
        bos_token = None

        def apply_chat_template(self, messages, **kw):
            return kw["strftime_now"]("%Y-%m-%d") + " " + messages[0]["content"]

    from datetime import date

    parts = build_prompt(Tokenizer(), "doc", "question", day=date(2024, 2, 29))
    assert parts.context.startswith("2024-02-29 doc")
