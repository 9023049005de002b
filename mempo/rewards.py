"""Outcome rewards: SQuAD-style exact match and F1, multi-question answers.

A multi-question task's answer is the sub-answers joined by ";" in question order; the
gold is one alias list per question. ``outcome_reward`` is 1 only when the format is
valid and every sub-answer matches (docs/architecture.md, 'The algorithm'); "fraction"
and "f1" are the partial-credit options.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence
from typing import Literal

RewardKind = Literal["em", "fraction", "f1"]

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, drop punctuation and articles, squeeze spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(prediction: str, golds: Sequence[str]) -> bool:
    pred = normalize_answer(prediction)
    return any(pred == normalize_answer(g) for g in golds)


def _f1(prediction: str, gold: str) -> float:
    pred_tokens, gold_tokens = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not pred_tokens or not gold_tokens:
        return float(pred_tokens == gold_tokens)
    common = Counter(pred_tokens) & Counter(gold_tokens)
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(pred_tokens), overlap / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str, golds: Sequence[str]) -> float:
    """Token F1 against the best gold alias."""
    return max((_f1(prediction, g) for g in golds), default=0.0)


def split_answers(answer_text: str, k: int) -> list[str]:
    """Split a joined answer on ";" into exactly k parts (missing parts are empty)."""
    parts = [p.strip() for p in answer_text.split(";")] if k > 1 else [answer_text.strip()]
    if len(parts) > k:  # extra separators: keep the first k-1, join the rest into the last
        parts = [*parts[: k - 1], "; ".join(parts[k - 1 :])]
    return parts + [""] * (k - len(parts))


def multi_exact_match(answer_text: str, answers: Sequence[Sequence[str]]) -> list[bool]:
    """Per question: does its sub-answer match one of its aliases?"""
    parts = split_answers(answer_text, len(answers))
    return [exact_match(p, golds) for p, golds in zip(parts, answers, strict=True)]


def multi_f1(answer_text: str, answers: Sequence[Sequence[str]]) -> list[float]:
    parts = split_answers(answer_text, len(answers))
    return [f1_score(p, golds) for p, golds in zip(parts, answers, strict=True)]


def is_correct(answer_text: str | None, answers: Sequence[Sequence[str]]) -> bool:
    """All sub-answers right."""
    return answer_text is not None and all(multi_exact_match(answer_text, answers))


def outcome_reward(
    answer_text: str | None,
    answers: Sequence[Sequence[str]],
    format_ok: bool,
    kind: RewardKind = "em",
) -> float:
    """R_T: 1 when the format is valid and every sub-answer matches (kind "em"), else 0.

    "fraction": the share of sub-answers that match; "f1": the mean sub-answer F1. An
    invalid format or a missing answer always gives 0.
    """
    if not format_ok or answer_text is None:
        return 0.0
    if kind == "em":
        return float(all(multi_exact_match(answer_text, answers)))
    if kind == "fraction":
        matches = multi_exact_match(answer_text, answers)
        return sum(matches) / len(matches)
    if kind == "f1":
        scores = multi_f1(answer_text, answers)
        return sum(scores) / len(scores)
    raise ValueError(f"unknown reward kind {kind!r} (em, fraction, f1)")
