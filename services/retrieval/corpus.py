"""Passages: reading wiki-18 style jsonl, and the document store an index serves from.

A corpus line is ``{"id": "0", "contents": "\\"Title\\"\\nbody"}`` (Search-R1, FlashRAG);
``{"id", "title", "text"}`` is accepted too and stored in the same convention. A bad
line (not JSON, not an object, no id, no text) is counted and skipped, never fatal.

The store keeps contents (and ids, unless every id is its row number, as in wiki-18)
as one UTF-8 blob plus an offsets array, so a 21M-passage corpus is two memory-mapped
files instead of millions of Python strings.
"""

from __future__ import annotations

import hashlib
import json
import logging
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mempo.api.retrieval import Document

log = logging.getLogger(__name__)

MAX_EXAMPLES = 5


@dataclass
class CorpusReport:
    """What reading a corpus file found."""

    lines: int = 0
    passages: int = 0
    bad_lines: int = 0
    bad_examples: list[str] = field(default_factory=list)
    sha256: str = ""

    def bad(self, line_number: int, reason: str) -> None:
        self.bad_lines += 1
        if len(self.bad_examples) < MAX_EXAMPLES:  # the first few are kept and logged
            self.bad_examples.append(f"line {line_number}: {reason}")
            log.warning("corpus line %d skipped: %s", line_number, reason)


def parse_passage(raw: bytes) -> tuple[str, str] | str:
    """(id, contents) of one jsonl line, or the reason it is not a passage."""
    try:
        record: Any = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        return f"not valid JSON ({exc})"
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not an object"
    doc_id = record.get("id")
    if isinstance(doc_id, bool) or not isinstance(doc_id, str | int) or str(doc_id) == "":
        return "no id (a string or an integer)"
    contents = record.get("contents")
    if contents is None and isinstance(record.get("text"), str):
        title = record.get("title")
        contents = f'"{title}"\n{record["text"]}' if isinstance(title, str) else record["text"]
    if not isinstance(contents, str) or not contents.strip():
        return 'no "contents" text'
    return str(doc_id), contents


def read_corpus(
    path: Path, report: CorpusReport, progress: Callable[[int], None] | None = None
) -> Iterator[tuple[str, str]]:
    """Yield (id, contents) per good line; ``report`` fills in as the file is read
    (``progress`` gets the bytes consumed by each line)."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            digest.update(raw)
            report.lines = number
            if progress is not None:
                progress(len(raw))
            if not raw.strip():
                continue
            parsed = parse_passage(raw)
            if isinstance(parsed, str):
                report.bad(number, parsed)
                continue
            report.passages += 1
            yield parsed
    report.sha256 = digest.hexdigest()


class StringColumn:
    """Strings as one UTF-8 blob (B,) and offsets (n+1,)."""

    def __init__(self, blob: np.ndarray, offsets: np.ndarray) -> None:
        self.blob = blob
        self.offsets = offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, row: int) -> str:
        start, end = int(self.offsets[row]), int(self.offsets[row + 1])
        return bytes(self.blob[start:end]).decode("utf-8")

    @classmethod
    def from_strings(cls, values: Sequence[str]) -> StringColumn:
        encoded = [v.encode("utf-8") for v in values]
        offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(e) for e in encoded], out=offsets[1:])
        return cls(np.frombuffer(b"".join(encoded), dtype=np.uint8), offsets)

    @classmethod
    def load(cls, directory: Path, name: str, mmap: bool) -> StringColumn:
        offsets = np.load(directory / f"{name}.offsets.npy", mmap_mode="r" if mmap else None)
        blob_path = directory / f"{name}.bin"
        if blob_path.stat().st_size == 0:
            return cls(np.zeros(0, dtype=np.uint8), offsets)
        blob = (
            np.memmap(blob_path, dtype=np.uint8, mode="r")
            if mmap
            else np.fromfile(blob_path, dtype=np.uint8)
        )
        return cls(blob, offsets)


class DocumentStore:
    """Row -> Search-R1 document ``{"id", "contents"}``."""

    def __init__(self, contents: StringColumn, ids: StringColumn | None = None) -> None:
        self.contents = contents
        self.ids = ids  # None: the id of row r is str(r)

    def __len__(self) -> int:
        return len(self.contents)

    def document(self, row: int) -> Document:
        doc_id = self.ids[row] if self.ids is not None else str(row)
        return Document(id=doc_id, contents=self.contents[row])

    @classmethod
    def from_passages(cls, passages: Sequence[dict[str, str]]) -> DocumentStore:
        ids = [str(p["id"]) for p in passages]
        contents = StringColumn.from_strings([p["contents"] for p in passages])
        rows_are_ids = all(doc_id == str(i) for i, doc_id in enumerate(ids))
        return cls(contents, None if rows_are_ids else StringColumn.from_strings(ids))

    @classmethod
    def load(cls, directory: Path, mmap: bool = True) -> DocumentStore:
        contents = StringColumn.load(directory, "contents", mmap)
        has_ids = (directory / "ids.offsets.npy").exists()
        return cls(contents, StringColumn.load(directory, "ids", mmap) if has_ids else None)


class DocumentWriter:
    """Stream passages into a store folder (``contents.bin`` + offsets, ``ids.*`` if needed)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._contents = (directory / "contents.bin").open("wb")
        self._ids = (directory / "ids.bin").open("wb")
        self._content_ends = array("q")  # end offset of each passage's bytes
        self._id_ends = array("q")
        self._sizes = [0, 0]
        self.rows_are_ids = True

    def add(self, doc_id: str, contents: str) -> None:
        self.rows_are_ids = self.rows_are_ids and doc_id == str(len(self._content_ends))
        for slot, (handle, ends, text) in enumerate(
            ((self._contents, self._content_ends, contents), (self._ids, self._id_ends, doc_id))
        ):
            data = text.encode("utf-8")
            handle.write(data)
            self._sizes[slot] += len(data)
            ends.append(self._sizes[slot])

    def close(self) -> int:
        """Finish the files; returns the number of passages written."""
        self._contents.close()
        self._ids.close()
        for name, ends in (("contents", self._content_ends), ("ids", self._id_ends)):
            offsets = np.zeros(len(ends) + 1, dtype=np.int64)
            offsets[1:] = np.frombuffer(ends, dtype=np.int64)
            np.save(self.directory / f"{name}.offsets.npy", offsets)
        if self.rows_are_ids:
            (self.directory / "ids.bin").unlink()
            (self.directory / "ids.offsets.npy").unlink()
        return len(self._content_ends)
