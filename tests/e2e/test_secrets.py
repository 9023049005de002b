"""Real service processes refuse to start with a placeholder or short secret (issue 13,
item 8): exit 2, one line on stderr naming the setting, no part of the value, nothing
bound. The values are the ones .env.example ships."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mempo.procs import free_port

PLACEHOLDER = "change-me-redis-password"  # .env.example's

CASES = [
    (["scorer", "serve"], {"MEMPO_SCORER_ADMIN_TOKEN": "change-me-scorer-token"}, "MEMPO_SCORER_ADMIN_TOKEN"),
    (["rollout", "worker"], {"MEMPO_ROLLOUT_REDIS_PASSWORD": PLACEHOLDER}, "MEMPO_ROLLOUT_REDIS_PASSWORD"),
    (["rollout", "worker"], {"MEMPO_ROLLOUT_REDIS_URL": "redis://:ab/cd#ef?0123456789abcdef@127.0.0.1:9/0"},
     "MEMPO_ROLLOUT_REDIS_URL"),
    (["rollout", "engine"], {"MEMPO_ENGINE_ADMIN_TOKEN": "short"}, "MEMPO_ENGINE_ADMIN_TOKEN"),
    (["learner", "serve"], {"MEMPO_LEARNER_SCORER_ADMIN_TOKEN": "change-me-scorer-token"},
     "MEMPO_LEARNER_SCORER_ADMIN_TOKEN"),
]  # fmt: skip


@pytest.mark.e2e
@pytest.mark.parametrize(("command", "env", "setting"), CASES)
def test_a_service_refuses_a_weak_secret(command: list[str], env: dict[str, str], setting: str) -> None:
    port = free_port()
    ports = {"scorer": "SCORER", "rollout": "ROLLOUT", "learner": "LEARNER"}
    prefix = "ENGINE" if command[1] == "engine" else ports[command[0]]
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MEMPO_")}
    environment |= {**env, f"MEMPO_{prefix}_PORT": str(port), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "mempo_cli", *command],
        env=environment, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {setting}"), result.stderr
    for value in env.values():
        value = value.removeprefix("change-me-")  # the message names the placeholder's form
        for piece in (value[:5], value[-5:]):
            assert piece not in result.stderr + result.stdout, piece
