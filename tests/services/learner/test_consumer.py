"""Consumption: duplicates and stale groups dropped (acked, counted), dead letters (malformed
records, numbers out of range), batches."""

from __future__ import annotations

import asyncio
import json
import struct

import pytest

from mempo.arrays import dump_with_sidecar
from mempo.keys import Keys
from mempo.queue import Delivery, RedisQueue
from mempo.schemas import Group, Task
from services.learner.consumer import Batch, GroupConsumer, TrainedIds
from services.learner.state import LearnerState
from tests.services.learner.service_support import make_group


def _task(i: int, n: int = 2) -> Task:
    return Task(group_id=f"g{i}", questions=[f"q{i}?"], answers=[[f"a{i}"]], n=n)


async def _queue(redis_client: object, keys: Keys, **kw: int) -> RedisQueue:
    queue = RedisQueue(redis_client, keys, consumer="learner-0", **kw)  # type: ignore[arg-type]
    await queue.ensure_groups()
    return queue


def _consumer(queue: RedisQueue, batch: int = 2, staleness: int = 0, **kw: object) -> GroupConsumer:
    drops: list[str] = []
    consumer = GroupConsumer(
        queue,
        LearnerState(queue),
        batch,
        staleness,
        on_drop=drops.append,
        **kw,  # type: ignore[arg-type]
    )
    consumer.drops = drops  # type: ignore[attr-defined]
    return consumer


async def test_duplicates_are_dropped_acked_and_counted(redis_client: object, keys: Keys) -> None:
    queue = await _queue(redis_client, keys)
    consumer = _consumer(queue, batch=2, trained=TrainedIds(["g9"]))
    for i in (1, 1, 9, 2):  # g1 twice (a worker died before acking its task), g9 trained before
        await queue.publish_group(make_group(_task(i), seed=i))
    batch = await consumer.next_batch(version=0, block_ms=None)
    assert batch is not None and batch.group_ids == ["g1", "g2"]
    assert consumer.drops == ["duplicate", "duplicate"]  # type: ignore[attr-defined]
    counts = await LearnerState(queue).counts()
    assert (counts.dropped_duplicate, counts.dropped_stale, counts.consumed) == (2, 0, 0)
    assert (await queue.stream_lengths())["groups"] == 2  # the dropped ones are acked and gone
    await consumer.ack(batch)
    assert (await queue.stream_lengths())["groups"] == 0
    assert (await LearnerState(queue).counts()).consumed == 2
    await queue.publish_group(make_group(_task(2), seed=3))  # trained in this run: a duplicate
    assert await consumer.next_batch(version=0, block_ms=None) is None
    assert (await LearnerState(queue).counts()).dropped_duplicate == 3


async def test_stale_groups_are_dropped(redis_client: object, keys: Keys) -> None:
    queue = await _queue(redis_client, keys)
    consumer = _consumer(queue, batch=2, staleness=1)
    for i, version in enumerate([3, 4, 2, 5]):  # learner at 5: 4 and 5 are fresh enough
        await queue.publish_group(make_group(_task(i), policy_version=version))
    batch = await consumer.next_batch(version=5, block_ms=None)
    assert batch is not None and [g.policy_version for g in batch.groups] == [4, 5]
    counts = await LearnerState(queue).counts()
    assert (counts.dropped_stale, counts.dropped_duplicate) == (2, 0)
    assert consumer.drops == ["stale", "stale"]  # type: ignore[attr-defined]
    assert batch.staleness(version=5) == {"staleness_mean": 0.5, "staleness_max": 1.0}


async def test_malformed_records_go_to_the_dead_stream(redis_client: object, keys: Keys) -> None:
    queue = await _queue(redis_client, keys)
    consumer = _consumer(queue, batch=1)
    bad = make_group(_task(1)).model_dump(mode="json")
    bad["trajectories"] = bad["trajectories"][:1]  # n=2 asks for two
    await queue.redis.xadd(keys.groups, {"data": "not json at all"})
    await queue.redis.xadd(keys.groups, {"data": json.dumps(bad)})
    await queue.publish_group(make_group(_task(2)))
    batch = await consumer.next_batch(version=0, block_ms=None)
    assert batch is not None and batch.group_ids == ["g2"]
    dead = await queue.dead_letters()
    assert len(dead) == 2
    assert all(d["stream"] == keys.groups for d in dead)
    assert "malformed Group record" in dead[0]["reason"]
    assert "trajectories" in dead[1]["reason"] or "n=2" in dead[1]["reason"]


def _poisoned_json(group: Group, where: str, value: str) -> str:
    """The group's JSON with one number replaced by ``value`` (NaN, 1e308: what a broken
    or hostile producer writes straight into the stream, past any pydantic model)."""
    data = group.model_dump(mode="json")
    traj = data["trajectories"][0]
    if where == "logprob":
        traj["rounds"][0]["response_logprobs"][0] = "@"
    else:
        traj[where] = "@" if where == "reward" else ["@", *traj[where][1:]]
    return json.dumps(data).replace('"@"', value)


def _poisoned_sidecar(group: Group, value: float) -> tuple[str, bytes]:
    """The group as the worker publishes it (JSON + binary sidecar), one log-prob replaced."""
    text, blob = dump_with_sidecar(group)
    offset = json.loads(text)["trajectories"][0]["rounds"][0]["response_logprobs"]["ref"][0]
    return text, blob[:offset] + struct.pack("<d", value) + blob[offset + 8 :]


@pytest.mark.parametrize(
    ("where", "value"),
    [
        ("reward", "NaN"),
        ("reward", "1e308"),
        ("reward", "Infinity"),
        ("reward", "-0.5"),
        ("p_mem", "NaN"),
        ("p_full", "1.5"),
        ("logprob", "NaN"),
        ("logprob", "0.5"),
        ("logprob", "-1e308"),
        ("sidecar", "NaN"),
        ("sidecar", "Infinity"),
        ("sidecar", "0.25"),
        ("sidecar", "-1e308"),
    ],
)
async def test_out_of_range_numbers_are_dead_lettered_with_a_reason(
    redis_client: object, keys: Keys, where: str, value: str
) -> None:
    queue = await _queue(redis_client, keys)
    consumer = _consumer(queue, batch=1)
    bad = make_group(_task(1))
    if where == "sidecar":
        text, blob = _poisoned_sidecar(bad, float(value))
        await queue.redis.xadd(keys.groups, {"data": text, "blob": blob})
    else:
        await queue.redis.xadd(keys.groups, {"data": _poisoned_json(bad, where, value)})
    await queue.publish_group(make_group(_task(2)))
    batch = await consumer.next_batch(version=0, block_ms=None)
    assert batch is not None and batch.group_ids == ["g2"]
    (dead,) = await queue.dead_letters()
    assert "malformed Group record" in dead["reason"]
    named = {"sidecar": "log-probs", "logprob": "log-probs"}.get(where, where)
    assert named in dead["reason"], dead["reason"]


@pytest.mark.parametrize("value", ["1e308", "Infinity", "NaN", "101"])
async def test_a_temperature_no_engine_samples_at_is_dead_lettered(
    redis_client: object, keys: Keys, value: str
) -> None:
    queue = await _queue(redis_client, keys)
    consumer = _consumer(queue, batch=1)
    data = make_group(_task(1)).model_dump(mode="json")
    data["temperature"] = "@"
    await queue.redis.xadd(keys.groups, {"data": json.dumps(data).replace('"@"', value)})
    await queue.publish_group(make_group(_task(2)))
    batch = await consumer.next_batch(version=0, block_ms=None)
    assert batch is not None and batch.group_ids == ["g2"]
    (dead,) = await queue.dead_letters()
    assert "temperature" in dead["reason"], dead["reason"]


async def test_a_group_from_a_future_version_is_dead_lettered(redis_client: object, keys: Keys) -> None:
    queue = await _queue(redis_client, keys)
    consumer = _consumer(queue, batch=1, staleness=1)
    await queue.publish_group(make_group(_task(1), policy_version=10**12))
    await queue.publish_group(make_group(_task(2), policy_version=5))
    batch = await consumer.next_batch(version=5, block_ms=None)
    assert batch is not None and batch.group_ids == ["g2"]
    (dead,) = await queue.dead_letters()
    assert "policy_version 1000000000000 is ahead of the learner's 5" in dead["reason"]


async def test_a_restart_reads_its_pending_groups_first(redis_client: object, keys: Keys) -> None:
    queue = await _queue(redis_client, keys)
    for i in range(3):
        await queue.publish_group(make_group(_task(i)))
    first = await _consumer(queue, batch=2).next_batch(version=0, block_ms=None)
    assert first is not None and first.group_ids == ["g0", "g1"]  # claimed, never acked: a crash
    again = _consumer(await _queue(redis_client, keys), batch=3)
    batch = await again.next_batch(version=0, block_ms=None)
    assert batch is not None and batch.group_ids == ["g0", "g1", "g2"]
    assert [d.deliveries for d in batch.deliveries] == [2, 2, 1]


async def test_more_pending_than_a_batch_fills_several_batches(
    redis_client: object, keys: Keys
) -> None:
    queue = await _queue(redis_client, keys)
    for i in range(3):
        await queue.publish_group(make_group(_task(i), policy_version=0))
    crashed = await _consumer(queue, batch=3).next_batch(version=0, block_ms=None)
    assert crashed is not None
    again = _consumer(await _queue(redis_client, keys), batch=2, staleness=0)
    first = await again.next_batch(version=0, block_ms=None)
    assert first is not None and first.group_ids == ["g0", "g1"]
    await queue.publish_group(make_group(_task(3), policy_version=1))
    second = await again.next_batch(version=1, block_ms=None)  # trained: now at version 1
    assert second is None  # g2 waited and went stale; g3 alone is not a batch
    assert again.drops == ["stale"]  # type: ignore[attr-defined]
    assert again._batch.group_ids == ["g3"]


async def test_a_partial_batch_waits_for_more_groups(redis_client: object, keys: Keys) -> None:
    queue = await _queue(redis_client, keys)
    consumer = _consumer(queue, batch=3)
    await queue.publish_group(make_group(_task(0)))
    assert await consumer.next_batch(version=0, block_ms=None) is None
    assert await consumer.next_batch(version=0, block_ms=50) is None  # blocks, then gives up
    await queue.publish_group(make_group(_task(1)))
    await queue.publish_group(make_group(_task(2)))
    batch = await consumer.next_batch(version=0, block_ms=None)
    assert batch is not None and batch.group_ids == ["g0", "g1", "g2"]


async def test_a_group_that_keeps_failing_ends_dead_with_its_reason(
    redis_client: object, keys: Keys
) -> None:
    queue = await _queue(redis_client, keys, claim_idle_ms=1, max_deliveries=2)
    await queue.publish_group(make_group(_task(0)))
    consumer = _consumer(queue, batch=1)
    for _ in range(2):
        batch = await consumer.next_batch(version=0, block_ms=None)
        assert batch is not None
        await consumer.release(batch, "trainer: token id out of range")
        await asyncio.sleep(0.01)
    assert await consumer.next_batch(version=0, block_ms=None) is None
    (dead,) = await queue.dead_letters()
    assert "after 2 deliveries" in dead["reason"]
    assert "token id out of range" in dead["reason"]


def test_staleness_of_a_batch() -> None:
    groups = [make_group(_task(i), policy_version=v) for i, v in enumerate([2, 3, 1])]
    batch = Batch([Delivery(f"{i}-0", g, 1) for i, g in enumerate(groups)])
    assert batch.staleness(version=3) == {"staleness_mean": 1.0, "staleness_max": 2.0}


def test_trained_ids_are_bounded_and_ordered() -> None:
    ids = TrainedIds([f"g{i}" for i in range(5)], limit=3)
    assert "g1" not in ids and "g4" in ids and len(ids) == 3
    assert ids.with_(["g5"]) == ["g3", "g4", "g5"]
    assert len(ids) == 3 and "g2" in ids  # with_ leaves the set unchanged
