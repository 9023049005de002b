"""Secrets (issue 13, item 8): placeholders and short secrets are refused at start, naming
the setting and no part of the value; Redis passwords with / # ? survive URLs; the
local redis-server never has its password on its command line."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

import pytest

from mempo.procs import RedisServer
from mempo.queue import connect
from mempo.settings import weak_secret
from services.learner.settings import LearnerSettings
from services.rollout.engine.settings import EngineSettings
from services.rollout.settings import WorkerSettings
from services.scorer.settings import ScorerSettings

GOOD = secrets.token_hex(16)
SPECIAL = "a/b#c?d@e:f%g \"h\\i" + secrets.token_hex(8)


@pytest.mark.parametrize(
    ("settings", "where", "needle"),
    [
        (ScorerSettings(admin_token="change-me-admin-token"), "MEMPO_SCORER_ADMIN_TOKEN", "placeholder"),  # type: ignore[arg-type]
        (EngineSettings(admin_token="short-token"), "MEMPO_ENGINE_ADMIN_TOKEN", "16 characters"),  # type: ignore[arg-type]
        (EngineSettings(admin_token=" " * 15 + "x"), "MEMPO_ENGINE_ADMIN_TOKEN", "whitespace"),  # type: ignore[arg-type]
        (ScorerSettings(admin_token=GOOD + "\n"), "MEMPO_SCORER_ADMIN_TOKEN", "whitespace"),  # type: ignore[arg-type]
        (WorkerSettings(engine_admin_token="CHANGE-ME-x" * 3), "MEMPO_ROLLOUT_ENGINE_ADMIN_TOKEN", "placeholder"),  # type: ignore[arg-type]
        (LearnerSettings(worker_admin_token="tiny"), "MEMPO_LEARNER_WORKER_ADMIN_TOKEN", "16"),  # type: ignore[arg-type]
        (LearnerSettings(redis_password="change-me-redis-password"), "MEMPO_LEARNER_REDIS_PASSWORD", "placeholder"),  # type: ignore[arg-type]
        (WorkerSettings(redis_url="redis://:change-me-redis-password@redis:6379/0"), "MEMPO_ROLLOUT_REDIS_URL", "placeholder"),
        (ScorerSettings(redis_url="redis://:pw@redis:6379/0"), "MEMPO_SCORER_REDIS_URL", "16"),
        (LearnerSettings(redis_url="redis://:abc/def#0123456789abcdef@redis:6379/0"), "MEMPO_LEARNER_REDIS_URL", "URL-quoted"),
    ],
)  # fmt: skip
def test_weak_secrets_are_named_without_their_value(settings: object, where: str, needle: str) -> None:
    problem = weak_secret(settings)  # type: ignore[arg-type]
    assert problem is not None and problem.startswith(where) and needle in problem, problem
    assert "\n" not in problem
    for value in ("change-me-admin-token", "short-token", "tiny", "abc", "pw@"):
        assert value not in problem.lower().replace("change-me-...", "")


def test_strong_or_unset_secrets_pass() -> None:
    quoted = RedisServer(Path("/nonexistent"), port=1, password=SPECIAL).url
    assert weak_secret(ScorerSettings()) is None
    assert weak_secret(WorkerSettings(admin_token=GOOD, engine_admin_token=GOOD, redis_url=quoted)) is None  # type: ignore[arg-type]
    assert weak_secret(LearnerSettings(redis_password=SPECIAL, redis_url="redis://redis:6379/0")) is None  # type: ignore[arg-type]


def test_a_misquoted_url_fails_without_showing_the_password() -> None:
    with pytest.raises(ValueError) as info:
        connect("redis://:abc/def0123456789@redis:6379/0")
    assert "abc" not in str(info.value) and "def" not in str(info.value)


def test_special_password_through_url_and_apart_and_never_in_argv(tmp_path: Path) -> None:
    with RedisServer(tmp_path / "redis", password=SPECIAL) as server:
        assert server.ping(password="").startswith(b"-NOAUTH")
        assert server.proc is not None
        argv = Path(f"/proc/{server.proc.pid}/cmdline").read_bytes()
        assert SPECIAL.encode() not in argv and b"requirepass" not in argv

        async def ping_both() -> None:
            for client in (
                connect(server.url),  # URL-quoted
                connect(f"redis://127.0.0.1:{server.port}/0", SPECIAL),  # given apart
            ):
                assert await client.ping()
                await client.aclose()

        asyncio.run(ping_both())
