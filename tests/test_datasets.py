"""The committed Austen samples in data/: shape, planted facts, and that the build script reproduces them."""

import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

DATA = Path(__file__).resolve().parents[1] / "data"
FILES = {"sample_batch": (800, 1500), "eval_set": (1250, 1550)}


def rows(name: str) -> list[dict]:
    return pq.read_table(DATA / f"{name}.parquet").to_pylist()


@pytest.mark.parametrize("name", FILES)
def test_schema_ids_and_word_counts(name):
    table = pq.read_table(DATA / f"{name}.parquet")
    for col in ("doc_id", "title", "text"):
        assert table.schema.field(col).type == pa.string()
    for col in ("questions", "answers"):
        assert table.schema.field(col).type == pa.list_(pa.string())
    ids = table["doc_id"].to_pylist()
    assert all(ids) and len(set(ids)) == len(ids)
    lo, hi = FILES[name]
    for r in table.to_pylist():
        assert lo <= len(r["text"].split()) <= hi, r["doc_id"]
        assert r["title"]


@pytest.mark.parametrize("name", FILES)
def test_questions_and_answers_are_planted(name):
    for r in rows(name):
        assert len(r["questions"]) == len(r["answers"]) == 2, r["doc_id"]
        assert all(q.endswith("?") for q in r["questions"])
        for a in r["answers"]:
            # Exactly once: the planted sentence is the only place the gold answer can come from.
            assert a and r["text"].count(a) == 1, (r["doc_id"], a)


def test_sample_batch_has_five_documents_from_different_chapters():
    assert len(rows("sample_batch")) == 5
    assert len({r["doc_id"][:2] for r in rows("sample_batch")}) >= 4  # spread over the novels


def test_eval_set_depths_and_kinds():
    docs = rows("eval_set")
    assert len(docs) >= 18
    assert {r["doc_id"][:2] for r in docs} == {"pp", "ss", "na", "mp"}
    assert len({k for r in docs for k in r["fact_kinds"]}) >= 3
    for r in docs:
        text = r["text"]
        assert len(r["fact_depths"]) == len(r["fact_kinds"]) == 2
        for depth, answer in zip(r["fact_depths"], r["answers"]):
            assert 0.0 <= depth < 1.0
            start = round(depth * len(text))  # the planted sentence starts here
            sentence = text[start:text.index(".", start) + 1]
            assert answer in sentence, (r["doc_id"], sentence)
            assert start == 0 or (text[start - 1] in " \n" and text[start - 2] in '.!?"\n'), (r["doc_id"], sentence)


def test_missing_novels_folder_is_a_one_line_error(tmp_path):
    proc = subprocess.run([sys.executable, str(DATA / "build_datasets.py"), "--austen", str(tmp_path / "none"),
                           "--out", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "--austen" in proc.stderr


def test_rebuild_is_byte_identical(tmp_path):
    """From the novels the package ships (the default --austen)."""
    subprocess.run([sys.executable, str(DATA / "build_datasets.py"), "--out", str(tmp_path)], check=True,
                   capture_output=True)
    for name in FILES:
        built, committed = tmp_path / f"{name}.parquet", DATA / f"{name}.parquet"
        assert pq.read_table(built).equals(pq.read_table(committed)), name
        # Parquet files record the writer's version, so bytes only match under the pyarrow that wrote them.
        if pq.read_metadata(built).created_by != pq.read_metadata(committed).created_by:
            pytest.skip(f"content equal; bytes not comparable: committed with {pq.read_metadata(committed).created_by}")
        assert built.read_bytes() == committed.read_bytes(), name
