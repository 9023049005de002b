"""Each registry role gets its own admin token from the publisher (issue 13, item 7):
the rollout workers' token never reaches the scorer, nor the scorer's a worker."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import pytest

from mempo.keys import Keys
from mempo.queue import EngineInfo, RedisQueue
from services.learner.publish import WeightPublisher
from tests.services.learner.service_support import StandInEngine, serving
from tests.services.learner.test_publish import CopyExporter

WORKERS = secrets.token_hex(16)
SCORER = secrets.token_hex(16)


@pytest.fixture
def fleet() -> Iterator[list[StandInEngine]]:
    stand_ins = [
        StandInEngine("worker-0", admin_token=WORKERS),
        StandInEngine("worker-1", admin_token=WORKERS),
        StandInEngine("scorer", admin_token=SCORER),
    ]
    with serving([s.app() for s in stand_ins]) as urls:
        for stand_in, url in zip(stand_ins, urls, strict=True):
            stand_in.url = url
        yield stand_ins


async def test_each_role_is_called_with_its_own_token(
    redis_client: object, keys: Keys, tmp_path: Path, tiny_model_dir: Path, fleet: list[StandInEngine]
) -> None:
    queue = RedisQueue(redis_client, keys)  # type: ignore[arg-type]
    for stand_in in fleet:
        role: Literal["scorer", "rollout"] = "scorer" if stand_in.name == "scorer" else "rollout"
        await queue.register_engine(EngineInfo(id=stand_in.name, role=role, url=stand_in.url))
    tokens = {"rollout": WORKERS, "scorer": SCORER}
    publisher = WeightPublisher(queue, tmp_path / "w", role_tokens=tokens, timeout_s=30)
    try:
        report = await publisher.publish(CopyExporter(tiny_model_dir), version=1)
        assert report.stale == {} and report.updated == sorted(s.url for s in fleet)
        for stand_in in fleet:
            token = SCORER if stand_in.name == "scorer" else WORKERS
            assert [c["authorization"] for c in stand_in.calls] == [f"Bearer {token}"]
        # Swapped tokens: every one refused, nothing loaded.
        publisher.role_tokens = {"rollout": SCORER, "scorer": WORKERS}
        report = await publisher.publish(CopyExporter(tiny_model_dir), version=2)
        assert report.updated == [] and sorted(report.stale) == sorted(s.url for s in fleet)
        assert all(s.weight_version == "1" for s in fleet)
    finally:
        await publisher.aclose()
