"""mempo/membership.py on a real Redis: the entry, its TTL, the hook after each beat,
leaving, and a Redis that goes away."""

from __future__ import annotations

import asyncio

from mempo.keys import Keys
from mempo.membership import Membership
from mempo.procs import free_port
from mempo.queue import RedisQueue, connect
from mempo.registry import EngineInfo


async def test_beats_register_with_a_ttl_run_the_hook_and_leave(redis_url: str, keys: Keys) -> None:
    queue = RedisQueue(connect(redis_url), keys)
    version = {"now": "1"}
    hooks: list[str] = []

    async def after() -> None:
        hooks.append(version["now"])

    membership = Membership(
        queue, lambda: EngineInfo(id="w-1", url="http://w-1:8003", weight_version=version["now"]),
        heartbeat_s=0.05, ttl_s=7, after_beat=after,
    )  # fmt: skip
    stop = asyncio.Event()
    task = asyncio.create_task(membership.run(stop))
    try:
        for _ in range(100):
            if membership.beats >= 2:
                break
            await asyncio.sleep(0.02)
        assert membership.problem is None and hooks[:2] == ["1", "1"]
        assert 0 < await queue.redis.ttl(keys.engine("w-1")) <= 7
        version["now"] = "2"  # each beat writes the entry as it is now
        for _ in range(100):
            if {e.weight_version for e in await queue.list_engines()} == {"2"}:
                break
            await asyncio.sleep(0.02)
        assert [e.weight_version for e in await queue.list_engines()] == ["2"]
    finally:
        stop.set()
        await task
    await membership.leave("w-1")
    assert await queue.list_engines() == []
    await queue.redis.aclose()


async def test_an_unreachable_redis_is_a_problem_not_a_crash(keys: Keys) -> None:
    queue = RedisQueue(connect(f"redis://127.0.0.1:{free_port()}/0"), keys)
    membership = Membership(queue, lambda: EngineInfo(id="w", url="http://w"), heartbeat_s=0.05, ttl_s=1)
    stop = asyncio.Event()
    task = asyncio.create_task(membership.run(stop))
    await asyncio.sleep(0.5)
    assert membership.beats == 0 and "cannot register in Redis" in (membership.problem or "")
    assert not task.done()
    stop.set()
    await asyncio.wait_for(task, 35)
    await membership.leave("w")  # logged, not raised
    await queue.redis.aclose()
