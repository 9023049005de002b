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
from typing import Any

import pytest

from tests.e2e.system import System, running_system

FAULT_SETTINGS: dict[str, dict[str, Any]] = {
    "worker": {
        "claim_idle_ms": 3000,  # a dead worker's task is reclaimed after 3 s
        "max_concurrent_tasks": 1,  # one task per worker: both workers get work
        "max_deliveries": 6,  # a scorer outage costs a task some deliveries
        "registry_ttl_s": 3,
    },
    "learner": {"publish_timeout_s": 60},
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
    with running_system(e2e_root, tiny_model_dir, steps=100_000, given=FAULT_SETTINGS) as system:
        yield system
