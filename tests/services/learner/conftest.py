"""Learner tests: torch on one thread; a stand-in fleet of engines and a queue that knows it.

The development machine has 2 cores shared by several test runs; OpenMP threads that
spin-wait for each other there make torch 3-5x slower than a single thread.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
import torch

from mempo.keys import Keys
from mempo.queue import RedisQueue
from mempo.registry import EngineInfo
from tests.services.learner.service_support import StandInEngine, serving

torch.set_num_threads(1)


@pytest.fixture
def fleet() -> Iterator[list[StandInEngine]]:
    engines = [StandInEngine("engine-a"), StandInEngine("engine-b"), StandInEngine("scorer")]
    with serving([e.app() for e in engines]) as urls:
        for engine, url in zip(engines, urls, strict=True):
            engine.url = url
        yield engines


@pytest.fixture
async def queue(
    redis_client: object, keys: Keys, fleet: list[StandInEngine]
) -> AsyncIterator[RedisQueue]:
    q = RedisQueue(redis_client, keys, consumer="learner-0")  # type: ignore[arg-type]
    for engine in fleet:
        role = "scorer" if engine.name == "scorer" else "rollout"
        await q.register_engine(EngineInfo(id=engine.name, role=role, url=engine.url), ttl_s=120)
    yield q
    await q.aclose()

