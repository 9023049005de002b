"""The worker's admin route and its readiness (issue 13, items 7 and 9).

- The learner updates a replica through its worker: ``POST /update_weights_from_disk`` on
  the worker, guarded by the worker's own token, forwarded to the engine (here the real
  CPU engine, in-process) with the engine's key, which never leaves the worker.
- ``/ready`` is 503 with the reason while Redis refuses the password or is down (a real
  redis-server with a password).
"""

from __future__ import annotations

import asyncio
import secrets
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from mempo.bm25 import LocalSearch
from mempo.clients.engine import EngineClient
from mempo.clients.retrieval import RetrievalClient
from mempo.procs import RedisServer, free_port
from mempo_sim.world import World
from services.rollout.app import create_app
from services.rollout.upstreams import Upstreams
from tests.services.rollout.scripted import ScriptedEngine, asgi_client, upstreams, worker_settings

WORKER_TOKEN = secrets.token_hex(16)
ENGINE_KEY = secrets.token_hex(16)


@asynccontextmanager
async def serving(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            yield client


async def ready_reply(client: httpx.AsyncClient, ok: bool, timeout_s: float = 10.0) -> Any:
    """Poll /ready until it is 200 (``ok``) or 503 for Redis; returns its JSON."""
    for _ in range(int(timeout_s / 0.05)):
        reply = await client.get("/ready")
        if ok and reply.status_code == 200:
            return reply.json()
        if not ok and reply.status_code == 503 and "Redis" in (reply.json()["reason"] or ""):
            return reply.json()
        await asyncio.sleep(0.05)
    raise AssertionError(f"/ready stayed {reply.status_code}: {reply.text}")


def engine_app(model: Path, root: Path) -> FastAPI:
    from services.rollout.engine.app import create_app as create_engine
    from services.rollout.engine.settings import EngineSettings

    settings = EngineSettings(
        model_path=str(model), weights_root=str(root), admin_token=ENGINE_KEY,  # type: ignore[arg-type]
        threads=1, drain_timeout_s=1.0,
    )  # fmt: skip
    return create_engine(settings)


def worker_on(engine: FastAPI, engine_key: str) -> FastAPI:
    clients = Upstreams(
        engine=EngineClient("http://engine", admin_token=engine_key, client=asgi_client(engine), attempts=1),
        retrieval=RetrievalClient("http://127.0.0.1:9"),  # the route never searches
        scorer=None,
    )
    settings = worker_settings(admin_token=WORKER_TOKEN, public_url="http://replica-0:8003")
    return create_app(settings, clients)


async def test_weight_updates_reach_the_engine_through_the_worker_only_with_its_token(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    root = tmp_path / "weights"
    shutil.copytree(tiny_model_dir, root / "v3")
    engine = engine_app(tiny_model_dir, root)
    body = {"model_path": str(root / "v3"), "weight_version": "3"}
    async with engine.router.lifespan_context(engine), serving(worker_on(engine, ENGINE_KEY)) as worker:
        await ready_reply(worker, ok=True, timeout_s=60)
        for headers, status in [
            ({}, 401),
            ({"Authorization": f"Bearer {secrets.token_hex(16)}"}, 403),
            ({"Authorization": f"Bearer {ENGINE_KEY}"}, 403),  # the engine's key is not the worker's
        ]:
            reply = await worker.post("/update_weights_from_disk", json=body, headers=headers)
            assert reply.status_code == status, reply.text
            assert ENGINE_KEY not in reply.text and WORKER_TOKEN not in reply.text
        assert (await worker.get("/v1/status")).json()["engine_weight_version"] == "0"
        right = {"Authorization": f"Bearer {WORKER_TOKEN}"}
        reply = await worker.post("/update_weights_from_disk", json=body, headers=right)
        assert reply.status_code == 200 and reply.json()["success"] is True, reply.text
        # The worker knows the new version at once (its groups in flight say so).
        assert (await worker.get("/v1/status")).json()["engine_weight_version"] == "3"
        async with asgi_client(engine) as direct:
            info = (await direct.get("http://engine/model_info")).json()
        assert (info["weight_version"], info["model_path"]) == ("3", str(root / "v3"))
        # The engine's own refusals are passed on with their status; bad bodies are 422.
        outside = {"model_path": str(tiny_model_dir), "weight_version": "4"}
        reply = await worker.post("/update_weights_from_disk", json=outside, headers=right)
        assert reply.status_code == 403 and "weights root" in reply.json()["message"], reply.text
        for bad in ({"model_path": str(root / "v3")}, {"weight_version": "4"}):
            reply = await worker.post("/update_weights_from_disk", json=bad, headers=right)
            assert reply.status_code == 422, reply.text
    # A worker holding a wrong engine key: 502 (the worker's fault, not the caller's token).
    engine = engine_app(tiny_model_dir, root)
    async with engine.router.lifespan_context(engine), serving(worker_on(engine, "x" * 32)) as worker:
        await ready_reply(worker, ok=True, timeout_s=60)
        reply = await worker.post("/update_weights_from_disk", json=body, headers=right)
        message = reply.json()["message"]
        assert reply.status_code == 502 and ("HTTP 401" in message or "HTTP 403" in message), message


@pytest.fixture
def redis_with_password(tmp_path: Path) -> Any:
    password = "p/w#x?" + secrets.token_hex(12)  # URL-special characters
    with RedisServer(tmp_path / "redis", password=password) as server:
        yield server


async def test_ready_is_503_while_redis_refuses_the_password_or_is_down(
    redis_with_password: RedisServer, tokenizer: Any, world: World, local_search: LocalSearch
) -> None:
    server = redis_with_password
    password = server.password
    assert password is not None
    plain = f"redis://127.0.0.1:{server.port}/0"
    engine = ScriptedEngine.oracle(tokenizer, world, "memory")
    cases = [
        (plain, secrets.token_hex(16), "AuthenticationError"),  # a wrong password
        (plain, None, "Error"),  # none: NOAUTH
    ]
    for url, given, reason in cases:
        settings = worker_settings(redis_url=url, redis_password=given, consume=False)
        async with serving(create_app(settings, upstreams(engine, local_search), tokenizer)) as client:
            body = await ready_reply(client, ok=False)
            assert body["reason"].startswith("Redis is not usable") and reason in body["reason"]
            assert given is None or given not in body["reason"]
    # The right password (with / # ?), given apart from the URL: ready; Redis stops: 503.
    settings = worker_settings(redis_url=plain, redis_password=password, consume=False)
    async with serving(create_app(settings, upstreams(engine, local_search), tokenizer)) as client:
        await ready_reply(client, ok=True)
        server.stop()
        body = await ready_reply(client, ok=False)
        assert "Redis is not usable" in body["reason"] and password not in body["reason"]
        assert (await client.get("/v1/status")).json()["ready"] is False
        server.start()
        await ready_reply(client, ok=True)


async def test_ready_is_503_when_nothing_listens_at_the_redis_url(
    tokenizer: Any, world: World, local_search: LocalSearch
) -> None:
    engine = ScriptedEngine.oracle(tokenizer, world, "memory")
    settings = worker_settings(redis_url=f"redis://127.0.0.1:{free_port()}/0", consume=False)
    async with serving(create_app(settings, upstreams(engine, local_search), tokenizer)) as client:
        body = await ready_reply(client, ok=False)
        assert "Redis is not usable" in body["reason"] and "ConnectionError" in body["reason"]
