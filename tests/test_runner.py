"""The runner on a tiny random model: compress once, questions appended and never evicted, rewind."""

import nestedkv

import mlx.core as mx
import pytest

from pipeline.config import RunConfig
from pipeline.documents import Document
from pipeline.results import ERROR, OK, TOO_LONG
from nestedkv import rewind
from pipeline.runner import Runner
from tests.tiny import ByteTokenizer, tiny_model

TEXT = ("The quick brown fox jumps over the lazy dog near the river bank. " * 12).strip()


def make_runner(**cfg):
    cfg = {"task": "qa", "model": "tiny", "max_new_tokens": 6, "prefill_step_size": 128, **cfg}
    return Runner(tiny_model(), ByteTokenizer(), RunConfig(**cfg))


def doc(**kw):
    return Document(**{"doc_id": "d1", "text": TEXT, "questions": ["Who jumps?", "Where?"], "answers": ["fox", "river"], **kw})


def test_question_rows_are_appended_after_compression_and_rewound():
    runner = make_runner(press="nestedkv", budget=64, head_budget="uniform")
    res, prepared = runner.start(doc())
    cache = runner.prefill(prepared, res)
    n_ctx = len(prepared.context_ids)
    assert all(c.offset == n_ctx and not c.compressed for c in cache)
    nestedkv.compress(cache)
    assert all(c.stored == 64 and c.context_len == n_ctx for c in cache)

    q_ids = prepared.questions[0][1]
    out = res.questions[0]
    runner.answer(cache, q_ids, out)
    for c in cache:
        # Every question and generated row is still there: nothing after the context is evicted.
        assert c.stored - c.n_ctx_rows == c.offset - n_ctx >= len(q_ids)
        assert c.context_len == n_ctx
    rewind(cache)
    assert all(c.stored == 64 and c.offset == n_ctx for c in cache)


def test_second_question_matches_a_fresh_compressed_cache():
    runner = make_runner(press="nestedkv", budget=64, head_budget="uniform")
    res = runner.run(doc())
    assert res.status == OK, res.error
    # Answer question 1 alone on a fresh cache: rewinding after question 0 must not have changed it.
    alone, prepared = runner.start(doc())
    cache = runner.prefill(prepared, alone)
    nestedkv.compress(cache)
    runner.answer(cache, prepared.questions[1][1], alone.questions[1])
    assert res.questions[1].output == alone.questions[1].output
    assert res.questions[1].n_generated == alone.questions[1].n_generated


def test_layer_stats_follow_the_budget():
    r = 0.75
    runner = make_runner(press="nestedkv", compression_ratio=r, head_budget="uniform")
    res = runner.run(doc())
    assert res.status == OK
    assert len(res.layers) == 2
    for lm in res.layers:
        assert lm.tokens_seen == res.n_tokens
        assert lm.kept_max == lm.kept_min == int(res.n_tokens * (1 - r))
        assert lm.bytes_kept / lm.bytes_full == pytest.approx(1 - r, abs=1 / res.n_tokens)
        assert lm.bytes_resident == lm.bytes_kept
    assert res.prefill_s > 0 and res.peak_prefill_bytes > 0
    assert all(q.n_generated <= 6 for q in res.questions)


def test_no_press_keeps_everything():
    res = make_runner(press="no_press").run(doc())
    assert res.status == OK
    assert all(lm.bytes_kept == lm.bytes_full for lm in res.layers)


def test_too_long_is_an_error_row_with_token_counts():
    runner = Runner(tiny_model(), ByteTokenizer(), RunConfig(task="qa", model="tiny", max_new_tokens=6,
                                                             long_docs="refuse"), max_context=200)
    res = runner.run(doc())
    assert res.status == TOO_LONG
    assert str(res.n_tokens) in res.error and "200" in res.error
    assert all(q.status == TOO_LONG for q in res.questions)
    assert res.layers == []


def test_truncate_cuts_the_middle_to_fit_the_window():
    runner = Runner(
        tiny_model(), ByteTokenizer(), RunConfig(task="qa", model="tiny", max_new_tokens=6, long_docs="truncate"),
        max_context=300
    )
    res = runner.run(doc())
    assert res.status == OK
    longest_q = max(q.n_question_tokens for q in res.questions)
    assert res.n_tokens + longest_q + 6 <= 300
    assert "truncated" in res.error


def test_qa_without_questions_is_an_error_naming_the_field():
    res = make_runner().run(doc(questions=None, answers=None))
    assert res.status == ERROR
    assert "d1" in res.error and "questions" in res.error


def test_summarize_asks_one_instruction():
    res = make_runner(task="summarize").run(doc())
    assert res.status == OK
    assert [q.question for q in res.questions] == [RunConfig().summary_instruction]


def test_qa_instruction_is_part_of_the_configuration():
    a, b = RunConfig(task="qa"), RunConfig(task="qa", qa_instruction="Q: {question}\nA:")
    assert a.config_hash() != b.config_hash()
    res = Runner(tiny_model(), ByteTokenizer(), b.model_copy(update={"model": "tiny", "max_new_tokens": 2})).run(doc())
    assert res.questions[0].n_question_tokens == len("Q: Who jumps?\nA:".encode()) + len("\nAnswer:".encode())
    with pytest.raises(ValueError, match="question"):
        RunConfig(qa_instruction="no placeholder")


def test_summaries_default_to_a_mild_repetition_penalty_and_qa_to_plain_greedy():
    assert RunConfig(task="summarize").repetition_penalty == 1.1
    assert RunConfig(task="qa").repetition_penalty is None
    assert RunConfig(task="summarize", repetition_penalty=1.0).repetition_penalty == 1.0
    assert make_runner(task="summarize").logits_processors
    assert make_runner(task="qa").logits_processors is None
    assert make_runner(task="summarize", repetition_penalty=1.0).logits_processors is None


def test_batched_repetition_penalty_equals_mlx_lms_row_by_row():
    from mlx_lm.sample_utils import make_repetition_penalty

    from pipeline.runner import REPETITION_CONTEXT, penalize_repeats

    logits = mx.random.normal((3, 50), key=mx.random.key(0)) * 4
    histories = [[7], [3, 3, 9, 3, 41], [i % 50 for i in range(100)]]  # one token; repeats; longer than the context
    got = penalize_repeats(logits, histories, 1.3)
    processor = make_repetition_penalty(1.3, REPETITION_CONTEXT)
    for b, h in enumerate(histories):
        want = processor(mx.array(h, dtype=mx.int32), logits[b : b + 1])
        assert mx.array_equal(got[b : b + 1], want).item()
    assert not mx.array_equal(got, logits).item()
    with pytest.raises(ValueError, match="history"):
        penalize_repeats(logits, [[1], [], [2]], 1.3)


@pytest.mark.parametrize("long_docs", ["truncate", "stream"])
def test_too_long_when_read_anyway_names_what_is_too_long(long_docs):
    """Cut or streamed, the context fits: the hint is about the question and the answer, never --long-docs."""
    cfg = RunConfig(task="qa", model="tiny", max_new_tokens=290, long_docs=long_docs)
    res, prepared = Runner(tiny_model(), ByteTokenizer(), cfg, max_context=300).start(doc())
    assert prepared is None and res.status == TOO_LONG
    assert "--max-new-tokens" in res.error and "--long-docs" not in res.error
    refuse = cfg.model_copy(update={"long_docs": "refuse"})
    res, _ = Runner(tiny_model(), ByteTokenizer(), refuse, max_context=300).start(doc())
    assert "--long-docs stream" in res.error


def test_a_document_quoting_the_split_marker_stays_in_the_context():
    from pipeline.prompts import _SPLIT, build_prompt

    text = f"First half. {_SPLIT} second half, still the document."
    parts = build_prompt(ByteTokenizer(), text, "Summarize.")
    assert text in parts.context and parts.question.strip().startswith("Summarize.")
    assert "second half" not in parts.question


def one_long_question(runner, extra: int = 40):
    """A document whose question 1 alone, with the context and the answer, exceeds a window that question 0
    fits in; the runner's window set so (question 1 is ``extra`` tokens longer than the room left)."""
    d = doc(questions=["Who jumps?", "Where " + "and why " * 40 + "?"], answers=["fox", "river"])
    runner.max_context = None
    prepared = runner.prepare(d)
    n_ctx, (q0, q1) = len(prepared.context_ids), [len(ids) for _, ids, _ in prepared.questions]
    assert q1 > q0 + extra
    runner.max_context = n_ctx + q0 + runner.config.max_new_tokens + extra
    return d


def test_one_question_too_long_marks_only_that_question():
    runner = make_runner()
    res = runner.run(one_long_question(runner))
    assert res.status == OK and res.error is None and not res.all_ok
    first, second = res.questions
    assert first.status == OK and first.error is None and first.n_generated > 0
    assert second.status == TOO_LONG and second.n_generated == 0 and second.output == ""
    assert second.error.startswith("document 'd1' question 1: context ")
    assert f"exceeds the model window of {runner.max_context}" in second.error
    assert res.problems == second.error
    assert res.layers  # the document ran: prefilled, compressed, answered


def test_one_question_too_long_with_truncate_cuts_for_the_others():
    """--truncate cuts the context for the questions that can fit at all; one whose answer leaves no room
    for any context stays too long, alone."""
    runner = make_runner(long_docs="truncate", max_new_tokens=6)
    d = doc(questions=["Who jumps?", "Where " + "and why " * 40 + "?"])
    runner.max_context = 200  # question 1 (+ 6 answer tokens) alone is longer than the window
    res = runner.run(d)
    assert res.status == OK and "truncated" in res.error
    assert res.questions[0].status == OK and res.n_tokens + res.questions[0].n_question_tokens + 6 <= 200
    assert res.questions[1].status == TOO_LONG and "shorten the question" in res.questions[1].error
