"""The worker's HTTP API in-process (ASGI), with its lifespan: boot, consumer loop, routes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI

from mempo.bm25 import LocalSearch
from mempo.keys import Keys
from mempo.queue import RedisQueue
from mempo.schemas import Group, Task
from mempo_sim.world import World
from services.rollout.app import create_app
from services.rollout.settings import WorkerSettings
from services.rollout.upstreams import Upstreams
from tests.services.rollout.scripted import (
    ScriptedEngine,
    ScriptedScorer,
    upstreams,
    worker_settings,
)


@asynccontextmanager
async def serving(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://worker") as client:
            yield client


async def wait_ready(client: httpx.AsyncClient) -> None:
    for _ in range(200):
        if (await client.get("/ready")).status_code == 200:
            return
        await asyncio.sleep(0.02)
    raise AssertionError((await client.get("/ready")).json())


def one_task(world: World, mode: str = "memory", n: int = 2) -> Task:
    (questions, answers), = world.tasks("test", 2, 1, seed=21)
    return Task(questions=questions, answers=answers, n=n, mode=mode, max_rounds=16)


async def test_post_episodes_returns_the_group(
    tokenizer: Any, world: World, local_search: LocalSearch
) -> None:
    engine = ScriptedEngine.oracle(tokenizer, world, "memory")
    app = create_app(
        worker_settings(scorer_url="http://scorer"),
        upstreams(engine, local_search, ScriptedScorer()),
        tokenizer,
    )
    async with serving(app) as client:
        await wait_ready(client)
        assert (await client.get("/health")).json()["status"] == "ok"
        task = one_task(world)
        response = await client.post("/v1/episodes", json={"task": task.model_dump(mode="json")})
        assert response.status_code == 200, response.text
        group = Group.model_validate(response.json())
        assert group.task == task and len(group.trajectories) == 2 and group.scorer_version == "7"
        assert all(t.correct and len(t.p_mem) == len(t.rounds) for t in group.trajectories)
        unscored = await client.post(
            "/v1/episodes", json={"task": task.model_dump(mode="json"), "score": False}
        )
        assert Group.model_validate(unscored.json()).trajectories[0].p_mem == []

        status = (await client.get("/v1/status")).json()
        assert status["ready"] and not status["consuming"]  # no Redis: HTTP only
        assert status["episodes"] == 4 and status["rounds"] >= 12 and status["in_flight_episodes"] == 0
        assert status["max_context_tokens"] == engine.context_length
        metrics = (await client.get("/metrics")).text
        assert 'mempo_rollout_episodes_total{mode="memory",outcome="correct"} 4.0' in metrics
        assert "mempo_rollout_round_latency_seconds_count" in metrics
        assert 'mempo_rollout_tokens_total{kind="prompt"}' in metrics
        assert "mempo_rollout_in_flight_episodes 0.0" in metrics


async def test_bad_requests_are_4xx_naming_the_field(
    tokenizer: Any, world: World, local_search: LocalSearch
) -> None:
    engine = ScriptedEngine.oracle(tokenizer, world, "memory")
    app = create_app(worker_settings(max_body_bytes=4096), upstreams(engine, local_search), tokenizer)
    task = one_task(world).model_dump(mode="json")
    async with serving(app) as client:
        await wait_ready(client)
        cases = {
            "task.n": {"task": {**task, "n": 0}},
            "task.mode": {"task": {**task, "mode": "chatty"}},
            "answers": {"task": {**task, "answers": [["x"]]}},
            "task": {},
            "surprise": {"task": task, "surprise": 1},
        }
        for field, body in cases.items():
            response = await client.post("/v1/episodes", json=body)
            assert response.status_code == 422 and field in response.json()["message"], response.text
        huge = await client.post("/v1/episodes", content=b"{" + b" " * 5000 + b"}")
        assert huge.status_code == 413
        assert (await client.get("/v1/nothing")).status_code == 404
        assert engine.calls == []


async def test_not_ready_until_the_engine_answers_then_upstream_errors_are_502(
    tokenizer: Any, world: World, local_search: LocalSearch
) -> None:
    engine = ScriptedEngine.oracle(tokenizer, world, "memory")
    clients = upstreams(engine, local_search)
    dead = Upstreams(
        engine=type(clients.engine)("http://127.0.0.1:9", attempts=1),
        retrieval=clients.retrieval,
        scorer=None,
    )
    task = {"task": one_task(world).model_dump(mode="json")}
    async with serving(create_app(worker_settings(), dead, tokenizer=None)) as client:
        await asyncio.sleep(0.1)
        ready = await client.get("/ready")
        assert ready.status_code == 503 and "waiting for the engine" in ready.json()["reason"]
        response = await client.post("/v1/episodes", json=task)
        assert response.status_code == 503 and "not ready" in response.json()["message"]

    broken = ScriptedEngine.oracle(tokenizer, world, "memory")
    broken.fail_status = 500
    app = create_app(worker_settings(), upstreams(broken, local_search), tokenizer)
    async with serving(app) as client:
        await wait_ready(client)
        response = await client.post("/v1/episodes", json=task)
        assert response.status_code == 502 and "500" in response.json()["message"]


async def test_the_app_consumes_tasks_from_redis(
    redis_url: str, redis_client: Any, keys: Keys, tokenizer: Any, world: World, local_search: LocalSearch
) -> None:
    queue = RedisQueue(redis_client, keys, consumer="feeder")
    await queue.ensure_groups()
    tasks = [one_task(world, mode) for mode in ("memory", "full")]
    for task in tasks:
        await queue.publish_task(task)
    settings: WorkerSettings = worker_settings(
        redis_url=redis_url, key_prefix=keys.prefix, scorer_url="http://scorer", worker_id="w-app"
    )
    engine = ScriptedEngine.oracle(tokenizer, world, "memory")
    app = create_app(settings, upstreams(engine, local_search, ScriptedScorer()), tokenizer)
    async with serving(app) as client:
        for _ in range(300):
            if (await queue.stream_lengths())["groups"] == 2:
                break
            await asyncio.sleep(0.02)
        status = (await client.get("/v1/status")).json()
        assert status["consuming"] and status["tasks_done"] == 2
        assert [e.id for e in await queue.list_engines()] == ["w-app"]
    learner = RedisQueue(redis_client, keys, consumer="learner")
    groups = [d.record for d in await learner.claim_groups(10, block_ms=None)]
    assert sorted(g.task.task_id for g in groups) == sorted(t.task_id for t in tasks)
    assert {g.worker_id for g in groups} == {"w-app"}
    assert (await queue.stream_lengths())["tasks"] == 0
    assert await queue.list_engines() == []  # unregistered on shutdown
