"""Worker processes (``mempo rollout worker``) against real HTTP upstreams: kill -9 mid-task."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI

from mempo.bm25 import LocalSearch
from mempo.keys import Keys
from mempo.procs import free_port, wait_ready
from mempo.queue import RedisQueue
from mempo.schemas import Task
from mempo_sim.world import World
from tests.services.rollout.scripted import ScriptedEngine, ScriptedScorer, retrieval_app

pytestmark = pytest.mark.e2e


@contextmanager
def serving_in_a_thread(app: FastAPI) -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def start_worker(name: str, upstream: str, redis_url: str, keys: Keys, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {
        **os.environ,
        "MEMPO_ROLLOUT_PORT": str(port),
        "MEMPO_ROLLOUT_WORKER_ID": name,
        "MEMPO_ROLLOUT_REDIS_URL": redis_url,
        "MEMPO_ROLLOUT_KEY_PREFIX": keys.prefix,
        "MEMPO_ROLLOUT_ENGINE_URL": upstream,
        "MEMPO_ROLLOUT_RETRIEVAL_URL": upstream,
        "MEMPO_ROLLOUT_SCORER_URL": upstream,
        "MEMPO_ROLLOUT_CLAIM_IDLE_MS": "1000",
        "MEMPO_ROLLOUT_REGISTRY_TTL_S": "2",
        "MEMPO_ROLLOUT_HEARTBEAT_S": "0.5",
        "MEMPO_ROLLOUT_TEMPERATURE": "0",
    }
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mempo_cli", "rollout", "worker"], env=env, stdout=out, stderr=out
        )
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, timeout_s=90, proc=proc)
    return proc, url


async def test_a_worker_killed_mid_task_is_replaced(
    redis_url: str,
    redis_client: Any,
    keys: Keys,
    tokenizer: Any,
    world: World,
    local_search: LocalSearch,
    tiny_model_dir: Path,
    tmp_path: Path,
) -> None:
    engine = ScriptedEngine.oracle(tokenizer, world, "memory", model_path=str(tiny_model_dir))
    engine.delay_s = 0.2  # every round takes a while: the kill lands mid-task
    upstream = FastAPI()
    for app in (engine.app, retrieval_app(local_search), ScriptedScorer().app):
        upstream.include_router(app.router)
    queue = RedisQueue(redis_client, keys, consumer="learner")
    await queue.ensure_groups()
    tasks = [
        Task(questions=q, answers=a, n=2, mode="memory", max_rounds=16)
        for q, a in world.tasks("test", 2, 2, seed=51)
    ]
    with serving_in_a_thread(upstream) as url:
        doomed, _ = await asyncio.to_thread(start_worker, "a", url, redis_url, keys, tmp_path / "a.log")
        for task in tasks:
            await queue.publish_task(task)
        for _ in range(500):
            if engine.in_flight >= 4:  # both tasks claimed, their episodes waiting on the engine
                break
            await asyncio.sleep(0.01)
        doomed.send_signal(signal.SIGKILL)
        doomed.wait(10)
        assert (await queue.stream_lengths())["groups"] == 0

        rescuer, _ = await asyncio.to_thread(start_worker, "b", url, redis_url, keys, tmp_path / "b.log")
        try:
            groups = []
            deadline = time.monotonic() + 60
            while len({g.group_id for g in groups}) < 2 and time.monotonic() < deadline:
                groups += [d.record for d in await queue.claim_groups(10, block_ms=200)]
            unique = {g.group_id: g for g in groups}  # the learner's dedup
            assert sorted(g.task.task_id for g in unique.values()) == sorted(t.task_id for t in tasks)
            assert {g.worker_id for g in unique.values()} == {"b"}
            assert all(t.correct for g in unique.values() for t in g.trajectories)
            assert [e.id for e in await queue.list_engines()] == ["b"]  # a's entry expired
        finally:
            rescuer.send_signal(signal.SIGTERM)
            rescuer.wait(30)  # uvicorn re-raises SIGTERM after its graceful shutdown
    assert "Application shutdown complete" in (tmp_path / "b.log").read_text()
    assert await queue.list_engines() == []  # b left on shutdown
    assert (await queue.stream_lengths())["tasks"] == 0
