"""The scorer's /ready is 503 while it cannot register in Redis (issue 13, item 9): it
would never receive a weight update. A real redis-server with a password."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

import httpx

from mempo.procs import RedisServer, free_port

from .conftest import AppClient


async def ready_reply(client: httpx.AsyncClient, ok: bool, timeout_s: float = 10.0) -> dict:
    """Poll /ready until it is 200 (``ok``) or 503 because registering fails."""
    for _ in range(int(timeout_s / 0.05)):
        reply = await client.get("/ready")
        if ok and reply.status_code == 200:
            return dict(reply.json())
        if not ok and reply.status_code == 503 and "cannot register" in reply.json()["reason"]:
            return dict(reply.json())
        await asyncio.sleep(0.05)
    raise AssertionError(f"/ready stayed {reply.status_code}: {reply.text}")


async def test_ready_follows_the_registration(app_client: AppClient, tmp_path: Path) -> None:
    password = "s/c#o?" + secrets.token_hex(12)
    with RedisServer(tmp_path / "redis", password=password) as server:
        plain = f"redis://127.0.0.1:{server.port}/0"
        wrong = secrets.token_hex(16)
        async with app_client(redis_url=plain, redis_password=wrong, heartbeat_s=0.1) as client:
            body = await ready_reply(client, ok=False)
            assert "cannot register in Redis" in body["reason"] and wrong not in body["reason"]
            assert (await ready_reply(client, ok=False))["reason"] == body["reason"]  # stays 503
        async with app_client(redis_url=plain, redis_password=password, heartbeat_s=0.1) as client:
            await ready_reply(client, ok=True)
            server.stop()
            body = await ready_reply(client, ok=False)
            assert "cannot register in Redis" in body["reason"] and password not in body["reason"]
            server.start()
            await ready_reply(client, ok=True, timeout_s=20)  # backoff (capped) then registered
    nowhere = f"redis://127.0.0.1:{free_port()}/0"
    async with app_client(redis_url=nowhere, heartbeat_s=0.1) as client:
        assert "ConnectionError" in (await ready_reply(client, ok=False))["reason"]
