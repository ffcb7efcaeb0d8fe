"""Parquet inputs: valid rows become Documents, bad rows become RowErrors, bad files raise InputError."""

import hashlib

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.documents import Document, InputError, RowError, check_input, load_documents


def write(path, columns, schema=None):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns, schema=schema), path)
    return path


def by_field(errors):
    return {(e.row, e.field): e for e in errors}


def test_valid_rows_with_optional_fields(tmp_path):
    f = write(
        tmp_path / "a.parquet",
        {
            "doc_id": ["d1", "d2"],
            "text": ["First text.", "Second, longer text."],
            "title": ["One", None],
            "questions": [["Q1?", "Q2?"], None],
            "answers": [["A1", "A2"], None],
        },
    )
    docs, errors = load_documents(f)
    assert errors == []
    assert [d.doc_id for d in docs] == ["d1", "d2"]
    d1, d2 = docs
    assert d1.title == "One" and d1.questions == ["Q1?", "Q2?"] and d1.answers == ["A1", "A2"]
    assert d2.title is None and d2.questions is None and d2.answers is None
    assert d2.content_sha256 == hashlib.sha256("Second, longer text.".encode()).hexdigest()
    assert d2.n_chars == len("Second, longer text.")
    assert Document.model_validate(d1.model_dump()) == d1


def test_bad_rows_are_skipped_and_reported(tmp_path):
    f = write(
        tmp_path / "bad.parquet",
        {
            "doc_id": ["ok1", "no-text", "blank", None, "", "ok1", "mismatch", "ok2"],
            "text": ["fine", None, "   \n", "orphan", "empty id", "again", "x", "also fine"],
            "questions": [None, None, None, None, None, None, ["a?", "b?"], ["c?"]],
            "answers": [None, None, None, None, None, None, ["only one"], ["c"]],
        },
    )
    docs, errors = load_documents(f)
    assert [d.doc_id for d in docs] == ["ok1", "ok2"]
    errs = by_field(errors)
    assert set(errs) == {(1, "text"), (2, "text"), (3, "doc_id"), (4, "doc_id"), (5, "doc_id"), (6, "answers")}
    assert errs[1, "text"].doc_id == "no-text" and "missing" in errs[1, "text"].message
    assert "empty" in errs[2, "text"].message
    assert errs[3, "doc_id"].doc_id is None
    dup = errs[5, "doc_id"]
    assert dup.doc_id == "ok1" and "duplicate" in dup.message and "row 0" in dup.message
    assert "1 answers for 2 questions" in errs[6, "answers"].message and errs[6, "answers"].doc_id == "mismatch"
    assert all(e.source == str(f) for e in errors)


def test_wrong_types_are_row_errors(tmp_path):
    f = write(
        tmp_path / "types.parquet",
        {"doc_id": ["n1", "n2"], "text": [12, 34], "questions": ["not a list", "x"]},
    )
    docs, errors = load_documents(f)
    assert docs == []
    assert {(e.row, e.field) for e in errors} == {(0, "text"), (1, "text")}
    assert "int" in errors[0].message and "questions" in errors[0].message

    g = write(tmp_path / "q.parquet", {"doc_id": ["q"], "text": ["t"], "questions": [[1, 2]]})
    docs, errors = load_documents(g)
    assert docs == [] and errors[0].field.startswith("questions")


def test_duplicates_across_files_name_the_first_file(tmp_path):
    write(tmp_path / "in" / "a.parquet", {"doc_id": ["x", "y"], "text": ["1", "2"]})
    b = write(tmp_path / "in" / "b.parquet", {"doc_id": ["z", "x"], "text": ["3", "4"]})
    docs, errors = load_documents(tmp_path / "in")
    assert [d.doc_id for d in docs] == ["x", "y", "z"]
    (err,) = errors
    assert (err.source, err.row, err.doc_id) == (str(b), 1, "x")
    assert "a.parquet row 0" in err.message


def test_glob_and_folder_inputs(tmp_path):
    write(tmp_path / "d" / "p1.parquet", {"doc_id": ["a"], "text": ["A"]})
    write(tmp_path / "d" / "sub" / "p2.parquet", {"doc_id": ["b"], "text": ["B"]})
    write(tmp_path / "d" / "other.parquet", {"doc_id": ["c"], "text": ["C"]})
    (tmp_path / "d" / "notes.txt").write_text("not parquet")
    docs, _ = load_documents(tmp_path / "d")
    assert sorted(d.doc_id for d in docs) == ["a", "b", "c"]
    docs, _ = load_documents(str(tmp_path / "d" / "p*.parquet"))
    assert [d.doc_id for d in docs] == ["a"]
    docs, _ = load_documents(str(tmp_path / "d" / "**" / "p*.parquet"))
    assert sorted(d.doc_id for d in docs) == ["a", "b"]


def test_kvpress_rows_sharing_a_context_become_one_document(tmp_path):
    ctx_a, ctx_b = "The cat sat on the mat.", "Rain fell all day."
    f = write(
        tmp_path / "kv.parquet",
        {
            "context": [ctx_a, ctx_b, ctx_a, None, "  "],
            "question": ["Who sat?", "What fell?", "Where?", "Orphan?", "Blank?"],
            "answer": ["the cat", "rain", "the mat", "x", "y"],
        },
    )
    docs, errors = load_documents(f)
    assert [(e.row, e.field) for e in errors] == [(3, "context"), (4, "context")]
    a, b = docs
    assert a.doc_id == "ctx-" + hashlib.sha256(ctx_a.encode()).hexdigest()[:12]
    assert a.text == ctx_a and a.questions == ["Who sat?", "Where?"] and a.answers == ["the cat", "the mat"]
    assert b.questions == ["What fell?"] and b.answers == ["rain"]

    # Parquet columns are typed as a whole, so a wrong type fails every row of that column.
    g = write(tmp_path / "kv2.parquet", {"context": ["C", "C"], "question": [1, 2]})
    docs, errors = load_documents(g)
    assert docs == [] and [(e.row, e.field) for e in errors] == [(0, "question"), (1, "question")]
    assert "int" in errors[0].message


def test_kvpress_ids_and_missing_answers(tmp_path):
    f = write(
        tmp_path / "kv.parquet",
        {
            "id": ["doc-1", "doc-1", "doc-2"],
            "context": ["C one", "C one", "C two"],
            "question": ["q1", "q2", "q3"],
            "answer": ["a1", None, "a3"],
        },
    )
    docs, errors = load_documents(f)
    assert errors == []
    assert [(d.doc_id, d.questions, d.answers) for d in docs] == [
        ("doc-1", ["q1", "q2"], None),  # one gold answer missing: none kept, so indices cannot shift
        ("doc-2", ["q3"], ["a3"]),
    ]


def test_missing_path_and_empty_glob(tmp_path):
    with pytest.raises(InputError, match="nope.parquet"):
        load_documents(tmp_path / "nope.parquet")
    with pytest.raises(InputError, match=r"\*\.parquet"):
        check_input(str(tmp_path / "*.parquet"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="empty"):
        check_input(tmp_path / "empty")


def test_corrupt_parquet(tmp_path):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"this is not parquet at all")
    with pytest.raises(InputError, match="bad.parquet") as info:
        check_input(bad)
    assert "\n" not in str(info.value)
    with pytest.raises(InputError, match="bad.parquet"):
        load_documents(bad)

    # A valid footer over damaged column data: only reading rows finds it.
    good = write(tmp_path / "t.parquet", {"doc_id": ["a"] * 50, "text": ["x" * 1000 + str(i) for i in range(50)]})
    data = bytearray(good.read_bytes())
    for i in range(8, len(data) // 2):
        data[i] = 0xFF
    trunc = tmp_path / "damaged.parquet"
    trunc.write_bytes(bytes(data))
    check_input(trunc)
    with pytest.raises(InputError, match="damaged.parquet") as info:
        check_input(trunc, pages=True)  # the early check can read the pages too
    assert "\n" not in str(info.value)
    with pytest.raises(InputError, match="damaged.parquet"):
        load_documents(trunc)


def test_file_without_text_column(tmp_path):
    f = write(tmp_path / "cols.parquet", {"doc_id": ["a"], "body": ["b"]})
    with pytest.raises(InputError, match="cols.parquet.*'text'"):
        check_input(f)
    g = write(tmp_path / "noid.parquet", {"text": ["b"]})
    with pytest.raises(InputError, match="noid.parquet.*doc_id"):
        load_documents(g)


def test_a_bad_file_fails_before_any_rows_are_read(tmp_path):
    write(tmp_path / "in" / "a.parquet", {"doc_id": ["a"], "text": ["A"]})
    write(tmp_path / "in" / "b.parquet", {"body": ["B"]})
    with pytest.raises(InputError, match="b.parquet"):
        check_input(tmp_path / "in")
    with pytest.raises(InputError, match="b.parquet"):
        load_documents(tmp_path / "in")


def test_row_numbers_span_batches(tmp_path, monkeypatch):
    import pipeline.documents as documents

    monkeypatch.setattr(documents, "BATCH_ROWS", 3)
    ids = [f"d{i}" for i in range(10)]
    texts = ["t"] * 10
    texts[7] = ""
    f = write(tmp_path / "many.parquet", {"doc_id": ids, "text": texts})
    docs, errors = load_documents(f)
    assert len(docs) == 9
    assert errors == [RowError(str(f), 7, "d7", "text", "must not be empty")]


BAD_UTF8 = (b"\xff\xfe", b"ok \xed\xa0\x80 cesu")  # stray bytes; a CESU-8 encoded surrogate


def raw_strings(values, large=False):
    """A string array holding exactly these bytes (pyarrow refuses to build invalid UTF-8 any other way)."""
    offsets, data = [0], b""
    for v in values:
        data += v
        offsets.append(len(data))
    off_type = pa.int64() if large else pa.int32()
    return pa.Array.from_buffers(pa.large_string() if large else pa.string(), len(values),
                                 [None, pa.array(offsets, off_type).buffers()[1], pa.py_buffer(data)])


def raw_string_lists(lists):
    flat = raw_strings([v for lst in lists for v in lst])
    offsets = [0]
    for lst in lists:
        offsets.append(offsets[-1] + len(lst))
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), flat)


@pytest.mark.parametrize("bad", BAD_UTF8)
def test_invalid_utf8_in_a_native_column_is_a_bad_row(tmp_path, bad):
    f = tmp_path / "u.parquet"
    pq.write_table(pa.table({
        "doc_id": raw_strings([b"d0", b"d1", b"d2", bad, b"d4", b"d5"]),
        "text": raw_strings([b"good zero", bad, b"good two", b"good three", b"good four", b"good five"]),
        "title": raw_strings([b"T", b"T", bad, b"T", b"T", b"T"]),
        "questions": raw_string_lists([[b"q?"], [b"q?"], [b"q?"], [b"q?"], [b"q?", bad], [b"q?"]]),
        "answers": raw_string_lists([[b"a"], [b"a"], [b"a"], [b"a"], [b"a", b"b"], [bad]]),
    }), f)
    assert check_input(f) == [f]
    assert check_input(f, pages=True) == [f]  # pages are read, values are not decoded
    docs, errors = load_documents(f)
    assert [d.doc_id for d in docs] == ["d0"]
    assert docs[0].text == "good zero" and docs[0].questions == ["q?"]
    assert [(e.row, e.doc_id, e.field, e.message) for e in errors] == [
        (1, "d1", "text", "not valid UTF-8"),
        (2, "d2", "title", "not valid UTF-8"),
        (3, None, "doc_id", "not valid UTF-8"),
        (4, "d4", "questions.1", "not valid UTF-8"),
        (5, "d5", "answers.0", "not valid UTF-8"),
    ]
    assert all(e.source == str(f) for e in errors)


def test_invalid_utf8_spans_batches_and_large_strings(tmp_path, monkeypatch):
    import pipeline.documents as documents

    monkeypatch.setattr(documents, "BATCH_ROWS", 2)
    f = tmp_path / "big.parquet"
    texts = [b"t%d" % i for i in range(7)]
    texts[5] = BAD_UTF8[1]
    pq.write_table(pa.table({"doc_id": [f"d{i}" for i in range(7)], "text": raw_strings(texts, large=True)}), f)
    docs, errors = load_documents(f)
    assert [d.doc_id for d in docs] == ["d0", "d1", "d2", "d3", "d4", "d6"]
    assert errors == [RowError(str(f), 5, "d5", "text", "not valid UTF-8")]


@pytest.mark.parametrize("column", ["context", "question", "answer", "id"])
def test_invalid_utf8_in_a_kvpress_column_is_a_bad_row(tmp_path, column):
    cols = {
        "id": [b"k1", b"k1", b"k2"],
        "context": [b"Context one.", b"Context one.", b"Context two."],
        "question": [b"q1", b"q2", b"q3"],
        "answer": [b"a1", b"a2", b"a3"],
    }
    cols[column][1] = BAD_UTF8[0]
    f = tmp_path / "kv.parquet"
    pq.write_table(pa.table({k: raw_strings(v) for k, v in cols.items()}), f)
    docs, errors = load_documents(f)
    assert [(e.row, e.field, e.message) for e in errors] == [(1, column, "not valid UTF-8")]
    assert errors[0].doc_id == (None if column == "id" else "k1")
    assert [(d.doc_id, d.questions) for d in docs] == [("k1", ["q1"]), ("k2", ["q3"])]


def _dictionary(values):
    return pa.DictionaryArray.from_arrays(pa.array(range(len(values)), pa.int32()), raw_strings(values))


LAYOUTS = {  # every Arrow layout a Parquet string column can come back in
    "string": raw_strings,
    "large_string": lambda v: raw_strings(v, large=True),
    "string_view": lambda v: raw_strings(v).cast(pa.string_view()),
    "dictionary": _dictionary,
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("column", ["text", "doc_id", "title"])
def test_invalid_utf8_in_every_string_layout_is_a_bad_row(tmp_path, layout, column):
    cols = {"doc_id": [b"d0", b"d1", b"d2"], "text": [b"zero", b"one", b"two"], "title": [b"T0", b"T1", b"T2"]}
    cols[column][1] = BAD_UTF8[0]
    f = tmp_path / "l.parquet"
    pq.write_table(pa.table({k: LAYOUTS[layout](v) if k == column else raw_strings(v) for k, v in cols.items()}), f)
    read_back = pq.read_schema(f).field(column).type
    assert read_back == LAYOUTS[layout]([b"x"]).type  # the layout survives the file, so the loader meets it
    docs, errors = load_documents(f)
    assert [d.doc_id for d in docs] == ["d0", "d2"] and docs[1].text == "two" and docs[1].title == "T2"
    assert errors == [RowError(str(f), 1, None if column == "doc_id" else "d1", column, "not valid UTF-8")]


def test_invalid_utf8_in_a_later_chunk_names_its_row(tmp_path, monkeypatch):
    """Row groups of one row each, read in batches smaller than the file: the row number counts across them."""
    import pipeline.documents as documents

    monkeypatch.setattr(documents, "BATCH_ROWS", 2)
    texts = [b"t%d" % i for i in range(5)]
    texts[3] = BAD_UTF8[1]
    table = pa.table({"doc_id": [f"d{i}" for i in range(5)],
                      "text": pa.chunked_array([_dictionary(texts[:2]), _dictionary(texts[2:])])})
    f = tmp_path / "c.parquet"
    pq.write_table(table, f, row_group_size=1)
    assert pq.ParquetFile(f).num_row_groups == 5
    docs, errors = load_documents(f)
    assert [d.doc_id for d in docs] == ["d0", "d1", "d2", "d4"]
    assert errors == [RowError(str(f), 3, "d3", "text", "not valid UTF-8")]


def test_dictionary_encoded_questions_with_invalid_utf8(tmp_path):
    flat = pa.DictionaryArray.from_arrays(pa.array([0, 1, 0, 2], pa.int32()), raw_strings([b"q?", b"r?", b"\xfe"]))
    questions = pa.ListArray.from_arrays(pa.array([0, 2, 4], pa.int32()), flat)
    f = tmp_path / "q.parquet"
    pq.write_table(pa.table({"doc_id": ["d0", "d1"], "text": ["zero", "one"], "questions": questions}), f)
    docs, errors = load_documents(f)
    assert [(d.doc_id, d.questions) for d in docs] == [("d0", ["q?", "r?"])]
    assert errors == [RowError(str(f), 1, "d1", "questions.1", "not valid UTF-8")]


def test_a_value_arrow_cannot_convert_is_a_bad_row_not_a_crash():
    from pipeline.documents import _batch_records

    # list views cannot be cast to bytes: their values go one by one, and the bad one is named
    questions = pa.ListViewArray.from_arrays(pa.array([0, 1], pa.int32()), pa.array([1, 1], pa.int32()),
                                             raw_strings([b"q?", b"\xff"]))
    batch = pa.record_batch({"doc_id": ["d0", "d1"], "text": ["zero", "one"], "questions": questions})
    (rec0, bad0), (rec1, bad1) = _batch_records(batch)
    assert rec0["questions"] == ["q?"] and bad0 is None
    assert bad1[0] == "questions" and "cannot be read" in bad1[1] and rec1["doc_id"] == "d1"


@pytest.mark.parametrize("text", ["\u200b\u200c\u2060", "\ufeff", "\x01\x02\x7f", " \u200b\n\ufeff\t"])
def test_a_text_of_only_invisible_characters_is_a_bad_row(tmp_path, text):
    f = write(tmp_path / "a.parquet", {"doc_id": ["d0", "d1"], "text": ["Visible text.", text]})
    docs, errors = load_documents(f)
    assert [d.doc_id for d in docs] == ["d0"]
    assert [(e.row, e.field) for e in errors] == [(1, "text")] and "must not be empty" in errors[0].message


def test_visible_text_with_invisible_characters_is_kept(tmp_path):
    f = write(tmp_path / "a.parquet", {"doc_id": ["d0"], "text": ["\ufeffA\u200b"]})
    docs, errors = load_documents(f)
    assert errors == [] and docs[0].text == "\ufeffA\u200b"  # kept as given: the content hash is of the input


def test_a_fifo_is_refused_without_reading_it(tmp_path):
    import os

    fifo = tmp_path / "x.parquet"
    os.mkfifo(fifo)
    with pytest.raises(InputError, match="not a regular file"):
        check_input(fifo)


def test_a_path_with_tilde_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    write(tmp_path / "a.parquet", {"doc_id": ["d0"], "text": ["Text."]})
    docs, errors = load_documents("~/a.parquet")
    assert [d.doc_id for d in docs] == ["d0"] and errors == []
