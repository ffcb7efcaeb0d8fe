"""The contract every registered suite task keeps (``pipeline.tasks.kinds``): a new task is a module there and
its own test; this file holds it to the rules every document of the suite follows."""

import random

import pyarrow.parquet as pq
import pytest
from tiny import ByteTokenizer

from pipeline import tasks
from pipeline.documents import load_documents
from pipeline.tasks.plans import Plan, Room, task

LENGTH = 1024
COUNT = tasks.token_counter(ByteTokenizer())


@pytest.fixture(scope="module", params=list(tasks.KINDS))
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def docs(kind):
    return tasks.generate(COUNT, lengths=(LENGTH,), per_task=2, seed=11, tasks=[kind])


def test_documents_are_seeded_sized_and_in_the_schema(kind, docs, tmp_path):
    assert docs == tasks.generate(COUNT, lengths=(LENGTH,), per_task=2, seed=11, tasks=[kind])
    assert [d["text"] for d in tasks.generate(COUNT, (LENGTH,), 2, 12, [kind])] != [d["text"] for d in docs]
    assert {d["task"] for d in docs} == {kind} and len({d["doc_id"] for d in docs}) == 2
    path = tasks.write(docs, tmp_path / "t.parquet")
    assert pq.read_table(path).schema.equals(tasks.SCHEMA)
    loaded, errors = load_documents(path)
    assert not errors and len(loaded) == 2
    for d in docs:
        assert d["n_tokens"] == COUNT(d["text"]) and 0.95 * LENGTH <= d["n_tokens"] <= LENGTH, d["doc_id"]


def test_every_question_has_its_answer_in_the_text(docs):
    for d in docs:
        n = len(d["questions"])
        assert n >= 1 and len(d["answers"]) == len(d["parts"]) == len(d["kinds"]) == len(d["evidence"]) == n
        assert d["answers"] == [", ".join(p) for p in d["parts"]]
        for parts in d["parts"]:
            assert parts and all(p in d["text"] for p in parts), (d["doc_id"], parts)


def test_the_planner_takes_a_room_and_is_registered_once(kind):
    planner = tasks.KINDS[kind].plan
    plan = planner(random.Random(0), Room(LENGTH, ["alpha", "gamma"] * 200, COUNT))
    assert isinstance(plan, Plan) and plan.questions
    with pytest.raises(ValueError, match="registered twice"):
        task(kind, rank=0)(planner)


def test_the_suite_runs_the_suite_tasks_in_rank_order():
    ranks = [tasks.KINDS[t].rank for t in tasks.TASKS]
    assert ranks == sorted(ranks) and set(tasks.TASKS) <= set(tasks.KNOWN)
    with pytest.raises(ValueError, match="unknown \\['nope'\\]"):
        tasks.check_tasks(["niah_single", "nope"])


def test_the_suite_calibrates_any_registered_task_in_rank_order():
    """A task outside the suite's default set (niah_middle) may still be asked for: the suite orders it by rank."""
    from pipeline.suite.scores import calibration

    rows = [{"press": "no_press", "task": t, "length": 1024, "value": 1.0} for t in ("niah_middle", "niah_single")]
    assert [c["task"] for c in calibration(rows, 0.5)] == ["niah_single", "niah_middle"]
