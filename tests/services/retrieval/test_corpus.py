"""services/retrieval/corpus.py: parsing corpus lines, the document store's files."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from services.retrieval.corpus import (
    CorpusReport,
    DocumentStore,
    DocumentWriter,
    parse_passage,
    read_corpus,
)
from tests.services.retrieval.conftest import write_corpus


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (b'{"id": "0", "contents": "\\"Evan\\"\\nEvan is."}', ("0", '"Evan"\nEvan is.')),
        (b'{"id": 7, "contents": "x"}', ("7", "x")),
        (b'{"id": "a", "title": "T", "text": "body"}', ("a", '"T"\nbody')),
        (b'{"id": "a", "text": "body"}', ("a", "body")),
    ],
)
def test_good_lines(line: bytes, expected: tuple[str, str]) -> None:
    assert parse_passage(line) == expected


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        (b'{"id": "0", "contents": "unterminated', "not valid JSON"),
        (b"[1, 2]", "a JSON list"),
        (b'{"contents": "x"}', "no id"),
        (b'{"id": true, "contents": "x"}', "no id"),
        (b'{"id": "1"}', 'no "contents"'),
        (b'{"id": "1", "contents": "   "}', 'no "contents"'),
        (b'{"id": "1", "contents": 5}', 'no "contents"'),
        (b"\xff\xfe", "not valid JSON"),
    ],
)
def test_bad_lines_say_why(line: bytes, reason: str) -> None:
    result = parse_passage(line)
    assert isinstance(result, str) and reason in result


def test_read_corpus_counts_bad_lines_and_hashes_the_file(tmp_path: Path) -> None:
    passages = [{"id": str(i), "contents": f'"T{i}"\nbody {i}'} for i in range(6)]
    path = write_corpus(tmp_path / "c.jsonl", passages, broken={2: "{oops", 4: ""})
    report = CorpusReport()
    seen: list[int] = []
    docs = list(read_corpus(path, report, progress=seen.append))
    assert docs == [(p["id"], p["contents"]) for p in passages]
    assert (report.passages, report.bad_lines, report.lines) == (6, 1, 8)  # blank: not bad
    assert report.bad_examples == [report.bad_examples[0]] and "line 3" in report.bad_examples[0]
    assert report.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert sum(seen) == path.stat().st_size


@pytest.mark.parametrize("mmap", [True, False])
def test_store_round_trip_keeps_ids_and_unicode(tmp_path: Path, mmap: bool) -> None:
    docs = [("doc-a", '"Zoë"\nZoë lives in Kraków.'), ("17", '"T"\n'), ("b", '"日本"\n東京')]
    writer = DocumentWriter(tmp_path / "docs")
    for doc_id, contents in docs:
        writer.add(doc_id, contents)
    assert writer.close() == 3
    store = DocumentStore.load(tmp_path / "docs", mmap=mmap)
    assert len(store) == 3
    assert [(d.id, d.contents) for d in map(store.document, range(3))] == docs


def test_row_ids_are_not_stored(tmp_path: Path) -> None:
    writer = DocumentWriter(tmp_path / "docs")
    for i in range(4):
        writer.add(str(i), f"passage {i}")
    writer.close()
    assert not (tmp_path / "docs" / "ids.bin").exists()
    store = DocumentStore.load(tmp_path / "docs")
    assert store.document(3).model_dump() == {"id": "3", "contents": "passage 3"}


def test_store_from_passages() -> None:
    store = DocumentStore.from_passages(
        [{"id": "x", "contents": "a"}, {"id": "y", "contents": "b"}]
    )
    assert store.ids is not None and store.document(1).id == "y"
    rows = DocumentStore.from_passages([{"id": "0", "contents": "a"}])
    assert rows.ids is None and rows.document(0).id == "0"
