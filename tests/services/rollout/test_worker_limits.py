"""The worker's unauthenticated POST /v1/episodes bounds what one request can buy: task.n
and task.max_rounds are capped, and a client that leaves cancels its episodes (served by
uvicorn on 127.0.0.1, so the disconnect is a real one)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
import uvicorn

from mempo.bm25 import LocalSearch
from mempo.procs import free_port
from mempo_sim.world import World
from services.rollout.app import create_app
from tests.services.rollout.scripted import ScriptedEngine, upstreams, worker_settings
from tests.services.rollout.test_worker_app import one_task, serving, wait_ready


async def eventually(check: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_n_and_max_rounds_are_capped(
    tokenizer: Any, world: World, local_search: LocalSearch
) -> None:
    engine = ScriptedEngine.oracle(tokenizer, world, "full")
    settings = worker_settings(episodes_max_n=3, episodes_max_rounds=10)
    app = create_app(settings, upstreams(engine, local_search), tokenizer)
    async with serving(app) as client:
        await wait_ready(client)
        task = one_task(world, mode="full", n=4).model_dump(mode="json")
        resp = await client.post("/v1/episodes", json={"task": task})
        assert resp.status_code == 413 and "episodes_max_n" in resp.json()["message"]
        resp = await client.post("/v1/episodes", json={"task": {**task, "n": 3}})  # 16 rounds
        assert resp.status_code == 413 and "task.max_rounds" in resp.json()["message"]
        assert engine.calls == []  # refused before any work
        ok = await client.post("/v1/episodes", json={"task": {**task, "n": 3, "max_rounds": 10}})
        assert ok.status_code == 200, ok.text


async def test_a_client_that_leaves_cancels_its_episodes(
    tokenizer: Any, world: World, local_search: LocalSearch
) -> None:
    engine = ScriptedEngine.oracle(tokenizer, world, "full")
    engine.gate = asyncio.Event()  # every /generate hangs until set
    app = create_app(worker_settings(), upstreams(engine, local_search), tokenizer)
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    served = asyncio.create_task(server.serve())
    try:
        await eventually(lambda: server.started)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            await wait_ready(client)
            task = one_task(world, mode="full", n=4).model_dump(mode="json")
            leaving = asyncio.create_task(client.post("/v1/episodes", json={"task": task}))
            await eventually(lambda: engine.in_flight == 4)
            leaving.cancel()  # the client closes its connection
            with pytest.raises(asyncio.CancelledError):
                await leaving
            await eventually(lambda: engine.in_flight == 0)  # its generations were cancelled
            status = (await client.get("/v1/status")).json()
            assert status["in_flight_episodes"] == 0 and status["in_flight_tasks"] == 0
    finally:
        engine.gate.set()
        server.should_exit = True
        await asyncio.wait_for(served, 30)
