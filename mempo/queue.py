"""The Redis layer: task and group streams, dead letters, policy pointer, engine registry.

Streams with consumer groups give at-least-once delivery: a record stays pending until
its consumer acks it, and a consumer that dies leaves it to be reclaimed (XAUTOCLAIM)
by another after ``claim_idle_ms``. A record delivered ``max_deliveries`` times without
an ack, or one that does not decode, goes to the dead stream with its reason; nothing
is dropped silently. Acked entries are deleted, so streams do not grow without bound.

Consumers loop over ``claim_*``; ``block_ms=None`` makes a claim non-blocking, which is
the "burst" mode tests use to drain a stream deterministically.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import redis.asyncio as aioredis
from pydantic import ValidationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from mempo.arrays import dump_with_sidecar, load_with_sidecar
from mempo.keys import LEARNER_GROUP, ROLLOUT_GROUP, Keys
from mempo.registry import EngineInfo, PolicyPointer
from mempo.schemas import Group, Task

# What an unreachable Redis raises: retried by every service, never fatal.
REDIS_ERRORS = (RedisConnectionError, RedisTimeoutError)


class MalformedKey(ValueError):
    """A Redis key holds what no service wrote (a counter "x", a pointer without a
    version): the message names the key. Services report it and retry, as for a Redis
    error, until someone fixes the key."""

log = logging.getLogger(__name__)

R = TypeVar("R", Task, Group)
DEAD_STREAM_MAXLEN = 100_000
DEAD_PAYLOAD_BYTES = 256 * 1024  # a dead record's payload kept whole up to this size


@dataclass(frozen=True)
class Delivery(Generic[R]):
    """A claimed record; ack it by ``entry_id`` once it is durably handled."""

    entry_id: str
    record: R
    deliveries: int


def connect(url: str, password: str | None = None) -> aioredis.Redis:
    """An asyncio Redis client with string replies and bounded connect time.

    ``password`` travels apart from the URL, so it may hold any character (a password in
    the URL must be URL-quoted). A URL that does not parse is a ValueError whose message
    holds no part of the URL: a mis-quoted password would leak through it."""
    extra: dict[str, Any] = {"password": password} if password else {}
    try:
        return aioredis.Redis.from_url(
            url, decode_responses=True, socket_connect_timeout=5, health_check_interval=15, **extra
        )
    except ValueError:
        raise ValueError(
            "the Redis URL does not parse (URL-quote a password in it, or set the password "
            "in the service's REDIS_PASSWORD setting)"
        ) from None


async def redis_problem(redis: aioredis.Redis, timeout_s: float = 2.0) -> str | None:
    """Why Redis cannot be used now (unreachable, wrong password, ...), or None if PING works.
    The reason names the error, never the URL or a secret."""
    for _attempt in range(2):  # a pooled connection that Redis closed fails once, then reconnects
        try:
            await asyncio.wait_for(redis.ping(), timeout_s)  # type: ignore[misc]
            return None
        except (RedisError, OSError, TimeoutError) as exc:
            detail = str(exc).splitlines()[0][:200] if str(exc) else "no answer"
            problem = f"Redis is not usable: {type(exc).__name__}: {detail}"
    return problem


class RedisQueue:
    """Streams, dead letters, policy pointer and engine registry under one key prefix."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys | None = None,
        consumer: str = "consumer",
        claim_idle_ms: int = 60_000,
        max_deliveries: int = 3,
    ) -> None:
        if max_deliveries < 1 or claim_idle_ms < 1:
            raise ValueError("max_deliveries and claim_idle_ms must be positive")
        self.redis: Any = redis  # redis-py's async stubs type replies as bytes | str
        self.raw: Any = _binary_twin(redis)
        self._last_reclaim: dict[str, float] = {}
        self.keys = keys or Keys()
        self.consumer = consumer
        self.claim_idle_ms = claim_idle_ms
        self.max_deliveries = max_deliveries

    async def aclose(self) -> None:
        """Close the binary twin connection (the caller owns ``redis``)."""
        await self.raw.aclose()

    async def ensure_groups(self) -> None:
        """Create both streams and their consumer groups if missing (idempotent)."""
        for stream, group in ((self.keys.tasks, ROLLOUT_GROUP), (self.keys.groups, LEARNER_GROUP)):
            try:
                await self.redis.xgroup_create(stream, group, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    # ----------------------------------------------------------------- tasks and groups

    async def publish_task(self, task: Task) -> str:
        return str(await self.redis.xadd(self.keys.tasks, {"data": task.model_dump_json()}))

    async def admit_tasks(self, tasks: list[Task], counter: str = "admitted") -> None:
        """Publish ``tasks`` and add their number to the learner state's ``counter`` in one
        transaction: a crash neither loses an admitted task from the count nor counts one
        never sent."""
        async with self.redis.pipeline(transaction=True) as pipe:
            for task in tasks:
                pipe.xadd(self.keys.tasks, {"data": task.model_dump_json()})
            pipe.hincrby(self.keys.learner_state, counter, len(tasks))
            await pipe.execute()

    async def claim_task(self, block_ms: int | None = 1000) -> Delivery[Task] | None:
        """One task for this consumer: a reclaimed idle one first, else a new one."""
        got = await self._claim(self.keys.tasks, ROLLOUT_GROUP, Task, 1, block_ms)
        return got[0] if got else None

    async def ack_task(self, entry_id: str) -> None:
        await self._ack(self.keys.tasks, ROLLOUT_GROUP, [entry_id])

    async def renew_task(self, entry_id: str) -> bool:
        """Reset the idle time of a task this consumer still holds (a lease heartbeat), so a
        task that takes longer than ``claim_idle_ms`` is not reclaimed while it runs. The
        delivery count is not incremented (XCLAIM JUSTID). False: another consumer has it."""
        mine = await self.redis.xpending_range(
            self.keys.tasks, ROLLOUT_GROUP, min=entry_id, max=entry_id, count=1,
            consumername=self.consumer,
        )
        if not mine:
            return False
        await self.redis.xclaim(
            self.keys.tasks, ROLLOUT_GROUP, self.consumer, 0, [entry_id], justid=True
        )
        return True

    async def publish_group(self, group: Group) -> str:
        """Token arrays travel as raw bytes beside the JSON (mempo.arrays sidecar)."""
        text, blob = dump_with_sidecar(group)
        return str(await self.redis.xadd(self.keys.groups, {"data": text, "blob": blob}))

    async def claim_groups(self, count: int, block_ms: int | None = 1000) -> list[Delivery[Group]]:
        return await self._claim(self.keys.groups, LEARNER_GROUP, Group, count, block_ms)

    async def pending_groups(self, count: int) -> list[Delivery[Group]]:
        """Groups this consumer claimed but never acked (a restart reads them back first)."""
        reply = await self.raw.xreadgroup(LEARNER_GROUP, self.consumer, {self.keys.groups: "0"}, count=count)
        entries = [entry for _, stream_entries in reply or [] for entry in stream_entries]
        return await self._decode_all(self.keys.groups, LEARNER_GROUP, Group, entries)

    async def ack_groups(self, entry_ids: list[str]) -> None:
        await self._ack(self.keys.groups, LEARNER_GROUP, entry_ids)

    async def record_failure(self, entry_id: str, reason: str) -> None:
        """Remember why handling failed; the reason goes with the record if it dies."""
        await self.redis.hset(self.keys.failures, entry_id, reason[:2000])

    async def dead_letter(
        self, stream: str, group: str, entry_id: str, data: str, reason: str, blob: bytes | None = None
    ) -> None:
        """Move a record to the dead stream with its reason, and ack it where it was. A
        payload over ``DEAD_PAYLOAD_BYTES`` (JSON and sidecar) keeps only the JSON's first
        ``DEAD_PAYLOAD_BYTES`` characters: junk cannot grow Redis by what it weighs."""
        fields = {"stream": stream, "entry_id": entry_id, "reason": reason[:2000], "data": data, "at": str(time.time())}
        if len(data) + len(blob or b"") > DEAD_PAYLOAD_BYTES:
            fields |= {"data": data[:DEAD_PAYLOAD_BYTES], "truncated": f"{len(data)} data bytes, {len(blob or b'')} sidecar bytes"}
        elif blob:
            fields["blob_b64"] = base64.b64encode(blob).decode()
        await self.redis.xadd(
            self.keys.dead,
            fields,
            maxlen=DEAD_STREAM_MAXLEN,
            approximate=True,
        )
        await self._ack(stream, group, [entry_id])
        log.warning("dead-lettered %s %s: %s", stream, entry_id, reason)

    async def dead_letters(self, count: int = 100) -> list[dict[str, str]]:
        entries = await self.redis.xrange(self.keys.dead, count=count)
        return [dict(fields, dead_id=entry_id) for entry_id, fields in entries]

    async def _ack(self, stream: str, group: str, entry_ids: list[str]) -> None:
        if not entry_ids:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xack(stream, group, *entry_ids)
            pipe.xdel(stream, *entry_ids)
            pipe.hdel(self.keys.failures, *entry_ids)
            await pipe.execute()

    async def _claim(
        self, stream: str, group: str, model: type[R], count: int, block_ms: int | None
    ) -> list[Delivery[R]]:
        # Reads go through the binary connection: a group's sidecar is raw bytes.
        reclaimed: list[tuple[bytes, dict[bytes, bytes] | None]] = []
        now = time.monotonic()
        if now - self._last_reclaim.get(stream, -1e9) >= self.claim_idle_ms / 4000:
            # Nothing can have been idle for claim_idle_ms since a scan a quarter of that ago.
            self._last_reclaim[stream] = now
            # XAUTOCLAIM replies [cursor, entries] on 6.2 and [cursor, entries, deleted] on 7: read [1].
            reply = await self.raw.xautoclaim(
                stream, group, self.consumer, min_idle_time=self.claim_idle_ms, start_id="0-0", count=count
            )
            reclaimed = list(reply[1])
        fresh: list[tuple[bytes, dict[bytes, bytes] | None]] = []
        if len(reclaimed) < count:
            new = await self.raw.xreadgroup(
                group, self.consumer, {stream: ">"}, count=count - len(reclaimed), block=block_ms
            )
            fresh = [entry for _, stream_entries in new or [] for entry in stream_entries]
        out = await self._decode_all(stream, group, model, reclaimed)
        out.extend(await self._decode_all(stream, group, model, fresh, first_delivery=True))
        return out

    async def _decode_all(
        self,
        stream: str,
        group: str,
        model: type[R],
        entries: list[tuple[bytes, dict[bytes, bytes] | None]],
        first_delivery: bool = False,
    ) -> list[Delivery[R]]:
        out: list[Delivery[R]] = []
        for raw_id, fields in entries:
            delivery = await self._decode(stream, group, model, raw_id.decode(), fields, first_delivery)
            if delivery is not None:
                out.append(delivery)
        return out

    async def _decode(
        self,
        stream: str,
        group: str,
        model: type[R],
        entry_id: str,
        fields: dict[bytes, bytes] | None,
        first_delivery: bool = False,
    ) -> Delivery[R] | None:
        if not fields:  # deleted while pending (Redis 6.2 returns it as nil)
            await self._ack(stream, group, [entry_id])
            return None
        data = fields.get(b"data", b"").decode("utf-8", errors="replace")
        blob = fields.get(b"blob")
        # A new entry (XREADGROUP ">") is on its first delivery; only reclaimed ones need XPENDING.
        deliveries = 1 if first_delivery else await self._deliveries(stream, group, entry_id)
        if deliveries > self.max_deliveries:
            last = await self.redis.hget(self.keys.failures, entry_id)
            reason = f"not acknowledged after {deliveries - 1} deliveries (max_deliveries={self.max_deliveries})"
            reason += f"; last error: {last}" if last else ""
            await self.dead_letter(stream, group, entry_id, data, reason, blob)
            return None
        try:
            record = load_with_sidecar(model, data, blob) if blob is not None else model.model_validate_json(data)
        except (ValidationError, ValueError) as exc:
            reason = f"malformed {model.__name__} record: {_first_error(exc)}"
            await self.dead_letter(stream, group, entry_id, data, reason, blob)
            return None
        return Delivery(entry_id=entry_id, record=record, deliveries=deliveries)

    async def _deliveries(self, stream: str, group: str, entry_id: str) -> int:
        pending = await self.redis.xpending_range(
            stream, group, min=entry_id, max=entry_id, count=1
        )
        return int(pending[0]["times_delivered"]) if pending else 1

    async def stream_lengths(self) -> dict[str, int]:
        async with self.redis.pipeline(transaction=False) as pipe:
            for key in (self.keys.tasks, self.keys.groups, self.keys.dead):
                pipe.xlen(key)
            tasks, groups, dead = await pipe.execute()
        return {"tasks": int(tasks), "groups": int(groups), "dead": int(dead)}

    # ----------------------------------------------------------------- policy pointer

    async def get_policy(self) -> PolicyPointer | None:
        """The pointer, None if unset; ValueError naming the key if it is malformed."""
        raw = await self.redis.hgetall(self.keys.policy)
        if not raw:
            return None
        try:
            return PolicyPointer(
                version=int(raw["version"]),
                path=raw["path"],
                updated_at=float(raw.get("updated_at", 0)),
            )
        except (KeyError, ValueError) as exc:
            raise MalformedKey(f"{self.keys.policy} is malformed ({exc!r} in {raw!r})") from exc

    async def set_policy(self, version: int, path: str) -> PolicyPointer:
        pointer = PolicyPointer(version=version, path=path)
        await self.redis.hset(
            self.keys.policy,
            mapping={"version": version, "path": path, "updated_at": pointer.updated_at},
        )
        return pointer

    # ----------------------------------------------------------------- engine registry

    async def register_engine(self, info: EngineInfo, ttl_s: int = 30) -> None:
        """Register or refresh (heartbeat) an engine; it expires ``ttl_s`` after the last call."""
        await self.redis.set(self.keys.engine(info.id), info.model_dump_json(), ex=ttl_s)

    async def unregister_engine(self, engine_id: str) -> None:
        await self.redis.delete(self.keys.engine(engine_id))

    async def list_engines(self) -> list[EngineInfo]:
        keys = [k async for k in self.redis.scan_iter(match=self.keys.engines_pattern, count=500)]
        if not keys:
            return []
        engines = []
        for raw in await self.redis.mget(keys):
            if raw is None:  # expired between SCAN and MGET
                continue
            try:
                engines.append(EngineInfo.model_validate_json(raw))
            except ValidationError as exc:
                log.warning("ignoring malformed engine registration: %s", _first_error(exc))
        return sorted(engines, key=lambda e: e.id)

    # ----------------------------------------------------------------- learner state

    async def get_state(self) -> dict[str, str]:
        return dict(await self.redis.hgetall(self.keys.learner_state))

    async def add_to_state(self, **deltas: int) -> None:
        """Add to learner state counters, all in one transaction (HINCRBY)."""
        async with self.redis.pipeline(transaction=True) as pipe:
            for name, delta in deltas.items():
                if delta:
                    pipe.hincrby(self.keys.learner_state, name, delta)
            await pipe.execute()

    async def state_once(self, name: str, value: str) -> str:
        """The learner state's ``name``: ``value`` if it had none (HSETNX), else the one kept."""
        await self.redis.hsetnx(self.keys.learner_state, name, value)
        return str(await self.redis.hget(self.keys.learner_state, name))

    async def set_state(self, **fields: Any) -> None:
        if fields:
            await self.redis.hset(
                self.keys.learner_state,
                mapping={k: v if isinstance(v, str) else json.dumps(v) for k, v in fields.items()},
            )


def _binary_twin(redis: aioredis.Redis) -> aioredis.Redis:
    """A client to the same server that returns bytes (for the binary sidecar)."""
    pool = redis.connection_pool
    kwargs = {**pool.connection_kwargs, "decode_responses": False}
    twin_pool = aioredis.ConnectionPool(connection_class=pool.connection_class, max_connections=pool.max_connections, **kwargs)
    return aioredis.Redis(connection_pool=twin_pool, auto_close_connection_pool=True)


def _first_error(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ())) or "record"
        return f"{where}: {err.get('msg')}"
    return str(exc)[:500]
