"""Chat-template prompts, split into the compressed context and the question that follows it.

kvpress protocol: the context is prefilled and compressed on its own, then the question is
appended uncompressed, so the question can never be evicted and one compressed context
answers every question of a document.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, datetime, time
from typing import Optional

from nestedkv.probe import Instruction
from pipeline.config import CHAT_DATE

# KVzip's reconstruction instructions (the paper's wording). The context ends with a blank line (build_prompt).
REPEAT_FIRST = "Repeat the previous context exactly."
REPEAT_RESUME = "Repeat the part of the previous context exactly, starting with"
# A marker no document contains; the rendered template is cut there.
_SPLIT = "\u241eNKV-QUESTION\u241e"


@dataclass(frozen=True)
class PromptParts:
    context: str  # everything up to the end of the document: prefilled then compressed
    question: str  # the instruction/question and the assistant header: appended after compression


def question_text(config, question: str | None) -> str:
    """The text appended after the compressed context, from the run's instruction templates."""
    if config.task == "summarize":
        return config.summary_instruction
    if not question:
        raise ValueError("a qa prompt needs a question")
    return config.qa_instruction.replace("{question}", question)


def split_marker(*texts: str) -> str:
    """The cut marker, lengthened until none of ``texts`` holds it: a document quoting it must not move
    its own tail into the uncompressed question."""
    marker = _SPLIT
    while any(marker in t for t in texts):
        marker += "\u241e"
    return marker


def template_kwargs(thinking: bool = False, day: date = date.fromisoformat(CHAT_DATE)) -> dict:
    """What a chat template is rendered with beyond the messages: ``enable_thinking`` (hybrid-thinking templates,
    Qwen3: off, it answers at once), and ``day`` for any template that stamps a date, as ``date_string`` (Llama
    3.1) and as ``strftime_now`` (Llama 3.2, Mistral Small 3: the renderer's clock, here fixed), so the same
    document gives the same tokens on every day."""
    return {"enable_thinking": thinking, "date_string": day.strftime("%d %b %Y"),
            "strftime_now": lambda fmt: datetime.combine(day, time()).strftime(fmt)}


def expects_bos(tokenizer) -> Optional[str]:
    """The BOS text the model's tokenizer puts before any text it encodes with special tokens, or None."""
    bos, bos_id = getattr(tokenizer, "bos_token", None), getattr(tokenizer, "bos_token_id", None)
    if not bos or bos_id is None:
        return None
    ids = list(tokenizer.encode("a", add_special_tokens=True))
    return bos if ids[:1] == [bos_id] else None


def build_prompt(tokenizer, document: str, instruction: str, thinking: bool = False,
                 day: date = date.fromisoformat(CHAT_DATE)) -> PromptParts:
    """Render the model's chat template around the document and the instruction (with ``template_kwargs``),
    then split. A model whose tokenizer adds a BOS token gets one at the start where the template (or the
    plain prompt of a model without one) has none."""
    marker = split_marker(document, instruction)
    content = f"{document}\n\n{marker}{instruction}"
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": content}]
        try:
            rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                     **template_kwargs(thinking, day))
        except TypeError:  # a tokenizer of its own whose renderer takes no template variables
            rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        rendered = f"Document:\n{content}\nAnswer:"
    bos = expects_bos(tokenizer)
    if bos and not rendered.startswith(bos):
        rendered = bos + rendered
    head, sep, tail = rendered.partition(marker)
    if not sep:
        raise ValueError("the chat template dropped the prompt text; cannot split context and question")
    return PromptParts(context=head, question=tail)


def encode(tokenizer, text: str) -> list[int]:
    # The template already holds the special tokens; do not let the tokenizer add a BOS again.
    return list(tokenizer.encode(text, add_special_tokens=False))


def repeat_instruction(tokenizer, **template) -> Instruction:
    """KVzip's "repeat the context" asked as a question is: after the compressed context, in the user's turn,
    followed by the template's change to the assistant's turn, which then repeats each chunk. ``template``:
    ``build_prompt``'s thinking and date."""
    turn = build_prompt(tokenizer, "", "", **template).question  # the template's text between question and answer
    return Instruction(tuple(encode(tokenizer, REPEAT_FIRST)), tuple(encode(tokenizer, REPEAT_RESUME)),
                       tuple(encode(tokenizer, turn)))
