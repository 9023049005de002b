"""mempo.settings: a settings object handed to a child process as its environment reads
back equal (every service's settings, every field changed from its default), and a named
preset lies under every value given."""

from __future__ import annotations

from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

import pytest
from pydantic import BaseModel, SecretStr, ValidationError
from pydantic.fields import FieldInfo

from mempo.settings import ServiceSettings, settings_env
from services.learner.settings import LearnerSettings
from services.learner.trainer_config import TrainerConfig
from services.retrieval.settings import RetrievalSettings
from services.rollout.engine.settings import EngineSettings
from services.rollout.settings import WorkerSettings
from services.scorer.settings import ScorerSettings

SERVICES: list[type[ServiceSettings]] = [
    RetrievalSettings, ScorerSettings, EngineSettings, WorkerSettings, LearnerSettings
]  # fmt: skip


def _changed(field: FieldInfo, current: Any) -> Any:
    """A value of ``field``'s type other than ``current`` (tried by the caller)."""
    union = get_origin(field.annotation) in (Union, UnionType)
    kind = (
        next(k for k in get_args(field.annotation) if k is not type(None))
        if union
        else field.annotation
    )
    if union and current is not None:
        return None  # an optional setting set: back to None
    if get_origin(kind) is Literal:
        return next(v for v in get_args(kind) if v != current)
    if kind is SecretStr:
        return SecretStr("a-long-random-secret-0123456789")
    if kind is bool:
        return not current
    if kind is int:
        return (current or 0) + 1
    if kind is float:
        return (current or 0.0) * 0.5 + 0.125
    if kind is Path:
        return Path("/srv/mempo") / "x"
    if get_origin(kind) is list:
        return [1, 3] if get_args(kind) == (int,) else ["jsonl", "tensorboard"]
    if get_origin(kind) is tuple:
        return (0.8, 0.95)
    if kind is str:
        return "mempo:x:" if current == "mempo:" else f"{current or 'v'}-x"
    raise AssertionError(f"no changed value for {field.annotation}")


def _all_changed(
    cls: type[BaseModel], base: dict[str, Any] | None = None
) -> tuple[dict[str, Any], int]:
    """Values for ``cls`` with every field changed that can be alone; and how many could not."""
    values: dict[str, Any] = dict(base or {})
    missed = 0
    for name, field in cls.model_fields.items():
        if name == "preset":
            continue
        current = field.get_default(call_default_factory=True)
        if isinstance(current, BaseModel):
            nested, nested_missed = _all_changed(type(current))
            values[name], missed = nested, missed + nested_missed
            continue
        try:
            cls.model_validate({**values, name: _changed(field, current)})
            values[name] = _changed(field, current)
        except ValidationError:
            missed += 1
    return values, missed


@pytest.mark.parametrize("cls", SERVICES, ids=lambda c: c.__name__)
def test_the_environment_of_a_settings_object_reads_back_equal(
    cls: type[ServiceSettings], monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in [k for k in __import__("os").environ if k.startswith("MEMPO_")]:
        monkeypatch.delenv(key)
    values, missed = _all_changed(cls)
    assert missed <= 2, f"{missed} settings could not be changed alone"
    settings = cls.model_validate(values)
    assert settings != cls()
    env = settings_env(settings)
    assert len(env) >= len(cls.model_fields)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert cls() == settings


def test_a_trainer_setting_and_none_travel_through_the_nested_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = LearnerSettings(
        trainer=TrainerConfig(row_tokens=None, betas=(0.5, 0.6)), checkpoint_dir=None
    )
    env = settings_env(settings)
    assert env["MEMPO_LEARNER_TRAINER__ROW_TOKENS"] == "null"
    assert env["MEMPO_LEARNER_CHECKPOINT_DIR"] == "null"
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert LearnerSettings().trainer.row_tokens is None
    assert LearnerSettings().trainer.betas == (0.5, 0.6)


def test_a_preset_lies_under_every_value_given(monkeypatch: pytest.MonkeyPatch) -> None:
    tiny = LearnerSettings(preset="tiny")
    assert (tiny.group_size, tiny.batch_groups, tiny.total_steps) == (8, 8, 30)
    assert (tiny.trainer.lr, tiny.trainer.alpha, tiny.trainer.beta_kl) == (3e-4, 0.0, 0.02)
    assert tiny.trainer.clip_low == TrainerConfig().clip_low  # outside the preset: the default
    monkeypatch.setenv("MEMPO_LEARNER_TRAINER__ALPHA", "1")  # a variable wins over the preset
    given = LearnerSettings(preset="tiny", group_size=4, trainer={"lr": 1e-3})  # type: ignore[arg-type]  # an argument too
    assert (given.group_size, given.trainer.lr, given.trainer.alpha) == (4, 1e-3, 1.0)
    assert given.trainer.ppo_epochs == 2  # the rest of the block still comes from the preset
    assert WorkerSettings(preset="tiny").max_new_tokens == 256
    with pytest.raises(ValidationError, match="preset"):
        LearnerSettings(preset="huge")  # type: ignore[arg-type]
