"""The Redis layer against a real redis-server: ack, reclaim, dead letters, registry."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
from redis.exceptions import RedisError

from mempo.keys import LEARNER_GROUP, ROLLOUT_GROUP, Keys
from mempo.queue import RedisQueue
from mempo.registry import EngineInfo
from mempo.retry import cancel_and_wait
from mempo.schemas import Task
from tests.core.test_schemas import make_group


def queue(redis: Any, keys: Keys, consumer: str, **kw: Any) -> RedisQueue:
    return RedisQueue(redis, keys, consumer=consumer, claim_idle_ms=kw.pop("claim_idle_ms", 150), **kw)


def task(i: int = 0) -> Task:
    return Task(questions=[f"q{i}"], answers=[["a"]], n=2)


async def test_publish_claim_ack_deletes(redis_client: Any, keys: Keys) -> None:
    q = queue(redis_client, keys, "a")
    await q.ensure_groups()
    await q.ensure_groups()  # idempotent
    sent = task()
    await q.publish_task(sent)
    got = await q.claim_task(block_ms=None)
    assert got is not None and got.record == sent and got.deliveries == 1
    assert await q.claim_task(block_ms=None) is None  # nothing else, and the claimed one is pending
    await q.ack_task(got.entry_id)
    assert (await q.stream_lengths())["tasks"] == 0
    assert await redis_client.xpending(keys.tasks, ROLLOUT_GROUP) == {"pending": 0, "min": None, "max": None, "consumers": []}


async def test_blocking_claim_times_out(redis_client: Any, keys: Keys) -> None:
    q = queue(redis_client, keys, "a")
    await q.ensure_groups()
    assert await q.claim_task(block_ms=50) is None


async def test_the_longest_claim_block_a_worker_accepts_ends_empty_not_in_a_timeout(
    redis_client: Any, keys: Keys
) -> None:
    """redis-py 8 reads with a 5 s socket timeout: a longer XREADGROUP BLOCK raised
    TimeoutError on every claim, so the worker's setting stops below it."""
    from annotated_types import Le

    from services.rollout.settings import WorkerSettings

    field = WorkerSettings.model_fields["claim_block_ms"]
    longest = next(m.le for m in field.metadata if isinstance(m, Le))
    assert isinstance(longest, int) and longest < 5000
    q = queue(redis_client, keys, "a")
    await q.ensure_groups()
    assert await q.claim_task(block_ms=longest) is None


async def test_reclaim_after_a_consumer_dies(redis_client: Any, keys: Keys) -> None:
    dead, alive = queue(redis_client, keys, "dead"), queue(redis_client, keys, "alive")
    await dead.ensure_groups()
    await dead.publish_task(task())
    first = await dead.claim_task(block_ms=None)
    assert first is not None  # ... and "dead" never acks
    assert await alive.claim_task(block_ms=None) is None  # not idle long enough yet
    await asyncio.sleep(0.2)
    second = await alive.claim_task(block_ms=None)
    assert second is not None and second.entry_id == first.entry_id and second.deliveries == 2
    await alive.ack_task(second.entry_id)
    assert await alive.claim_task(block_ms=None) is None


async def test_dead_letter_after_max_deliveries_with_last_error(redis_client: Any, keys: Keys) -> None:
    q = queue(redis_client, keys, "w", max_deliveries=2)
    await q.ensure_groups()
    await q.publish_task(task(7))
    for _ in range(2):
        got = await q.claim_task(block_ms=None)
        assert got is not None
        await q.record_failure(got.entry_id, "scorer unavailable")
        await asyncio.sleep(0.2)
    assert await q.claim_task(block_ms=None) is None
    dead = await q.dead_letters()
    assert len(dead) == 1
    assert "max_deliveries=2" in dead[0]["reason"] and "scorer unavailable" in dead[0]["reason"]
    assert Task.model_validate_json(dead[0]["data"]).questions == ["q7"]
    assert (await q.stream_lengths())["tasks"] == 0
    assert await redis_client.hlen(keys.failures) == 0


async def test_malformed_records_go_to_dead(redis_client: Any, keys: Keys) -> None:
    q = queue(redis_client, keys, "w")
    await q.ensure_groups()
    await redis_client.xadd(keys.tasks, {"data": "{not json"})
    await redis_client.xadd(keys.groups, {"data": '{"group_id": "g"}'})
    assert await q.claim_task(block_ms=None) is None
    assert await q.claim_groups(5, block_ms=None) == []
    reasons = [d["reason"] for d in await q.dead_letters()]
    assert reasons[0].startswith("malformed Task record")
    assert reasons[1].startswith("malformed Group record") and "task" in reasons[1]


async def test_a_huge_junk_record_is_dead_lettered_trimmed_with_its_reason(
    redis_client: Any, keys: Keys
) -> None:
    """Three 50 MB junk entries once grew Redis by 144 MB: the dead stream kept them whole."""
    from mempo.queue import DEAD_PAYLOAD_BYTES

    q = queue(redis_client, keys, "learner")
    await q.ensure_groups()
    await redis_client.xadd(keys.groups, {"data": "{" + "x" * 5_000_000, "blob": b"\0" * 1_000_000})
    assert await q.claim_groups(5, block_ms=None) == []
    (dead,) = await q.dead_letters()
    assert dead["reason"].startswith("malformed Group record")
    assert len(dead["data"]) == DEAD_PAYLOAD_BYTES and "blob_b64" not in dead
    assert dead["truncated"] == "5000001 data bytes, 1000000 sidecar bytes"
    assert int(await redis_client.memory_usage(keys.dead)) < 2 * DEAD_PAYLOAD_BYTES
    # a small record stays whole, sidecar included: it can be inspected and replayed
    group = make_group()
    await q.publish_group(group)
    (delivery,) = await q.claim_groups(5, block_ms=None)
    await q.dead_letter(keys.groups, LEARNER_GROUP, delivery.entry_id, group.model_dump_json(), "test", b"abc")
    kept = (await q.dead_letters())[-1]
    assert kept["data"] == group.model_dump_json() and kept["blob_b64"] == "YWJj" and "truncated" not in kept


async def test_groups_round_trip_packed(redis_client: Any, keys: Keys) -> None:
    q = queue(redis_client, keys, "learner")
    await q.ensure_groups()
    groups = [make_group(), make_group()]
    for g in groups:
        await q.publish_group(g)
    raw = await q.raw.xrange(keys.groups)  # bytes: the arrays travel in a binary sidecar
    assert b'"ref"' in raw[0][1][b"data"] and len(raw[0][1][b"blob"]) > 500
    got = await q.claim_groups(5, block_ms=None)
    assert [d.record for d in got] == groups
    # a restart of the same consumer reads back what it never acked
    again = await queue(redis_client, keys, "learner").pending_groups(10)
    assert [d.entry_id for d in again] == [d.entry_id for d in got]
    await q.ack_groups([d.entry_id for d in got])
    assert await q.pending_groups(10) == []
    await q.aclose()
    assert (await redis_client.xpending(keys.groups, LEARNER_GROUP))["pending"] == 0


async def test_burst_drain(redis_client: Any, keys: Keys) -> None:
    q = queue(redis_client, keys, "w")
    await q.ensure_groups()
    for i in range(5):
        await q.publish_task(task(i))
    seen = []
    while (got := await q.claim_task(block_ms=None)) is not None:  # burst mode: drain, then return
        seen.append(got.record.questions[0])
        await q.ack_task(got.entry_id)
    assert seen == [f"q{i}" for i in range(5)]


async def test_engine_registry_expires(redis_client: Any, keys: Keys) -> None:
    q = queue(redis_client, keys, "w")
    await q.register_engine(EngineInfo(id="e1", url="http://127.0.0.1:1", weight_version="2"), ttl_s=1)
    await q.register_engine(EngineInfo(id="s1", role="scorer", url="http://127.0.0.1:2"), ttl_s=30)
    assert [e.id for e in await q.list_engines()] == ["e1", "s1"]
    await asyncio.sleep(1.2)
    assert [e.id for e in await q.list_engines()] == ["s1"]
    await q.unregister_engine("s1")
    assert await q.list_engines() == []


async def test_policy_and_state(redis_client: Any, keys: Keys) -> None:
    q = queue(redis_client, keys, "w")
    assert await q.get_policy() is None
    await q.set_policy(4, "/weights/v4")
    policy = await q.get_policy()
    assert policy is not None and (policy.version, policy.path) == (4, "/weights/v4")
    await q.set_state(step=3, admitted=10, note="x")
    assert await q.get_state() == {"step": "3", "admitted": "10", "note": "x"}


async def test_prefixes_isolate_runs(redis_client: Any) -> None:
    a, b = queue(redis_client, Keys("runA:"), "w"), queue(redis_client, Keys("runB:"), "w")
    for q in (a, b):
        await q.ensure_groups()
    await a.publish_task(task())
    assert await b.claim_task(block_ms=None) is None
    assert await a.claim_task(block_ms=None) is not None
    with pytest.raises(ValueError):
        Keys("bad prefix*")


async def test_claim_loops_cancelled_at_any_moment_all_end(redis_client: Any, keys: Keys) -> None:
    """A single cancel of such a loop was lost 17 times in 400 (redis-py's send under
    wait_for): every one of these must end, each within a few re-cancels. The loop retries
    Redis errors as the worker's does (once, in a full run, a loop that did not ended with
    an error rather than cancelled)."""
    queue = RedisQueue(redis_client, keys, consumer="c", claim_idle_ms=300)
    await queue.ensure_groups()

    async def claims() -> None:  # as the rollout worker's loop: a Redis error is retried
        while True:
            with contextlib.suppress(RedisError):  # (a cancel mid-command may become one)
                await queue.get_policy()
                await queue.claim_task(block_ms=20)

    for i in range(60):
        task = asyncio.create_task(claims())
        await asyncio.sleep(0.001 * (i % 40))
        # fails (TimeoutError) if the loop is still running 5 s on: a single cancel failed so
        await asyncio.wait_for(cancel_and_wait([task], every_s=0.2), 5)
