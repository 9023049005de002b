"""The worker against a real redis-server: publish then ack, failures, reclaim, policy, registry."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from mempo.bm25 import LocalSearch
from mempo.keys import ROLLOUT_GROUP, Keys
from mempo.procs import free_port
from mempo.queue import RedisQueue, connect
from mempo.retry import cancel_and_wait
from mempo.schemas import Group, Task
from mempo_sim.world import World
from tests.services.rollout.scripted import ScriptedEngine, ScriptedScorer, booted_worker


def make_queue(redis: Any, keys: Keys, consumer: str, **kw: Any) -> RedisQueue:
    kw.setdefault("claim_idle_ms", 200)
    return RedisQueue(redis, keys, consumer=consumer, **kw)


def make_tasks(world: World, count: int, mode: str = "memory", n: int = 2) -> list[Task]:
    return [
        Task(questions=qs, answers=ans, n=n, mode=mode, max_rounds=16)
        for qs, ans in world.tasks("test", 2, count, seed=11)
    ]


async def publish(queue: RedisQueue, tasks: list[Task]) -> None:
    await queue.ensure_groups()
    for task in tasks:
        await queue.publish_task(task)


async def learner_groups(redis: Any, keys: Keys) -> list[Group]:
    learner = make_queue(redis, keys, "learner")
    got = await learner.claim_groups(1000, block_ms=None)
    await learner.ack_groups([d.entry_id for d in got])
    return [d.record for d in got]


async def pending_tasks(redis: Any, keys: Keys) -> int:
    return int((await redis.xpending(keys.tasks, ROLLOUT_GROUP))["pending"])


async def test_tasks_become_groups_and_are_acked(
    redis_client: Any, keys: Keys, tokenizer: Any, world: World, local_search: LocalSearch
) -> None:
    tasks = make_tasks(world, 3)
    queue = make_queue(redis_client, keys, "w1")
    await publish(queue, tasks)
    engine = ScriptedEngine.oracle(tokenizer, world, "memory")
    async with booted_worker(engine, local_search, tokenizer, ScriptedScorer(), queue) as worker:
        assert await worker.run(burst=True) == 3
        assert worker.metrics.tasks_done == 3 and worker.metrics.in_flight_tasks == 0
    groups = await learner_groups(redis_client, keys)
    assert sorted(g.group_id for g in groups) == sorted(t.group_id for t in tasks)
    assert all(t.correct and len(t.p_mem) == len(t.rounds) for g in groups for t in g.trajectories)
    assert (await queue.stream_lengths())["tasks"] == 0 and await pending_tasks(
        redis_client, keys
    ) == 0


async def test_a_scorer_failure_is_recorded_and_the_task_redelivered(
    redis_client: Any, keys: Keys, tokenizer: Any, world: World, local_search: LocalSearch
) -> None:
    (task,) = make_tasks(world, 1)
    broken = make_queue(redis_client, keys, "broken")
    await publish(broken, [task])
    engine = ScriptedEngine.oracle(tokenizer, world, "memory")
    async with booted_worker(
        engine, local_search, tokenizer, ScriptedScorer(500), broken
    ) as worker:
        assert await worker.run(burst=True) == 1
        assert worker.metrics.tasks_failed == 1
    assert (await broken.stream_lengths())["groups"] == 0  # nothing published ...
    assert await pending_tasks(redis_client, keys) == 1  # ... nothing acked
    failures = await redis_client.hgetall(keys.failures)
    assert len(failures) == 1 and "the scorer failed" in next(iter(failures.values()))

    await asyncio.sleep(0.25)  # past claim_idle_ms: another worker gets it
    healthy = make_queue(redis_client, keys, "healthy")
    async with booted_worker(engine, local_search, tokenizer, ScriptedScorer(), healthy) as worker:
        assert await worker.run(burst=True) == 1
    (group,) = await learner_groups(redis_client, keys)
    assert group.task.task_id == task.task_id and group.scorer_version == "7"
    assert (
        await pending_tasks(redis_client, keys) == 0 and await redis_client.hlen(keys.failures) == 0
    )


async def test_a_task_that_keeps_failing_is_dead_lettered_with_its_reason(
    redis_client: Any, keys: Keys, tokenizer: Any, world: World, local_search: LocalSearch
) -> None:
    (task,) = make_tasks(world, 1, n=1)
    queue = make_queue(redis_client, keys, "w", claim_idle_ms=50, max_deliveries=2)
    await publish(queue, [task])
    engine = ScriptedEngine.oracle(tokenizer, world, "memory")
    async with booted_worker(engine, local_search, tokenizer, ScriptedScorer(503), queue) as worker:
        for _ in range(3):
            await worker.run(burst=True)
            await asyncio.sleep(0.08)
    (dead,) = await queue.dead_letters()
    assert "max_deliveries=2" in dead["reason"] and "the scorer failed" in dead["reason"]
    assert Task.model_validate_json(dead["data"]) == task
    assert await pending_tasks(redis_client, keys) == 0


class AckNeverReturns(RedisQueue):
    """A worker that dies after publishing but before its ack."""

    async def ack_task(self, entry_id: str) -> None:
        await asyncio.Event().wait()


@pytest.mark.parametrize("dies", ["before publish", "after publish"])
async def test_a_killed_worker_s_tasks_are_finished_by_another(
    dies: str,
    redis_client: Any,
    keys: Keys,
    tokenizer: Any,
    world: World,
    local_search: LocalSearch,
) -> None:
    tasks = make_tasks(world, 3)
    queue_class = AckNeverReturns if dies == "after publish" else RedisQueue
    doomed = queue_class(redis_client, keys, consumer="doomed", claim_idle_ms=300)
    await publish(doomed, tasks)
    stuck = ScriptedEngine.oracle(tokenizer, world, "memory")
    if dies == "before publish":
        stuck.gate = asyncio.Event()  # never set: generation hangs mid-task
    async with booted_worker(stuck, local_search, tokenizer, ScriptedScorer(), doomed) as worker:
        loop = asyncio.create_task(worker.run())
        for _ in range(200):
            await asyncio.sleep(0.02)
            if await pending_tasks(redis_client, keys) == 3 and (
                stuck.in_flight if dies == "before publish" else await doomed.stream_lengths()
            ) == (6 if dies == "before publish" else {"tasks": 3, "groups": 3, "dead": 0}):
                break
        await cancel_and_wait([loop])  # the kill: no drain, no ack
    assert await pending_tasks(redis_client, keys) == 3

    await asyncio.sleep(0.35)
    rescuer = make_queue(redis_client, keys, "rescuer", claim_idle_ms=300)
    engine = ScriptedEngine.oracle(tokenizer, world, "memory")
    async with booted_worker(engine, local_search, tokenizer, ScriptedScorer(), rescuer) as worker:
        assert await worker.run(burst=True) == 3
    groups = await learner_groups(redis_client, keys)
    assert len(groups) == (3 if dies == "before publish" else 6)
    unique = {g.group_id: g for g in groups}  # the learner's dedup
    assert sorted(g.task.task_id for g in unique.values()) == sorted(t.task_id for t in tasks)
    assert await pending_tasks(redis_client, keys) == 0


async def test_a_slow_task_keeps_its_lease(
    redis_client: Any, keys: Keys, tokenizer: Any, world: World, local_search: LocalSearch
) -> None:
    (task,) = make_tasks(world, 1, n=1)
    queue = make_queue(redis_client, keys, "slow", claim_idle_ms=150)
    await publish(queue, [task])
    engine = ScriptedEngine.oracle(tokenizer, world, "memory")
    engine.delay_s = 0.1  # ~5 rounds: the task takes several claim_idle_ms
    other = make_queue(redis_client, keys, "thief", claim_idle_ms=150)
    async with booted_worker(engine, local_search, tokenizer, ScriptedScorer(), queue) as worker:
        loop = asyncio.create_task(worker.run(burst=True))
        stolen = []
        while not loop.done():
            await asyncio.sleep(0.05)
            got = await other.claim_task(block_ms=None)
            if got is not None:
                stolen.append(got)
        assert await loop == 1
    assert stolen == [] and worker.metrics.rounds >= 3
    assert len(await learner_groups(redis_client, keys)) == 1


async def test_a_task_whose_lease_lapsed_is_not_run_twice_by_its_own_worker(
    redis_client: Any, keys: Keys, tokenizer: Any, world: World, local_search: LocalSearch
) -> None:
    # A stalled event loop (a loaded machine) can miss lease renewals; the worker's own idle
    # scan then hands it the task it is still running. It must not start a second copy.
    (task,) = make_tasks(world, 1, n=1)
    queue = make_queue(redis_client, keys, "w", claim_idle_ms=150, max_deliveries=50)
    await publish(queue, [task])

    async def lapsed(entry_id: str) -> bool:
        return True  # renewals that never reach Redis

    queue.renew_task = lapsed  # type: ignore[method-assign]
    engine = ScriptedEngine.oracle(tokenizer, world, "memory")
    engine.delay_s = 0.1  # the task outlives several claim_idle_ms
    async with booted_worker(
        engine, local_search, tokenizer, ScriptedScorer(), queue, claim_block_ms=20
    ) as worker:
        loop = asyncio.create_task(worker.run())
        for _ in range(400):  # at most 20 s
            if not (await queue.stream_lengths())["tasks"]:  # acked
                break
            await asyncio.sleep(0.05)
        await worker.stop()
        assert await loop == 1
    assert worker.metrics.tasks_done == 1 and worker.metrics.rounds >= 3
    assert len(await learner_groups(redis_client, keys)) == 1


async def test_the_engine_is_brought_to_the_policy_before_work(
    redis_client: Any, keys: Keys, tokenizer: Any, world: World, local_search: LocalSearch
) -> None:
    (task,) = make_tasks(world, 1, n=1)
    queue = make_queue(redis_client, keys, "w")
    await publish(queue, [task])
    await queue.set_policy(3, "/weights/v3")
    engine = ScriptedEngine.oracle(tokenizer, world, "memory")
    async with booted_worker(
        engine, local_search, tokenizer, ScriptedScorer(), queue, engine_admin_token="s3cret"
    ) as worker:
        await worker.run(burst=True)
        assert worker.status().engine_weight_version == "3" and worker.status().policy_version == 3
        (update,) = engine.updates  # once: afterwards the engine is current
        assert update["model_path"] == "/weights/v3" and update["weight_version"] == "3"
        assert update["authorization"] == "Bearer s3cret"
        (group,) = await learner_groups(redis_client, keys)
        assert group.policy_version == 3
        engine.weight_version = "0"  # the engine restarted: back on its base weights
        await publish(queue, make_tasks(world, 1, n=1))
        await worker.run(burst=True)
        assert [u["weight_version"] for u in engine.updates] == ["3", "3"]  # caught up first
        assert {g.policy_version for g in await learner_groups(redis_client, keys)} == {3}


async def test_the_worker_registers_with_a_heartbeat_and_leaves_on_stop(
    redis_client: Any, keys: Keys, tokenizer: Any, world: World, local_search: LocalSearch
) -> None:
    queue = make_queue(redis_client, keys, "w")
    engine = ScriptedEngine.oracle(tokenizer, world, "memory", weight_version="2")
    async with booted_worker(
        engine,
        local_search,
        tokenizer,
        queue=queue,
        worker_id="w",
        public_url="http://10.0.0.5:8003",
        registry_ttl_s=1,
        admin_token="worker-token-0123456789",
    ) as worker:
        worker.start()
        for _ in range(100):
            await asyncio.sleep(0.02)
            if worker.consuming and await queue.list_engines():
                break
        (entry,) = await queue.list_engines()
        # The learner updates the engine through the worker: the entry names the worker.
        assert entry.id == "w" and entry.role == "rollout" and entry.url == "http://10.0.0.5:8003"
        assert entry.worker_url == "http://10.0.0.5:8003"
        # signed with the worker's admin token: the learner holding it will trust the entry
        assert entry.proven("worker-token-0123456789") and not entry.proven("another-token-0123456")
        assert 0 < await redis_client.ttl(keys.engine("w")) <= 1
        await asyncio.sleep(1.2)  # the heartbeat keeps it alive past its TTL
        assert [e.id for e in await queue.list_engines()] == ["w"]
        await worker.stop()
        assert not worker.consuming and await queue.list_engines() == []


async def test_redis_down_backs_off_and_stops_cleanly(
    tokenizer: Any, keys: Keys, world: World, local_search: LocalSearch
) -> None:
    redis = connect(f"redis://127.0.0.1:{free_port()}/0")
    queue = make_queue(redis, keys, "w")
    engine = ScriptedEngine.oracle(tokenizer, world, "memory")
    async with booted_worker(engine, local_search, tokenizer, queue=queue) as worker:
        loop = asyncio.create_task(worker.run())
        await asyncio.sleep(0.6)
        assert not loop.done()  # still trying, not crashed
        await worker.stop()
        assert await asyncio.wait_for(loop, 2) == 0
    await redis.aclose()


async def test_a_malformed_policy_pointer_stalls_the_loop_visibly_and_it_recovers(
    redis_client: Any, keys: Keys, tokenizer: Any, world: World, local_search: LocalSearch
) -> None:
    """`HSET mempo:policy version abc` once ended the consumer loop silently for good."""
    (task,) = make_tasks(world, 1, n=1)
    queue = make_queue(redis_client, keys, "w")
    await publish(queue, [task])
    await redis_client.hset(keys.policy, mapping={"version": "abc", "path": "/weights/v1"})
    engine = ScriptedEngine.oracle(tokenizer, world, "memory")
    async with booted_worker(engine, local_search, tokenizer, ScriptedScorer(), queue) as worker:
        loop = asyncio.create_task(worker.run())
        for _ in range(100):
            await asyncio.sleep(0.02)
            if worker.metrics.consume_errors >= 2:
                break
        assert not loop.done() and worker.consuming  # backing off, not dead
        ready, reason = worker.readiness()
        assert not ready and reason is not None and keys.policy in reason and "malformed" in reason
        assert worker.metrics.tasks_done == 0
        await queue.set_policy(0, "/weights/v0")  # fixed: the loop goes on by itself
        for _ in range(300):
            await asyncio.sleep(0.05)
            if worker.metrics.tasks_done == 1:
                break
        assert worker.metrics.tasks_done == 1 and worker.readiness() == (True, None)
        await worker.stop()
        await asyncio.wait_for(loop, 5)
    assert len(await learner_groups(redis_client, keys)) == 1
