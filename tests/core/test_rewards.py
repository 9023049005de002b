"""Rewards: SQuAD normalisation, aliases, multi-question answers, outcome reward."""

from __future__ import annotations

import pytest

from mempo.rewards import (
    exact_match,
    f1_score,
    is_correct,
    multi_exact_match,
    normalize_answer,
    outcome_reward,
    split_answers,
)


@pytest.mark.parametrize(
    ("raw", "norm"),
    [
        ("The Eiffel Tower!", "eiffel tower"),
        ("  a   Cat, an  apple ", "cat apple"),
        ("Theory", "theory"),  # "the" only as a whole word
        ("U.S.A.", "usa"),
        ("", ""),
        ("Mirath\n", "mirath"),
    ],
)
def test_normalize(raw: str, norm: str) -> None:
    assert normalize_answer(raw) == norm


def test_exact_match_aliases() -> None:
    assert exact_match("the velmar guild", ["Velmar Guild", "Velmar"])
    assert exact_match("Velmar.", ["Velmar Guild", "Velmar"])
    assert not exact_match("Velmar Institute", ["Velmar Guild", "Velmar"])
    assert not exact_match("anything", [])


def test_f1() -> None:
    assert f1_score("Velmar Guild", ["Velmar Guild"]) == 1.0
    assert f1_score("Velmar", ["Velmar Guild"]) == pytest.approx(2 / 3)
    assert f1_score("nothing", ["Velmar Guild"]) == 0.0
    assert f1_score("the", ["a"]) == 1.0  # both normalise to empty
    assert f1_score("x", ["Velmar Guild", "x"]) == 1.0


def test_split_answers() -> None:
    assert split_answers("a; b", 2) == ["a", "b"]
    assert split_answers("a", 2) == ["a", ""]
    assert split_answers("a; b; c", 2) == ["a", "b; c"]
    assert split_answers("a; b", 1) == ["a; b"]


def test_multi_question() -> None:
    gold = [["Mirath"], ["Velmar Guild", "Velmar"], ["1854"]]
    assert multi_exact_match("Mirath; Velmar; 1854", gold) == [True, True, True]
    assert multi_exact_match("Mirath;Velmar", gold) == [True, True, False]
    assert is_correct("mirath ; the velmar guild ; 1854", gold)
    assert not is_correct("Mirath; Velmar", gold)
    assert not is_correct(None, gold)


def test_outcome_reward() -> None:
    gold = [["Mirath"], ["1854"]]
    assert outcome_reward("Mirath; 1854", gold, format_ok=True) == 1.0
    assert outcome_reward("Mirath; 1854", gold, format_ok=False) == 0.0
    assert outcome_reward(None, gold, format_ok=True) == 0.0
    assert outcome_reward("Mirath; 1999", gold, format_ok=True) == 0.0
    assert outcome_reward("Mirath; 1999", gold, format_ok=True, kind="fraction") == 0.5
    assert outcome_reward("Mirath City; 1854", gold, format_ok=True, kind="f1") == pytest.approx((2 / 3 + 1) / 2)
    with pytest.raises(ValueError):
        outcome_reward("x", gold, True, kind="bleu")  # type: ignore[arg-type]
