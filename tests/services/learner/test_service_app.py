"""The learner's HTTP service: status, readiness, metrics, the loop in the background."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from mempo.api.learner import LearnerStatus
from mempo.keys import Keys
from mempo.procs import RedisServer, free_port
from mempo.queue import RedisQueue
from mempo.registry import EngineInfo
from services.learner.app import create_app
from services.learner.settings import LearnerSettings
from tests.services.learner.service_support import StandInEngine, serving
from tests.services.learner.test_service_loop import learner_settings, roll_out


@asynccontextmanager
async def running(settings: LearnerSettings) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://learner") as client:
            yield client


async def wait_for(client: httpx.AsyncClient, done: Any, timeout_s: float = 90.0) -> LearnerStatus:
    deadline = time.monotonic() + timeout_s
    while True:
        status = LearnerStatus.model_validate((await client.get("/v1/status")).json())
        if done(status):
            return status
        if time.monotonic() > deadline:
            raise TimeoutError(f"status never got there: {status}")
        await asyncio.sleep(0.05)


@pytest.fixture
def engines() -> Iterator[list[StandInEngine]]:
    fleet = [StandInEngine("engine-a"), StandInEngine("engine-b"), StandInEngine("scorer")]
    with serving([e.app() for e in fleet]) as urls:
        for engine, url in zip(fleet, urls, strict=True):
            engine.url = url
        yield fleet


async def test_the_service_trains_and_reports_its_status(
    redis_url: str,
    redis_client: object,
    keys: Keys,
    tmp_path: Path,
    tiny_model_dir: Path,
    engines: list[StandInEngine],
) -> None:
    queue = RedisQueue(redis_client, keys)  # type: ignore[arg-type]
    for engine in engines:
        role = "scorer" if engine.name == "scorer" else "rollout"
        await queue.register_engine(
            EngineInfo(id=engine.name, role=role, url=engine.url), ttl_s=120
        )
    settings = learner_settings(redis_url, keys, tmp_path, tiny_model_dir, total_steps=2)
    async with running(settings) as client:
        assert (await client.get("/health")).json() == {"status": "ok", "service": "learner"}
        await wait_for(client, lambda s: s.state == "training" and s.admitted == 2)
        assert (await client.get("/ready")).status_code == 200
        for version in range(2):  # a rollout worker following the policy pointer
            await wait_for(
                client, lambda s, v=version: s.consumed == 2 * v and s.admitted == 2 * v + 2
            )
            await roll_out(queue, version)
        status = await wait_for(client, lambda s: s.state == "finished")
        metrics = (await client.get("/metrics")).text
    assert status.step == status.version == 2
    assert (status.admitted, status.consumed, status.in_flight, status.capacity) == (6, 4, 2, 2)
    assert status.dropped.model_dump() == {"duplicate": 0, "stale": 0, "foreign": 0}
    assert status.last_publish is not None and status.last_publish.version == 2
    assert status.last_publish.updated == sorted(e.url for e in engines)
    assert status.last_metrics is not None and status.last_metrics["step"] == 2
    assert "reward_mean" in status.last_metrics and status.error is None
    assert [c["weight_version"] for c in engines[2].calls] == ["1", "2"]  # the scorer too
    assert "mempo_learner_steps_total 2.0" in metrics
    assert "mempo_learner_policy_version 2.0" in metrics
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    await queue.aclose()


async def test_a_failed_loop_shows_in_ready_and_status(
    redis_url: str, keys: Keys, tmp_path: Path
) -> None:
    settings = learner_settings(redis_url, keys, tmp_path, tmp_path / "no-such-model")
    async with running(settings) as client:
        status = await wait_for(client, lambda s: s.state == "failed")
        ready = await client.get("/ready")
        wrong = await client.post("/v1/status")
        missing = await client.get("/v1/nothing")
    assert status.error and "no-such-model" in status.error
    assert ready.status_code == 503 and "failed" in ready.json()["reason"]
    assert wrong.status_code == 405 and missing.status_code == 404


@pytest.mark.parametrize("failures", [1, 2])
async def test_status_reads_redis_once_more_after_a_dropped_connection(
    redis_url: str, keys: Keys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failures: int
) -> None:
    """Right after Redis restarts a pooled connection can fail once: the status route asks
    again 0.2 s later; only a second failure is a 503."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    from services.learner import app as learner_app

    real, calls = learner_app.learner_status, []

    async def flaky(*args: Any) -> LearnerStatus:
        calls.append(1)
        if len(calls) <= failures:
            raise RedisConnectionError("Connection closed by server.")
        return await real(*args)

    settings = learner_settings(redis_url, keys, tmp_path, tmp_path / "no-such-model")
    async with running(settings) as client:
        await wait_for(client, lambda s: s.state == "failed")
        monkeypatch.setattr(learner_app, "learner_status", flaky)
        reply = await client.get("/v1/status")
    assert len(calls) == 2
    if failures == 1:
        assert reply.status_code == 200 and reply.json()["state"] == "failed"
    else:
        assert reply.status_code == 503 and "Redis unreachable" in reply.json()["message"]


async def test_status_of_a_restarted_learner_resumes_its_counts(
    redis_url: str, redis_client: object, keys: Keys, tmp_path: Path, tiny_model_dir: Path
) -> None:
    queue = RedisQueue(redis_client, keys)  # type: ignore[arg-type]
    settings = learner_settings(redis_url, keys, tmp_path, tiny_model_dir, total_steps=1)
    async with running(settings) as client:
        await wait_for(client, lambda s: s.admitted == 2)
        await roll_out(queue, 0)
        await wait_for(client, lambda s: s.state == "finished")
    async with running(settings) as client:  # total_steps reached: resumes and stops at once
        status = await wait_for(client, lambda s: s.state == "finished")
    assert (status.step, status.admitted, status.consumed, status.in_flight) == (1, 4, 2, 2)
    assert (
        status.last_metrics is not None and status.last_metrics["step"] == 1
    )  # from metrics.jsonl
    await queue.aclose()


async def test_the_loop_waits_for_redis_with_backoff(
    keys: Keys, tmp_path: Path, tiny_model_dir: Path
) -> None:
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    settings = learner_settings(url, keys, tmp_path, tiny_model_dir)
    async with running(settings) as client:
        await asyncio.sleep(1.0)
        status, ready = await client.get("/v1/status"), await client.get("/ready")
        assert status.status_code == 503 and "Redis unreachable" in status.json()["message"]
        assert ready.status_code == 503
        with RedisServer(tmp_path / "late-redis", port=port):
            final = await wait_for(client, lambda s: s.state == "training" and s.admitted == 2)
            assert (await client.get("/ready")).status_code == 200
    assert final.error is None


@pytest.mark.parametrize("broken", ["counter", "policy"])
async def test_a_malformed_or_mistyped_key_is_reported_and_training_resumes_once_fixed(
    redis_url: str, redis_client: Any, keys: Keys, tmp_path: Path, tiny_model_dir: Path, broken: str
) -> None:
    """A learner-state counter "x", or mempo:policy of the wrong type, once stopped the
    learner for good (and /v1/status answered 500)."""
    queue = RedisQueue(redis_client, keys)
    if broken == "counter":
        await redis_client.hset(keys.learner_state, "admitted", "x")
    else:
        await redis_client.set(keys.policy, "not a hash")  # WRONGTYPE at the first publish
    settings = learner_settings(redis_url, keys, tmp_path, tiny_model_dir, total_steps=1)
    async with running(settings) as client:
        if broken == "policy":
            await wait_for(client, lambda s: s.admitted == 2)
            await roll_out(queue, 0)
        deadline = time.monotonic() + 60
        while (reply := await client.get("/ready")).status_code != 503 or "retrying" not in reply.text:
            assert time.monotonic() < deadline, reply.text
            await asyncio.sleep(0.05)
        status = await client.get("/v1/status")
        metrics = (await client.get("/metrics")).text
        if broken == "counter":  # the counters cannot be read: the status says which key
            assert status.status_code == 503 and keys.learner_state in status.json()["message"]
            await redis_client.hset(keys.learner_state, "admitted", "0")
            await wait_for(client, lambda s: s.admitted == 2)
            await roll_out(queue, 0)
        else:
            assert status.status_code == 200 and "WRONGTYPE" in (status.json()["error"] or "")
            await redis_client.delete(keys.policy)
        final = await wait_for(client, lambda s: s.state == "finished")
    assert "mempo_learner_redis_errors_total{" in metrics
    assert final.error is None and final.step == final.version == 1
    policy = await queue.get_policy()
    assert policy is not None and policy.version == 1  # published once the key was fixed
    await queue.aclose()
