"""Quality metrics on hand-made strings and logits, and teacher forcing on a tiny model."""

import math

import numpy as np
import pytest

from pipeline.evaluate import (
    contains_gold,
    evaluation_rows,
    exact_match,
    nll_per_token,
    normalize_answer,
    rouge_l,
    score_answer,
    score_logits,
    teacher_force,
    token_nll,
    top1_agreement,
)
from pipeline.results import DocumentResult, QuestionResult


# -- text -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, want", [
    ("  The Code:  K7-Q2! ", "the code k7q2"),
    ("Ottoline\tFARQUHARSON.\n", "ottoline farquharson"),
    ("4,719 paces", "4719 paces"),
    ("“Quoted” — dashes…", "quoted dashes"),
    ("STRASSE", "strasse"),
    ("Straße", "strasse"),  # casefold, not lower
    ("", ""),
    (None, ""),
])
def test_normalize_answer_folds_case_punctuation_and_whitespace(text, want):
    assert normalize_answer(text) == want


@pytest.mark.parametrize("answer, gold, want", [
    ("The gardener's locker code was 6585.", "6585", True),
    ("It measured 715 paces.", "715", True),
    ("It measured 7 paces.", "715", False),
    ("The code was 16585.", "6585", False),  # whole words only: a longer number is not the gold one
    ("The code was 65851.", "6585", False),
    ("He said: ottoline FARQUHARSON, of course", "Ottoline Farquharson", True),
    ("Ottoline", "Ottoline Farquharson", False),
    ("It was 4,719 feet", "4719", True),
    ("the key is K7-Q2", "k7q2", True),
    ("", "6585", False),
    ("anything at all", "", False),
    ("anything at all", None, False),
])
def test_contains_gold(answer, gold, want):
    assert contains_gold(answer, gold) is want


def test_exact_match_after_folding():
    assert exact_match("The code was 6585.", "the code was 6585")
    assert not exact_match("The code was 6585.", "The code was 6586.")
    assert exact_match("", None)


def test_rouge_l_on_hand_made_strings():
    assert rouge_l("the cat sat on the mat", "the cat sat on the mat") == 1.0
    assert rouge_l("dogs bark loudly", "the cat sat") == 0.0
    # LCS "the cat sat" = 3 tokens: precision 3/3, recall 3/6, F = 2/3
    assert rouge_l("the cat sat", "the cat sat on the mat") == pytest.approx(2 / 3)
    # precision and recall swap roles, the F-measure stays
    assert rouge_l("the cat sat on the mat", "the cat sat") == pytest.approx(2 / 3)
    assert rouge_l("", "") == 1.0
    assert rouge_l("", "something") == 0.0


def test_score_answer_picks_metrics_by_what_is_known():
    assert score_answer("code 6585", gold="6585") == {"correct": 1.0}
    s = score_answer("code 6585", gold="6585", reference="The code was 6585.")
    assert s["correct"] == 1.0 and s["agree_exact"] == 0.0 and 0 < s["rouge_l"] < 1
    assert score_answer("x", reference="x") == {"agree_exact": 1.0, "rouge_l": 1.0}


# -- logits -----------------------------------------------------------------------------------------------
def test_nll_per_token_on_hand_made_logits():
    logits = [[0.0, 0.0], [math.log(3.0), 0.0]]  # p(0) = 1/2, then p(0) = 3/4
    assert token_nll(logits, [0, 0]) == pytest.approx([math.log(2), -math.log(0.75)])
    assert nll_per_token(logits, [0, 0]) == pytest.approx((math.log(2) - math.log(0.75)) / 2)
    assert nll_per_token(logits, [1, 1]) == pytest.approx((math.log(2) + math.log(4)) / 2)
    # shift-invariant per row and stable for large logits
    big = [[1000.0, 0.0, 0.0], [5.0, 5.0 + math.log(2.0), 5.0]]
    assert nll_per_token(big, [0, 1]) == pytest.approx((0.0 + math.log(2.0)) / 2, abs=1e-9)
    assert math.isnan(nll_per_token(np.zeros((0, 4)), []))


def test_nll_rejects_misaligned_targets():
    with pytest.raises(ValueError):
        nll_per_token([[0.0, 1.0]], [0, 1])
    with pytest.raises(ValueError):
        nll_per_token([[0.0, 1.0]], [2])


def test_top1_agreement_on_hand_made_logits():
    a = [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 2.0]]
    b = [[3.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.1, 0.2]]
    assert top1_agreement(a, b) == pytest.approx(2 / 3)
    assert top1_agreement(a, a) == 1.0
    with pytest.raises(ValueError):
        top1_agreement(a, b[:2])


def test_score_logits_is_zero_and_one_for_identical_caches():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, 11))
    targets = [1, 2, 3, 4, 5]
    s = score_logits(logits, logits, targets)
    assert s == {"delta_nll": 0.0, "top1_agreement": 1.0}
    worse = logits.copy()
    worse[np.arange(5), targets] -= 3.0  # the compressed cache believes the reference answer less
    s = score_logits(worse, logits, targets)
    assert s["delta_nll"] > 0
    assert score_logits(logits, logits, []) == {}


# -- rows -------------------------------------------------------------------------------------------------
def test_evaluation_rows_tag_gold_and_reference_metrics():
    res = DocumentResult("d", "h" * 64, 10, questions=[QuestionResult(0, "q0"), QuestionResult(1, "q1")])
    scores = [{"correct": 1.0, "agree_exact": 0.0, "delta_nll": 0.5}, {"correct": 0.0, "top1_agreement": math.nan}]
    rows = evaluation_rows("run-c", res, scores, "run-ref")
    by = {(r["question_idx"], r["metric"]): r for r in rows}
    assert set(by) == {(0, "correct"), (0, "agree_exact"), (0, "delta_nll"), (1, "correct")}  # NaN dropped
    assert by[(0, "correct")]["reference_run_id"] is None
    assert by[(0, "agree_exact")]["reference_run_id"] == "run-ref"
    assert all(r["run_id"] == "run-c" and r["doc_id"] == "d" for r in rows)
    # without a reference run only the gold metrics can be stored
    assert {r["metric"] for r in evaluation_rows("run-c", res, scores, None)} == {"correct"}


# -- teacher forcing --------------------------------------------------------------------------------------
class CharTokenizer:
    """Lossless on generated ids: id i <-> one CJK character, so re-encoding an answer gives its ids back."""

    BASE = 0x4E00
    chat_template = None
    eos_token_id = 0
    eos_token_ids = {0}

    def encode(self, text, add_special_tokens=False):
        return [ord(c) - self.BASE if self.BASE < ord(c) < self.BASE + 256 else ord(c) % 255 + 1 for c in text]

    def decode(self, ids, **_):
        return "".join(chr(self.BASE + int(i)) for i in ids if int(i) != 0)


def test_teacher_forcing_reproduces_the_greedy_answer_and_rewinds():
    from tiny import tiny_model

    import nestedkv as nkv
    from pipeline.config import RunConfig
    from pipeline.documents import Document
    from pipeline.runner import Runner

    tok = CharTokenizer()
    cfg = RunConfig(task="qa", press="no_press", compression_ratio=0.0, max_new_tokens=10, prefill_step_size=64)
    runner = Runner(tiny_model(seed=2), tok, cfg, max_context=4096)
    doc = Document(doc_id="d", text="a plain document about bytes and caches " * 8, questions=["what?"])
    res, prepared = runner.start(doc)
    cache = runner.prefill(prepared, res)
    runner.finish(cache, prepared, res)
    answer = res.questions[0].output
    targets = tok.encode(answer)
    assert len(targets) == res.questions[0].n_generated > 1
    assert len(set(targets)) > 1  # a constant answer could hide an off-by-one below
    rows = cache[0].stored
    logits = teacher_force(runner.model, cache, prepared.questions[0][1], targets)
    assert logits.shape == (len(targets), 256)
    # position i of the forced pass predicts answer token i: greedy decoding chose exactly these
    assert logits.argmax(axis=1).tolist() == targets
    assert all(c.stored == rows for c in cache)  # trimmed back to the context
    # the same pass again gives the same logits (nothing of the first pass stayed in the cache)
    np.testing.assert_allclose(teacher_force(runner.model, cache, prepared.questions[0][1], targets), logits,
                               rtol=1e-5, atol=1e-5)
    # a compressed cache is scored along the same answer; it believes it less than the full cache
    small = nkv.clone(runner.prefill(prepared, res), nkv.KeyDiffPress(compression_ratio=0.9))
    nkv.compress(small)
    s = score_logits(teacher_force(runner.model, small, prepared.questions[0][1], targets), logits, targets)
    assert s["delta_nll"] != 0.0 and 0.0 <= s["top1_agreement"] <= 1.0


def test_teacher_forcing_rows_match_step_by_step_decoding():
    """Row i of the forced pass equals the next-token logits after question + answer[:i], fed one by one."""
    import mlx.core as mx
    from tiny import tiny_model

    import nestedkv as nkv

    model = tiny_model(seed=1)
    ctx = mx.array([(7 * i) % 251 + 1 for i in range(300)], dtype=mx.int32)[None]
    question, answer = [11, 12, 13], [5, 17, 99, 3, 42]
    cache = nkv.make_cache(model, nkv.KnormPress(compression_ratio=0.5))
    model(ctx, cache=cache)
    nkv.compress(cache)
    forced = teacher_force(model, cache, question, answer)
    assert forced.shape == (len(answer), 256)
    steps = [model(mx.array(question, dtype=mx.int32)[None], cache=cache)[0, -1]]
    for t in answer[:-1]:
        steps.append(model(mx.array([[t]], dtype=mx.int32), cache=cache)[0, -1])
    np.testing.assert_allclose(forced, np.array(mx.stack(steps).astype(mx.float32)), rtol=1e-4, atol=1e-4)


def test_cli_ablation_prints_and_writes_its_table(monkeypatch, tmp_path):
    """``nkv ablation``: the table of every (variant, ratio) and the pairing against KeyDiff."""
    import pyarrow.parquet as pq
    from typer.testing import CliRunner

    from flows.cli import app
    from tiny import TINY_NAME, use_tiny_model

    import pyarrow as pa

    data = str(tmp_path / "in.parquet")  # short: the byte tokenizer's tokens must fit the tiny model's window
    pq.write_table(pa.Table.from_pylist([{"doc_id": "d", "text": "The lamp was lit. " * 40 + "The code is 4711. "
                                          + "The rain fell. " * 40, "questions": ["What is the code?", "What fell?"],
                                          "answers": ["4711", "rain"]}]), data)
    out = tmp_path / "ablation.md"
    args = ["ablation", "--input", data, "--limit", "1", "--model", TINY_NAME,
            "--variants", "block only,keydiff", "--compression-ratio", "0.5", "--max-new-tokens", "2", "--out", str(out)]
    with use_tiny_model(monkeypatch):
        res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    text = out.read_text()
    assert "| no_press | 0.00 | 2 |" in text and "| block only | 0.50 | 2 |" in text
    assert "- r=0.50 block only vs keydiff (correct):" in text and text.strip() in res.output
    res = CliRunner().invoke(app, [*args, "--variants", "bogus"])
    assert res.exit_code == 2 and "bogus" in res.output
