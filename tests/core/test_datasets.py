"""Search-R1 / FlashRAG question files and MEM1-style task composition."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mempo.datasets import QAItem, compose_tasks, read_questions


def test_jsonl_with_bad_lines(tmp_path: Path) -> None:
    path = tmp_path / "nq.jsonl"
    path.write_text(
        "\n".join(
            [
                json.dumps({"id": "1", "question": "who wrote x?", "golden_answers": ["A", "B"]}),
                "{broken",
                json.dumps({"question": "no answers"}),
                json.dumps({"question": "q3", "answer": "c"}),
                json.dumps(["not", "an", "object"]),
                "",
            ]
        )
    )
    items, report = read_questions(path)
    assert items == [QAItem("who wrote x?", ("A", "B")), QAItem("q3", ("c",))]
    assert (report.read, report.skipped) == (2, 3) and report.first_error and "line 2" in report.first_error


def test_search_r1_parquet(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "question": ["q1", "q2"],
            "golden_answers": [["a1"], ["b1", "b2"]],
            "reward_model": [{"ground_truth": {"target": ["a1"]}}, {"ground_truth": {"target": ["b1"]}}],
        }
    )
    pq.write_table(table, tmp_path / "train.parquet")
    items, report = read_questions(tmp_path / "train.parquet")
    assert [i.answers for i in items] == [("a1",), ("b1", "b2")] and report.skipped == 0
    pq.write_table(pa.table({"question": ["q"], "reward_model": [{"ground_truth": {"target": ["t"]}}]}), tmp_path / "p.parquet")
    assert read_questions(tmp_path / "p.parquet")[0][0].answers == ("t",)


def test_compose_tasks() -> None:
    items = [QAItem(f"q{i}", (f"a{i}",)) for i in range(10)]
    every = compose_tasks(items, 3, seed=1)
    assert len(every) == 3 and len({q for qs, _ in every for q in qs}) == 9
    for questions, answers in every:
        assert [f"a{q[1:]}" for q in questions] == [a[0] for a in answers]
    drawn = compose_tasks(items, 4, count=7, seed=2)
    assert len(drawn) == 7 and all(len(set(qs)) == 4 for qs, _ in drawn)
    assert compose_tasks(items, 4, count=7, seed=2) == drawn
    with pytest.raises(ValueError):
        compose_tasks(items[:2], 3)
    with pytest.raises(FileNotFoundError):
        read_questions("/nonexistent.jsonl")
