"""LearnerSettings: env prefix, nested trainer config, k as a list or range, validation."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from services.learner.settings import LearnerSettings, parse_ks


def test_environment_and_nested_trainer_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMPO_LEARNER_BATCH_GROUPS", "6")
    monkeypatch.setenv("MEMPO_LEARNER_MAX_STALENESS", "2")
    monkeypatch.setenv("MEMPO_LEARNER_QUESTIONS_PER_TASK", "1-3")
    monkeypatch.setenv("MEMPO_LEARNER_TRAINER__LR", "3e-6")
    monkeypatch.setenv("MEMPO_LEARNER_ADMIN_TOKEN", "own")
    settings = LearnerSettings()
    assert settings.port == 8004
    assert settings.capacity == 18
    assert settings.questions_per_task == [1, 2, 3]
    assert settings.trainer.lr == 3e-6
    # Each service has its own secret: the learner's never stands in for another's.
    assert settings.role_tokens() == {"rollout": None, "scorer": None}
    assert settings.checkpoints == Path("runs/learner/checkpoints")
    monkeypatch.setenv("MEMPO_LEARNER_WORKER_ADMIN_TOKEN", "workers")
    monkeypatch.setenv("MEMPO_LEARNER_SCORER_ADMIN_TOKEN", "scorer")
    assert LearnerSettings().role_tokens() == {"rollout": "workers", "scorer": "scorer"}


@pytest.mark.parametrize(
    ("text", "ks"), [("2", [2]), ("1,2,4", [1, 2, 4]), ("[3, 5]", [3, 5]), ("2-4", [2, 3, 4])]
)
def test_questions_per_task_forms(text: str, ks: list[int]) -> None:
    assert parse_ks(text) == ks
    assert LearnerSettings(questions_per_task=text).questions_per_task == ks  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("questions_per_task", "4-2", "empty"),
        ("questions_per_task", "two", "questions_per_task"),
        ("questions_per_task", [0], "between 1 and 64"),
        ("key_prefix", "has space:", "prefix"),
        ("batch_groups", 0, "batch_groups"),
    ],
)
def test_bad_settings_name_the_problem(field: str, value: object, needle: str) -> None:
    with pytest.raises(ValidationError, match=needle):
        LearnerSettings(**{field: value})  # type: ignore[arg-type]
