"""Synthetic long-context tasks after RULER (Hsieh et al., 2024), on Jane Austen's prose, sized in model tokens.

    nkv tasks --out suite.parquet [--size quick|small|standard] [--model smollm2-135m]

Every document is one task at one target length (tokens of the model's tokenizer, counted by a function the
caller passes in), with several questions, so one compressed context answers many. The tasks follow RULER's
published definitions, written afresh here; needles sit at sentence boundaries of consecutive Austen text:

- ``niah_single``: three needles of different kinds (a number, a code word, a name), each under its own key;
  one question per needle.
- ``niah_multikey``: four needles of one kind and one phrasing under four keys; one question per key, the
  other three are distractors of the same kind.
- ``niah_multivalue``: two keys with four values each; "what are all the values of key k" (all four).
- ``niah_multiquery``: four keys, one value each; each question asks for two keys' values at once.
- ``variable_tracking``: two chains of five variables (``VAR A = 12345``, ``VAR B = VAR A``, ...); "which
  variables hold 12345" (all five of that chain).
- ``common_words``: a numbered list of words drawn from the novels' vocabulary, ten of them 30 times each
  (fewer when the length cannot hold 300 entries, always more than the others), the others 3 times; "the ten
  most common words". No prose, as in RULER.
- ``two_hop``: two chains "A is in B" ... "B is in C"; "in which C is A" (the second hop's answer).

``summary_documents`` gives plain text of a length (no needles, no questions) for comparing summaries.

Surface forms (key words, value nouns, statement and question phrasings, names) are drawn per document, so
no press wins by a template. Numbers have five digits (RULER: seven) so that a four-value answer fits in 32
new tokens. A question's gold ``answers`` entry is its ``parts`` joined by ", "; RULER's score (and the
suite's ``recall``) is the share of ``parts`` found in the answer. Output: Parquet in the pipeline's input
schema plus ``task``, ``length`` (target tokens), ``n_tokens`` (measured), and per question ``kinds``,
``parts`` and ``evidence`` (the planted sentences that answer it).

Deterministic: every document draws from its own RNG seeded by (seed, task, length, index), so a subset of
tasks or lengths yields the same documents as the full set.

Modules: ``text`` (Austen's novels as a haystack of sentences), ``forms`` (surface forms), ``plans`` (the plan
and the registry), ``kinds`` (one module per task, each registering its planner), ``build`` (sizing, documents,
Parquet). A new task is a module in ``kinds`` and its test; ``tests/test_task_contract.py`` holds every
registered task to the contract.
"""

from pipeline.tasks.build import (SCHEMA, SIZES, Size, generate, length_label, summary_documents, token_counter,
                                  write)
from pipeline.tasks.kinds import KINDS, KNOWN, TASKS, check_tasks

__all__ = ["KINDS", "KNOWN", "SCHEMA", "SIZES", "Size", "TASKS", "check_tasks", "generate", "length_label",
           "summary_documents", "token_counter", "write"]
