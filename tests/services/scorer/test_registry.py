"""Registry heartbeat and policy catch-up against the real redis-server."""

from __future__ import annotations

import asyncio
from pathlib import Path

from mempo.keys import Keys
from mempo.metrics import Metrics
from mempo.procs import free_port
from mempo.queue import RedisQueue
from services.scorer.model import LoadedModel
from services.scorer.registry import Registration, is_newer
from services.scorer.scorer import ScorerService
from services.scorer.settings import ScorerSettings

from .conftest import AppClient


def _service(loaded: LoadedModel, **settings: object) -> tuple[ScorerService, ScorerSettings]:
    config = ScorerSettings(**settings)  # type: ignore[arg-type]
    return ScorerService(config, loaded, Metrics("scorer")), config


async def test_heartbeat_registers_and_catches_up(
    loaded: LoadedModel, redis_url: str, redis_client: object, keys: Keys, weights_root: Path
) -> None:
    service, settings = _service(
        loaded,
        redis_url=redis_url,
        key_prefix=keys.prefix,
        engine_id="scorer-a",
        public_url="http://scorer-a:8002",
        weights_root=str(weights_root),
        heartbeat_s=2.0,
        admin_token="scorer-token-0123456789",
    )
    registration = Registration(service, settings)
    queue = RedisQueue(redis_client, keys)  # type: ignore[arg-type]
    try:
        await registration.beat()
        (entry,) = await queue.list_engines()
        assert (entry.id, entry.role, entry.url, entry.weight_version) == (
            "scorer-a",
            "scorer",
            "http://scorer-a:8002",
            "0",
        )
        assert 0 < await queue.redis.ttl(keys.engine("scorer-a")) <= 6
        assert entry.proven("scorer-token-0123456789")  # the learner holding it trusts the entry
        await queue.set_policy(1, str(weights_root / "v1"))
        await registration.beat()  # the pointer is newer: load it, re-register
        assert service.current.version == "1"
        assert service.current.path == str(weights_root / "v1")
        (entry,) = await queue.list_engines()
        assert entry.weight_version == "1"
        await queue.set_policy(2, "/elsewhere/v2")  # outside the weights root: refused
        await registration.beat()
        assert service.current.version == "1"
    finally:
        await registration.close()
    assert await queue.list_engines() == []


def test_version_comparison() -> None:
    from mempo.registry import PolicyPointer

    pointer = PolicyPointer(version=3, path="/w/v3")
    assert is_newer(pointer, "2") and is_newer(pointer, "v2") and is_newer(pointer, "default")
    assert not is_newer(pointer, "3") and not is_newer(pointer, "my-finetune")


async def test_unreachable_redis_never_stops_the_heartbeat(loaded: LoadedModel) -> None:
    service, settings = _service(
        loaded, redis_url=f"redis://127.0.0.1:{free_port()}/0", heartbeat_s=0.05
    )
    registration = Registration(service, settings)
    stop = asyncio.Event()
    task = asyncio.create_task(registration.run(stop))
    await asyncio.sleep(0.8)
    assert not task.done()  # it backs off and keeps trying
    stop.set()
    await asyncio.wait_for(task, 5)
    assert registration.beats == 0
    await registration.close()


async def test_app_registers_while_it_runs(
    app_client: AppClient, redis_url: str, redis_client: object, keys: Keys
) -> None:
    queue = RedisQueue(redis_client, keys)  # type: ignore[arg-type]
    async with app_client(redis_url=redis_url, key_prefix=keys.prefix, heartbeat_s=0.1):
        for _ in range(50):
            if await queue.list_engines():
                break
            await asyncio.sleep(0.05)
        (entry,) = await queue.list_engines()
        assert entry.role == "scorer" and entry.url.endswith(":8002")
    assert await queue.list_engines() == []
