"""Question files of Search-R1 / FlashRAG, and k-question tasks composed from them.

Accepted files: parquet or jsonl rows with a ``question`` and the gold answers under
``golden_answers`` (FlashRAG, Search-R1's raw data), ``answers`` / ``answer``, or
Search-R1's processed ``reward_model.ground_truth.target``. A multi-question task joins k
single questions the way MEM1 builds its multi-objective tasks: k questions drawn without
replacement, asked together, answered together in order.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class QAItem:
    question: str
    answers: tuple[str, ...]


@dataclass
class ReadReport:
    read: int = 0
    skipped: int = 0
    first_error: str | None = None

    def skip(self, where: str, why: str) -> None:
        self.skipped += 1
        if self.first_error is None:
            self.first_error = f"{where}: {why}"


def _as_list(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value if v is not None and str(v).strip()]
    return [str(value)]


def _item(row: dict[str, Any]) -> QAItem:
    question = row.get("question")
    if not isinstance(question, str) or not question.strip():
        raise ValueError("no question")
    answers = _as_list(row.get("golden_answers"))
    if not answers:
        answers = _as_list(row.get("answers")) or _as_list(row.get("answer"))
    if not answers:
        target = ((row.get("reward_model") or {}).get("ground_truth") or {}).get("target")
        answers = _as_list(target)
    if not answers:
        raise ValueError("no golden_answers")
    return QAItem(question.strip(), tuple(a.strip() for a in answers))


def _rows(path: Path) -> Iterator[tuple[str, dict[str, Any] | None, str | None]]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for i, row in enumerate(pq.read_table(path).to_pylist()):
            yield f"row {i}", row, None
        return
    with path.open(encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                yield f"line {lineno}", None, f"not JSON ({exc})"
                continue
            yield (
                f"line {lineno}",
                row if isinstance(row, dict) else None,
                None if isinstance(row, dict) else "not an object",
            )


def read_questions(path: str | Path) -> tuple[list[QAItem], ReadReport]:
    """Read a question file; bad rows are counted in the report, not fatal."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"question file {path} does not exist")
    items: list[QAItem] = []
    report = ReadReport()
    for where, row, error in _rows(path):
        if row is None:
            report.skip(where, error or "not an object")
            continue
        try:
            items.append(_item(row))
            report.read += 1
        except ValueError as exc:
            report.skip(where, str(exc))
    if report.skipped:
        log.warning("%s: skipped %d bad rows (first: %s)", path, report.skipped, report.first_error)
    return items, report


def compose_tasks(
    items: Iterable[QAItem], k: int, count: int | None = None, seed: int = 0
) -> list[tuple[list[str], list[list[str]]]]:
    """k-question tasks (questions, aliases per question), MEM1 style.

    With ``count`` None, every item is used once (shuffled, in chunks of k; a short tail
    is dropped). Otherwise ``count`` tasks, each drawing k distinct items at random.
    """
    pool = list(items)
    if k < 1 or len(pool) < k:
        raise ValueError(f"cannot compose {k}-question tasks from {len(pool)} questions")
    rng = random.Random(seed)
    if count is None:
        rng.shuffle(pool)
        chunks = [pool[i : i + k] for i in range(0, len(pool) - k + 1, k)]
    else:
        chunks = [rng.sample(pool, k) for _ in range(count)]
    return [([it.question for it in chunk], [list(it.answers) for it in chunk]) for chunk in chunks]
