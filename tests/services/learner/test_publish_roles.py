"""Each registry role gets its own admin token from the publisher (issue 13, item 7):
the rollout workers' token never reaches the scorer, nor the scorer's a worker."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import pytest

from mempo.keys import Keys
from mempo.queue import RedisQueue
from mempo.registry import EngineInfo
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
        token = SCORER if role == "scorer" else WORKERS
        await queue.register_engine(EngineInfo(id=stand_in.name, role=role, url=stand_in.url).signed(token))
    tokens = {"rollout": WORKERS, "scorer": SCORER}
    publisher = WeightPublisher(queue, tmp_path / "w", role_tokens=tokens, timeout_s=30)
    try:
        report = await publisher.publish(CopyExporter(tiny_model_dir), version=1)
        assert report.stale == {} and report.updated == sorted(s.url for s in fleet)
        for stand_in in fleet:
            token = SCORER if stand_in.name == "scorer" else WORKERS
            assert [c["authorization"] for c in stand_in.calls] == [f"Bearer {token}"]
        # Swapped tokens: no entry proves the learner's token for its role, none is sent
        # anything (neither a token nor weights), every one is reported stale.
        publisher.role_tokens = {"rollout": SCORER, "scorer": WORKERS}
        report = await publisher.publish(CopyExporter(tiny_model_dir), version=2)
        assert report.updated == [] and sorted(report.stale) == sorted(s.url for s in fleet)
        assert all(s.weight_version == "1" and len(s.calls) == 1 for s in fleet)
    finally:
        await publisher.aclose()


@pytest.fixture
def silent_url() -> Iterator[str]:
    """A TCP server that accepts connections and never answers (a "silent engine")."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as server:
        server.listen(64)
        yield f"http://127.0.0.1:{server.getsockname()[1]}"


async def test_a_forged_registry_entry_gets_no_token_and_no_push(
    redis_client: object,
    keys: Keys,
    tmp_path: Path,
    tiny_model_dir: Path,
    fleet: list[StandInEngine],
    silent_url: str,
) -> None:
    """Whoever could write Redis once got the workers' (or the scorer's) admin token and
    every weight push by registering a URL of its own; a silent one held each publish for
    the whole per-engine timeout."""
    import time

    queue = RedisQueue(redis_client, keys)  # type: ignore[arg-type]
    worker, _, scorer = fleet
    attacker = StandInEngine("attacker")  # records what it is sent; answers 200 to anything
    with serving([attacker.app()]) as (attacker_url,):
        legit = EngineInfo(id="worker-0", role="rollout", url=worker.url).signed(WORKERS)
        await queue.register_engine(legit)
        forged = [
            EngineInfo(id="x", role="rollout", url=attacker_url),  # no proof
            EngineInfo(id="y", role="scorer", url=attacker_url + "/y").signed("guessed-" + SCORER[:8]),
            # a valid proof copied from a real entry onto another URL
            legit.model_copy(update={"id": "z", "url": attacker_url + "/z"}),
            EngineInfo(id="silent", role="rollout", url=silent_url),
        ]
        for entry in forged:
            await queue.register_engine(entry)
        publisher = WeightPublisher(
            queue, tmp_path / "w", role_tokens={"rollout": WORKERS, "scorer": SCORER}, timeout_s=30
        )
        try:
            started = time.perf_counter()
            report = await publisher.publish(CopyExporter(tiny_model_dir), version=1)
            took = time.perf_counter() - started
        finally:
            await publisher.aclose()
    assert attacker.calls == [] and report.updated == [worker.url]
    assert sorted(report.stale) == sorted(e.url for e in forged)
    assert all("does not prove" in why for why in report.stale.values())
    assert took < 10  # the silent one is not waited for (timeout_s is 30)
    assert [c["authorization"] for c in worker.calls] == [f"Bearer {WORKERS}"] and scorer.calls == []


async def test_a_proven_but_silent_engine_costs_one_timeout_in_parallel(
    redis_client: object, keys: Keys, tmp_path: Path, tiny_model_dir: Path, fleet: list[StandInEngine]
) -> None:
    """Silent replicas (hung, not forged) delay a publish by the per-engine timeout once,
    however many there are; the others are updated meanwhile."""
    import socket
    import time

    queue = RedisQueue(redis_client, keys)  # type: ignore[arg-type]
    await queue.register_engine(EngineInfo(id="w", role="rollout", url=fleet[0].url).signed(WORKERS))
    servers = [socket.create_server(("127.0.0.1", 0)) for _ in range(5)]
    try:
        for i, server in enumerate(servers):
            url = f"http://127.0.0.1:{server.getsockname()[1]}"
            await queue.register_engine(EngineInfo(id=f"hung-{i}", role="rollout", url=url).signed(WORKERS))
        publisher = WeightPublisher(queue, tmp_path / "w", role_tokens={"rollout": WORKERS}, timeout_s=2)
        try:
            started = time.perf_counter()
            report = await publisher.publish(CopyExporter(tiny_model_dir), version=1)
            took = time.perf_counter() - started
        finally:
            await publisher.aclose()
    finally:
        for server in servers:
            server.close()
    assert report.updated == [fleet[0].url] and len(report.stale) == 5
    assert 2 <= took < 6, took
