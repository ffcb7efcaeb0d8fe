"""The synthetic long-context tasks (pipeline.tasks) and the suite that runs them (pipeline.suite), on the
quick size with the byte tokenizer and a tiny random model."""

import math
import re
from collections import Counter

import pyarrow.parquet as pq
import pytest

from tiny import TINY_NAME, ByteTokenizer, use_tiny_model

from pipeline import suite, tasks
from pipeline.config import BatchOptions
from pipeline.spec import PressGrid
from pipeline.documents import load_documents

LENGTH = 1024  # bytes of the byte tokenizer: the quick size
COUNT = tasks.token_counter(ByteTokenizer())


@pytest.fixture(scope="module")
def docs():
    return tasks.generate(COUNT, lengths=(LENGTH,), per_task=2, seed=7)


def test_generation_is_deterministic_and_seeded(docs):
    again = tasks.generate(COUNT, lengths=(LENGTH,), per_task=2, seed=7)
    assert again == docs
    other = tasks.generate(COUNT, lengths=(LENGTH,), per_task=2, seed=8)
    assert [d["text"] for d in other] != [d["text"] for d in docs]
    # a subset of tasks yields the same documents as the full set
    assert tasks.generate(COUNT, lengths=(LENGTH,), per_task=2, seed=7, tasks=["two_hop"]) == \
        [d for d in docs if d["task"] == "two_hop"]


def test_every_task_and_the_schema(docs, tmp_path):
    assert {d["task"] for d in docs} == set(tasks.TASKS)
    assert len({d["doc_id"] for d in docs}) == len(docs)
    path = tasks.write(docs, tmp_path / "s.parquet")
    assert pq.read_table(path).schema.equals(tasks.SCHEMA)
    loaded, errors = load_documents(path)  # the pipeline's reader takes it (and ignores the extra columns)
    assert not errors and [d.doc_id for d in loaded] == [d["doc_id"] for d in docs]
    for d in docs:
        n = len(d["questions"])
        assert n >= 1 and len(d["answers"]) == len(d["parts"]) == len(d["kinds"]) == len(d["evidence"]) == n
        assert d["answers"] == [", ".join(p) for p in d["parts"]]


def test_lengths_are_within_tolerance(docs):
    for d in docs:
        assert d["n_tokens"] == COUNT(d["text"])
        assert 0.95 * LENGTH <= d["n_tokens"] <= LENGTH, (d["doc_id"], d["n_tokens"])


def test_standard_lengths_with_a_word_tokenizer():
    words = lambda text: len(text.split())  # noqa: E731  (any counter works: lengths are the counter's)
    docs = tasks.generate(words, lengths=(2048, 4096), per_task=1, tasks=["niah_single", "common_words"])
    plain = tasks.summary_documents(words, (2048,), per_length=2)
    for d in docs + plain:
        assert 0.97 * d["length"] <= d["n_tokens"] <= d["length"], (d["doc_id"], d["n_tokens"])
    assert [d["questions"] for d in plain] == [None, None] and plain[0]["text"] != plain[1]["text"]


def test_summary_documents_plant_one_event_per_band_and_a_middle_cut_loses_the_middle():
    words = lambda text: len(text.split())  # noqa: E731
    rows = tasks.summary_documents(words, (2048,), per_length=3, seed=4, middle_cut=True)
    whole = [d for d in rows if d["task"] == "summary"]
    assert len(whole) == 3 and len(rows) == 6
    for d in whole:
        cut = next(c for c in rows if c["doc_id"] == d["doc_id"] + "-cut")
        assert len(d["parts"]) == len(d["depths"]) == len(d["evidence"]) == 6
        assert d["depths"] == sorted(d["depths"]) and d["depths"][0] < 0.3 and d["depths"][-1] >= 0.7
        assert any(0.3 <= x < 0.7 for x in d["depths"])
        for names, (sentence,), depth in zip(d["parts"], d["evidence"], d["depths"]):
            assert all(len(re.findall(rf"\b{re.escape(n)}\b", d["text"])) == 1 for n in names)
            at = d["text"].index(sentence) / len(d["text"])
            assert at == depth
            kept = sentence in cut["text"]
            if 0.35 <= at < 0.65:  # well inside the middle: cut; well outside: kept
                assert not kept
            elif not 0.25 <= at < 0.75:
                assert kept
        assert words(cut["text"]) < 0.75 * words(d["text"])
    again = tasks.summary_documents(words, (2048,), per_length=3, seed=4)
    assert [d["text"] for d in again] == [d["text"] for d in whole]  # the cut draws nothing


def test_coverage_counts_the_events_a_summary_names_by_depth():
    from pipeline.evaluate import coverage

    parts = [["Ottoline", "Quillfeather"], ["Crispin", "Marchbanks"], ["Euphemia", "Kettleburn"]]
    depths = [0.1, 0.5, 0.9]
    got = coverage("Mr. Quillfeather's stables burned; EUPHEMIA came from the sea.", parts, depths)
    assert got == {"coverage": 2 / 3, "coverage_middle": 0.0, "coverage_ends": 1.0}
    assert coverage("Crispin's hat", parts, depths)["coverage_middle"] == 1.0
    assert coverage("Marchbankses", parts, depths)["coverage"] == 0.0  # whole words only
    assert math.isnan(coverage("x", parts[:1], depths[:1])["coverage_middle"])


def test_source_coverage_counts_the_tenths_a_summary_draws_words_from():
    from pipeline.evaluate import band_words, source_coverage

    # ten equal tenths, each with a word of its own and a word every tenth shares
    text = " ".join(f"common {w}" for w in ("alpha", "bravo", "charlie", "delta", "echoes", "foxtrot", "golfer",
                                             "hotel", "india", "juliet"))
    own = band_words(text)
    assert [len(o) for o in own] == [1] * 10 and all("common" not in o for o in own)
    assert source_coverage("Alpha met Juliet; common ground.", text) == \
        {"source_coverage": 0.2, "source_middle": 0.0, "source_ends": 2 / 6}
    # delta, echoes, foxtrot, golfer: the middle 30-70%
    assert source_coverage("delta foxtrot", text)["source_middle"] == 0.5
    assert math.isnan(source_coverage("x", "")["source_coverage"])


def test_a_middle_cuts_summary_is_scored_against_the_whole_document():
    from pipeline.evaluate import band_words, summary_coverage

    words = lambda text: len(text.split())  # noqa: E731
    whole, cut = tasks.summary_documents(words, (2048,), per_length=1, seed=3, middle_cut=True)
    middle_word = sorted(set().union(*band_words(whole["text"])[4:6]))[0]  # a word of the 40-60% alone
    assert middle_word not in cut["text"].lower()
    assert summary_coverage(middle_word, cut)["source_middle"] > 0 == summary_coverage("", cut)["source_middle"]


def test_needles_are_present_once_and_answer_their_question(docs):
    for d in docs:
        if d["task"] not in ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery"):
            continue
        for q, parts, evidence in zip(d["questions"], d["parts"], d["evidence"]):
            for part in parts:
                assert len(re.findall(rf"\b{re.escape(part)}\b", d["text"])) == 1, (d["doc_id"], part)
                # the one sentence holding the value names the question's key (for multi-query: one of two)
                sentence = next(s for s in evidence if part in s)
                assert sentence in d["text"]
                keys = re.findall(r"\b([a-z]+-[a-z]+)\b", q)
                assert keys and any(k in sentence for k in keys), (q, sentence)


def test_needles_sit_outside_quotations(docs):
    checked = 0
    for d in docs:
        for sentence in {s for ev in d["evidence"] for s in ev if s in d["text"]}:
            start = d["text"].index(sentence)
            paragraph = d["text"][d["text"].rfind("\n\n", 0, start) + 2 : start]
            assert paragraph.count('"') % 2 == 0, (d["doc_id"], sentence)
            checked += 1
    assert checked > 0


def resolve(text: str) -> dict:
    """Variable -> value, by reading the assignments in order (any of the three phrasings)."""
    env = {}
    pat = re.compile(r"(?:VAR |Let )?\b([A-Z]{5})\b (?:=|be|:=) (?:VAR )?([A-Z]{5}|\d{5})\b")
    for a, b in pat.findall(text):
        env[a] = env[b] if b in env else b
    return env


def test_variable_chains_resolve_to_the_gold_variables(docs):
    for d in (d for d in docs if d["task"] == "variable_tracking"):
        env = resolve(d["text"])
        for q, parts in zip(d["questions"], d["parts"]):
            value = re.search(r"\b(\d{5})\b", q).group(1)
            assert sorted(v for v, x in env.items() if x == value) == sorted(parts), d["doc_id"]


def test_common_words_are_the_most_frequent(docs):
    for d in (d for d in docs if d["task"] == "common_words"):
        counts = Counter(re.findall(r"\d+\. ([a-z]+)", d["text"]))
        (parts,) = d["parts"]
        assert len(parts) == 10
        least_common = min(counts[w] for w in parts)
        assert least_common > max(c for w, c in counts.items() if w not in parts)


def test_two_hop_chains_lead_to_the_gold(docs):
    for d in (d for d in docs if d["task"] == "two_hop"):
        for (gold,), (hop1, hop2) in zip(d["parts"], d["evidence"]):
            assert hop1 in d["text"] and hop2 in d["text"]
            # the first hop names B, the second takes B to the gold C
            words = {"The", "the", "in", "of", "town"}
            shared = set(re.findall(r"[\w-]+", hop1)) & set(re.findall(r"[\w-]+", hop2)) - words
            assert shared and gold in hop2 and gold not in hop1


def test_recall_is_the_share_of_parts_found():
    assert suite.recall("It is 12345 and 67890.", ["12345", "67890"]) == 1.0
    assert suite.recall("12345", ["12345", "67890"]) == 0.5
    assert suite.recall("Mr. Ottoline", ["Ottoline Farquharson"]) == 0.0


def test_paired_counts_and_standard_error():
    rows = []
    for i, (a, b) in enumerate([(1, 0), (1, 0), (0, 1), (1, 1), (0, 0)]):
        for press, v in (("nestedkv", a), ("keydiff", b)):
            rows.append({"press": press, "compression_ratio": 0.75, "head_budget": "uniform", "prefill": "whole",
                         "task": "t", "length": 4096, "doc_id": f"d{i}", "question_idx": 0, "value": float(v)})
    cfg = {"compression_ratio": 0.75, "head_budget": "uniform", "prefill": "whole"}
    p = suite.paired(rows, {"press": "nestedkv", **cfg}, {"press": "keydiff", **cfg}, {("t", 4096)})
    assert (p["n"], p["better"], p["worse"], p["same"]) == (5, 2, 1, 2)
    assert p["mean_diff"] == pytest.approx(0.2)
    assert p["se"] == pytest.approx((2.8 / 4) ** 0.5 / 5 ** 0.5)  # sample sd of (1,1,-1,0,0) over sqrt(n)
    assert suite.paired(rows, {"press": "nestedkv", **cfg}, {"press": "keydiff", **cfg}, {("t", 2048)})["n"] == 0
    low = suite.paired(rows, {"press": "nestedkv", **cfg}, {"press": "keydiff", **cfg}, {("t", 4096)}, lower_is_better=True)
    assert (low["better"], low["worse"], low["same"], low["mean_diff"]) == (1, 2, 2, pytest.approx(0.2))


def test_calibration_excludes_cells_below_the_threshold():
    rows = [{"press": "no_press", "task": t, "length": 2048, "value": v} for t, v in
            [("niah_single", 1.0), ("niah_single", 0.0), ("two_hop", 1.0)]]
    calib = {c["task"]: c for c in suite.calibration(rows, 0.6)}
    assert calib["niah_single"]["accuracy"] == 0.5 and not calib["niah_single"]["headline"]
    assert calib["two_hop"]["headline"]


def test_suite_ablation_variants_can_be_chosen():
    opts = suite.SuiteOptions(grid=PressGrid(press=["nestedkv"], compression_ratio=[0.75]),
                              variants=("block only", "window only post-RoPE"))
    got = sorted(opts.ablation_configs().values())
    assert got == ["block only", "nestedkv", "window only post-RoPE"]  # with the full method to pair against
    assert [c.press_params for c, n in opts.ablation_configs().items() if n == "window only post-RoPE"] == \
        [{"scales": [False, False, True], "unrotate": False}]
    assert [c.make_press().unrotate for c, n in opts.ablation_configs().items() if n == "block only"] == [True]
    with pytest.raises(ValueError, match="variants: unknown \\['keydiff'\\]"):
        suite.SuiteOptions(variants=("keydiff",))  # a baseline, not a NestedKV variant


def test_suite_options_are_the_batch_settings(tmp_path):
    opts = suite.SuiteOptions(out=str(tmp_path / "rep"), grid=PressGrid(press=["keydiff"], compression_ratio=[0.5, 0.9],
                                                                         kv_bits=[None, 4]),
                              options=BatchOptions(max_new_tokens=7, prefill_step_size=256))
    got = [(c.press, c.compression_ratio, c.kv_bits, c.max_new_tokens, c.prefill_step_size) for c in opts.configs()]
    assert got == [("keydiff", r, b, 7, 256) for r in (0.5, 0.9) for b in (None, 4)]
    assert opts.summary_base().max_new_tokens == opts.summary_tokens and opts.summary_base().prefill_step_size == 256
    # every stage scores against no_press; the prefills are kept under OUT unless another folder is given
    assert opts.engine().evaluate and opts.engine().prefill_cache == str(tmp_path / "rep" / "prefills")
    other = suite.SuiteOptions(options=BatchOptions(prefill_cache=str(tmp_path / "pc")))
    assert other.engine().prefill_cache == str(tmp_path / "pc")
    with pytest.raises(ValueError, match="no_press is the calibration reference"):
        suite.SuiteOptions(grid=PressGrid(press=["no_press", "keydiff"]))
    with pytest.raises(ValueError, match="budget: the suite compares ratios"):
        suite.SuiteOptions(grid=PressGrid(press=["keydiff"], budget=[64]))


def test_suite_pairs_and_labels_each_kv_width_apart():
    rows = [{"press": p, "compression_ratio": 0.75, "head_budget": "adaptive", "prefill": "whole", "kv_bits": b,
             "task": "niah_single", "length": 4096, "doc_id": "d", "question_idx": q, "config_hash": f"{p}{b}",
             "value": v} for p, b, vals in (("nestedkv", None, (1, 1)), ("keydiff", None, (1, 0)),
                                            ("nestedkv", 4, (0, 0)), ("keydiff", 4, (1, 0)))
            for q, v in enumerate(vals)]
    calib = [{"task": "niah_single", "length": 4096, "n": 2, "accuracy": 1.0, "headline": True}]
    heads, _ = suite.headline(rows, calib, ratios=(0.75,))
    got = {h["kv_bits"]: (h["acc_a"], h["acc_b"], h["better"], h["worse"]) for h in heads}
    assert got == {None: (1.0, 0.5, 1, 0), 4: (0.0, 0.5, 0, 1)}
    assert [suite.label(r) for r in rows[::4]] == ["nestedkv adaptive", "nestedkv adaptive 4-bit"]
    table = "\n".join(suite.headline_table(heads, 2))
    assert "| keydiff | 0.75 * | adaptive | whole |" in table and "| keydiff | 0.75 | adaptive | whole 4-bit |" in table


@pytest.mark.slow  # the summary stage on a tiny model
def test_suite_summaries_only_score_coverage_cost_and_pairs(monkeypatch, tmp_path):
    opts = suite.SuiteOptions(model=TINY_NAME, db=str(tmp_path / "s.duckdb"), out=str(tmp_path / "rep"),
                              lengths=(768,), grid=PressGrid(press=["nestedkv", "keydiff"], compression_ratio=[0.75],
                                                             head_budget=["uniform"]),
                              options=BatchOptions(max_new_tokens=3), long_from=768, summaries=2, summary_tokens=4,
                              summaries_only=True)
    with use_tiny_model(monkeypatch):
        res = suite.run_suite(opts, count=COUNT, log=lambda m: None)
    text = res.markdown_path.read_text()
    assert "## Calibration" not in text and "## Summaries: what the planted events kept" in text
    for row in ("| no_press | - | 768 | 2 |", "| no_press (middle cut) | - | 768 | 2 |",
                "| nestedkv uniform | 0.75 | 768 | 2 |", "| keydiff uniform | 0.75 | 768 | 2 |"):
        assert row in text, text
    assert "| keydiff | 0.75 | uniform | whole | 2 |" in text  # the pairing per document
    from pipeline.store import Store

    with Store(opts.db, read_only=True) as store:
        got = store.query("""
            SELECT r.press, o.doc_id LIKE '%-cut' AS cut, count(DISTINCT o.doc_id) AS docs,
                   count(*) FILTER (WHERE e.metric = 'coverage') AS coverage
            FROM outputs o JOIN runs r USING (run_id)
            LEFT JOIN evaluations e ON e.run_id = o.run_id AND e.doc_id = o.doc_id
            GROUP BY ALL ORDER BY ALL""").to_pylist()
    assert got == [{"press": "keydiff", "cut": False, "docs": 2, "coverage": 2},
                   {"press": "nestedkv", "cut": False, "docs": 2, "coverage": 2},
                   {"press": "no_press", "cut": False, "docs": 2, "coverage": 2},
                   {"press": "no_press", "cut": True, "docs": 2, "coverage": 2}]
    with pytest.raises(ValueError, match="summaries_only needs summaries"):
        suite.SuiteOptions(summaries_only=True)


@pytest.mark.slow  # the whole suite on a tiny model
def test_suite_runs_end_to_end_on_a_tiny_model(monkeypatch, tmp_path):
    opts = suite.SuiteOptions(model=TINY_NAME, db=str(tmp_path / "s.duckdb"), out=str(tmp_path / "rep"),
                              size="quick", lengths=(768,), tasks=("niah_single", "variable_tracking"),
                              grid=PressGrid(press=["nestedkv", "keydiff"], compression_ratio=[0.75],
                                             head_budget=["uniform"]),
                              options=BatchOptions(max_new_tokens=3, batch_decode=True),
                              threshold=0.0,  # a random model scores 0: let every cell through
                              long_from=768, summaries=1, summary_tokens=3)
    with use_tiny_model(monkeypatch):
        res = suite.run_suite(opts, count=COUNT, log=lambda m: None)
    text = res.markdown_path.read_text()
    assert "## Calibration" in text and "## Headline" in text and "niah_single" in text
    assert "## Per-scale ablation of NestedKV: accuracy" in text and "| stable only | 0.75 |" in text
    assert "## Per-scale ablation of NestedKV: delta gold NLL" in text and "Delta gold NLL (teacher-forced" in text
    assert "## Summaries: what the planted events kept" in text and "| nestedkv uniform | 0.75 | 768 | 1 |" in text
    assert "| no_press | - | 768 | 1 |" in text and "| no_press (middle cut) | - | 768 | 1 |" in text
    assert res.plot_path is not None and res.plot_path.stat().st_size > 0
    assert {(c["task"], c["length"]) for c in res.calibration} == {("niah_single", 768), ("variable_tracking", 768)}
    assert all(c["headline"] for c in res.calibration)
    assert [(h["ratio"], h["head_budget"], h["n"]) for h in res.headline] == [(0.75, "uniform", 5)]

    from pipeline.store import Store

    with Store(opts.db, read_only=True) as store:
        # task and length are in SQL: every stored answer (no_press and both methods) has a recall row
        got = store.query("""
            SELECT r.press, s.task, count(*) AS n FROM evaluations e JOIN runs r USING (run_id)
            JOIN outputs o ON o.run_id = e.run_id AND o.doc_id = e.doc_id AND o.question_idx = e.question_idx
            JOIN suite_questions s ON s.doc_id = o.doc_id AND s.question_idx = o.question_idx
            WHERE e.metric = 'recall' GROUP BY ALL ORDER BY ALL""").to_pylist()
    # nestedkv: the method and its 8 other ablation variants, and 5 of them scoring post-RoPE keys
    runs = {"keydiff": 1, "nestedkv": 14, "no_press": 1}
    assert got == [{"press": p, "task": t, "n": n * runs[p]} for p in runs
                   for t, n in (("niah_single", 3), ("variable_tracking", 2))]

    # a re-run resumes: nothing new is computed, the report is the same
    with use_tiny_model(monkeypatch) as (_, loads):
        again = suite.run_suite(opts, count=COUNT, log=lambda m: None)
    timeless = lambda md: [line for line in md.splitlines() if not line.startswith("Wall time")]  # noqa: E731
    assert loads == [] and timeless(again.markdown_path.read_text()) == timeless(text)

    # without NestedKV in the grid there is nothing to pair: said so, not an empty table
    alone = opts.model_copy(update={"grid": PressGrid(press=["keydiff"], compression_ratio=[0.75],
                                                      head_budget=["uniform"]), "ablation": False})
    with use_tiny_model(monkeypatch):
        md = suite.run_suite(alone, count=COUNT, log=lambda m: None).markdown_path.read_text()
    assert "nothing to pair" in md and "| against |" not in md


@pytest.mark.slow  # suite runs through the CLI
def test_cli_suite_calibration_only_and_bad_options(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from flows.cli import app

    args = ["suite", "--model", TINY_NAME, "--db", str(tmp_path / "s.duckdb"), "--out", str(tmp_path / "rep"),
            "--lengths", "768", "--tasks", "two_hop", "--max-new-tokens", "2"]
    with use_tiny_model(monkeypatch):
        res = CliRunner().invoke(app, [*args, "--press", ""])
    assert res.exit_code == 0, res.output
    # the random model answers nothing: the cell is reported, left out of the headline, and no method runs
    assert "| two_hop | 768 | 4 | 0.00 | no: uncompressed 0.00 < 0.6 |" in res.output  # 2 documents (standard)
    assert "No cell passed calibration" in res.output
    res = CliRunner().invoke(app, [*args, "--tasks", "niah_single,bogus"])
    assert res.exit_code == 2 and "tasks" in res.output and "bogus" in res.output
    # the press options are the batch commands' grid: quantized KV is one more axis, checked before any work
    res = CliRunner().invoke(app, [*args, "--press", "keydiff", "--kv-bits", "3"])
    assert res.exit_code == 2 and "--kv-bits must be 4 or 8" in res.output
    args[args.index("--out") + 1] = str(tmp_path / "quant")
    with use_tiny_model(monkeypatch):  # head dimension 16: no quantization group divides it
        res = CliRunner().invoke(app, [*args, "--press", "keydiff", "--kv-bits", "16,8"])
    assert res.exit_code == 2 and "--kv-group-size" in res.output and not (tmp_path / "quant").exists()


def test_cli_tasks_writes_what_generate_makes(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from flows.cli import app

    out = tmp_path / "t.parquet"
    args = ["tasks", "--out", str(out), "--model", TINY_NAME, "--lengths", "768", "--tasks", "two_hop,niah_single",
            "--per-task", "1", "--seed", "3"]
    with use_tiny_model(monkeypatch):
        res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert f"{out}: 2 documents, 5 questions" in res.output
    assert pq.read_table(out).to_pylist() == tasks.generate(COUNT, (768,), 1, 3, ("two_hop", "niah_single"))
    with use_tiny_model(monkeypatch):
        res = CliRunner().invoke(app, [*args, "--tasks", "bogus"])
    assert res.exit_code == 2 and "bogus" in res.output
    assert CliRunner().invoke(app, ["tasks", "--out", str(out), "--size", "huge"]).exit_code == 2


def test_suite_pairs_and_labels_rotated_and_plain_keys_apart():
    # --kv-hadamard true,false: two 4-bit configurations of each press, never one pooled row per question
    rows = [{"press": p, "compression_ratio": 0.75, "head_budget": "adaptive", "prefill": "whole", "kv_bits": 4,
             "kv_group_size": 64, "kv_hadamard": h, "task": "niah_single", "length": 4096, "doc_id": "d",
             "question_idx": q, "config_hash": f"{p}{h}", "value": v}
            for p, h, vals in (("nestedkv", True, (1, 1)), ("keydiff", True, (0, 0)),
                               ("nestedkv", False, (0, 1)), ("keydiff", False, (1, 1)))
            for q, v in enumerate(vals)]
    calib = [{"task": "niah_single", "length": 4096, "n": 2, "accuracy": 1.0, "headline": True}]
    heads, _ = suite.headline(rows, calib, ratios=(0.75,))
    got = {h["quant"].hadamard: (h["acc_a"], h["acc_b"], h["better"], h["worse"]) for h in heads}
    assert got == {True: (1.0, 0.0, 2, 0), False: (0.5, 1.0, 0, 1)}
    assert [suite.label(r) for r in rows[::2]] == ["nestedkv adaptive 4-bit", "keydiff adaptive 4-bit",
                                                   "nestedkv adaptive 4-bit plain", "keydiff adaptive 4-bit plain"]
    table = "\n".join(suite.headline_table(heads, 2))
    assert "| whole 4-bit |" in table and "| whole 4-bit plain |" in table and "| keydiff |" in table


def test_suite_colours_follow_the_registry():
    from nestedkv.press import PRESSES

    colours = [suite.colour(p) for p in PRESSES if p != "no_press"]
    assert len(set(colours)) == len(colours) and suite.colour("not a press") == "C9"


def test_headline_pairs_nestedkv_with_every_other_press_in_its_own_modes():
    # kvzip scores with the model, so it has no streaming rows: no streaming pairing against it
    runs = (("nestedkv", "whole", (1, 1, 0)), ("nestedkv", "streaming", (1, 0, 0)), ("keydiff", "whole", (1, 0, 0)),
            ("keydiff", "streaming", (0, 0, 0)), ("kvzip", "whole", (1, 1, 1)), ("expected_attention", "whole", (0, 1, 0)))
    rows = [{"press": p, "compression_ratio": 0.75, "head_budget": "uniform", "prefill": pf, "kv_bits": None,
             "task": "niah_single", "length": 4096, "doc_id": "d", "question_idx": q, "config_hash": p + pf, "value": v}
            for p, pf, vals in runs for q, v in enumerate(vals)]
    calib = [{"task": "niah_single", "length": 4096, "n": 3, "accuracy": 1.0, "headline": True}]
    heads, _ = suite.headline(rows, calib, ratios=(0.75,))
    got = {(h["rival"], h["prefill"]): (h["n"], h["better"], h["worse"], round(h["mean_diff"], 3)) for h in heads}
    assert got == {("keydiff", "whole"): (3, 1, 0, 0.333), ("keydiff", "streaming"): (3, 1, 0, 0.333),
                   ("kvzip", "whole"): (3, 0, 1, -0.333), ("expected_attention", "whole"): (3, 1, 0, 0.333)}
    assert [h["rival"] for h in heads] == ["keydiff", "keydiff", "kvzip", "expected_attention"]  # the registry's order
    table = suite.headline_table(heads, 2)
    assert table[0].startswith("| against |") and sum("| kvzip |" in line for line in table) == 1


def test_accuracy_tables_give_each_press_its_share_of_uncompressed_and_its_cost():
    rows = [{"press": p, "compression_ratio": 0.75, "head_budget": "uniform", "prefill": "whole", "kv_bits": None,
             "task": "niah_single", "length": 4096, "doc_id": "d", "question_idx": q, "config_hash": p, "value": v}
            for p, vals in (("no_press", (1, 1)), ("kvzip", (1, 0))) for q, v in enumerate(vals)]
    calib = [{"task": "niah_single", "length": 4096, "n": 2, "accuracy": 1.0, "headline": True}]
    cost = {(4096, "no_press"): {"prefill_s": 10.0, "compress_s": 0.0, "reference": True},
            (4096, "kvzip"): {"prefill_s": 10.0, "compress_s": 21.0, "reference": False}}
    lines = suite.accuracy_tables(rows, calib, {}, cost=cost)
    header = [c.strip() for c in lines[2].strip("|").split("|")]
    kvzip = dict(zip(header, [c.strip() for c in next(x for x in lines if x.startswith("| kvzip")).strip("|").split("|")]))
    assert kvzip["of uncompressed"] == "0.50" and kvzip["compress s/doc"] == "21.00"
    assert kvzip["compress / prefill"] == "2.10"
