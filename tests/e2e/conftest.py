"""Fixtures that run the whole system (tests/e2e/system.py) once per test module.

- ``trained_system``: 2 CPU engine + worker pairs, the learner set to 2 steps (the
  end-to-end test reads it after it finished).
- ``fault_system``: the same processes training without a step limit, with short leases
  (``claim_idle_ms`` 3 s) so that a killed worker's task moves on quickly; the fault tests
  kill, freeze and restart its processes.

A module's run folder (logs, checkpoints, weights, redis data) is deleted when all its
tests passed, and kept (its path in the failure) when one failed.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.system import System, running_system

FAULT_ENV: dict[str, dict[str, str]] = {
    "worker": {
        "MEMPO_ROLLOUT_CLAIM_IDLE_MS": "3000",  # a dead worker's task is reclaimed after 3 s
        "MEMPO_ROLLOUT_MAX_CONCURRENT_TASKS": "1",  # one task per worker: both workers get work
        "MEMPO_ROLLOUT_MAX_DELIVERIES": "6",  # a scorer outage costs a task some deliveries
        "MEMPO_ROLLOUT_REGISTRY_TTL_S": "3",
    },
    "learner": {"MEMPO_LEARNER_PUBLISH_TIMEOUT_S": "60"},
}


@pytest.fixture(scope="module")
def e2e_root(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])
    failed_before = request.session.testsfailed
    yield root
    if request.session.testsfailed == failed_before:
        shutil.rmtree(root, ignore_errors=True)
    else:
        print(f"\nrun folder kept for inspection: {root}")


@pytest.fixture(scope="module")
def trained_system(e2e_root: Path, tiny_model_dir: Path) -> Iterator[System]:
    with running_system(e2e_root, tiny_model_dir, steps=2) as system:
        yield system


@pytest.fixture(scope="module")
def fault_system(e2e_root: Path, tiny_model_dir: Path) -> Iterator[System]:
    with running_system(e2e_root, tiny_model_dir, steps=100_000, service_env=FAULT_ENV) as system:
        yield system
