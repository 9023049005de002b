"""The rollout worker: claim a task, run it, publish its Group, then ack.

Its part of the data flow: docs/architecture.md, 'One training step', step 2.

- At-least-once: the group is published before the task is acked, so a worker that dies
  in between leaves a task that another worker reclaims (the learner drops the duplicate
  group by group_id). A claimed task's lease is renewed while it runs, so a slow task is
  not reclaimed from a live worker.
- A task that fails (engine, retrieval or scorer down after their retries) is neither
  published nor acked: the reason is recorded and the task is redelivered, until the
  queue dead-letters it after ``max_deliveries``.
- Before taking work the engine is brought to ``mempo:policy`` if it is behind.
- Redis errors back off with a cap; nothing crash-loops. ``run(burst=True)`` drains the
  stream and returns (tests). Shutdown: stop claiming, drain in-flight tasks (bounded),
  then cancel them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import httpx
from redis.exceptions import RedisError

from mempo.agent_format import Tokenizer
from mempo.api.engine import UpdateWeightsResponse
from mempo.api.rollout import WorkerStatus
from mempo.clients.engine import EngineError
from mempo.membership import Membership
from mempo.queue import REDIS_ERRORS as QUEUE_REDIS_ERRORS
from mempo.queue import Delivery, RedisQueue, redis_problem
from mempo.registry import EngineInfo
from mempo.retry import Backoff, cancel_and_wait, retry_async
from mempo.schemas import Group, Task, parse_weight_version
from services.rollout.episode import EpisodeConfig, EpisodeRunner
from services.rollout.group import GroupRunner
from services.rollout.metrics import WorkerMetrics
from services.rollout.settings import WorkerSettings
from services.rollout.upstreams import Upstreams, context_length, load_tokenizer

log = logging.getLogger(__name__)
T = TypeVar("T")
REDIS_ERRORS = (*QUEUE_REDIS_ERRORS, OSError)


class NotBooted(Exception):
    """The worker has not reached its engine yet (no tokenizer, no context length)."""


class RolloutWorker:
    def __init__(
        self,
        settings: WorkerSettings,
        upstreams: Upstreams,
        queue: RedisQueue | None,
        metrics: WorkerMetrics | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        self.settings = settings
        self.upstreams = upstreams
        self.queue = queue
        self.metrics = metrics or WorkerMetrics()
        self.tokenizer = tokenizer
        self.episode_slots = asyncio.Semaphore(settings.max_concurrent_episodes)
        self.groups: GroupRunner | None = None
        self.max_context_tokens: int | None = None
        self.policy_version: int | None = None
        self.reason: str | None = "starting"
        self.consuming = False
        self.consume_reason: str | None = None  # why the consumer loop cannot claim, if it cannot
        self.started_at = time.time()
        self._stopping = asyncio.Event()
        self.membership: Membership | None = None  # in the registry once booted, with a queue
        self._policy_lock = asyncio.Lock()
        self._handlers: dict[str, asyncio.Task[bool]] = {}  # by task entry id
        self._background: list[asyncio.Task[None]] = []
        self.redis_reason: str | None = None  # why Redis cannot be used, as last checked
        self._redis_checked = -1.0

    # ----------------------------------------------------------------- start-up

    async def boot(self) -> None:
        """Learn the tokenizer and the context length from the engine; build the runners."""
        if self.groups is not None:
            return
        if self.tokenizer is None:
            self.tokenizer = await load_tokenizer(self.upstreams.engine, self.settings.tokenizer_path)
        if self.max_context_tokens is None:
            self.max_context_tokens = self.settings.max_context_tokens or await context_length(
                self.upstreams.engine
            )
        s = self.settings
        config = EpisodeConfig.of(s, self.max_context_tokens)
        episodes = EpisodeRunner(
            self.upstreams.engine, self.upstreams.retrieval, self.tokenizer, config, self.metrics
        )
        self.groups = GroupRunner(episodes, self.upstreams.scorer, self.episode_slots, s.worker_id)
        self.reason = None
        log.info(
            "worker %s ready: engine %s, context %d tokens",
            s.worker_id, s.engine_url, self.max_context_tokens,
        )

    async def _boot_until_ready(self) -> None:
        backoff = Backoff(base=0.5, cap=10.0)
        while not self._stopping.is_set():
            try:
                await self.boot()
                return
            except Exception as exc:  # the engine is not up yet: EngineError, httpx errors
                self.reason = f"waiting for the engine at {self.settings.engine_url}: {exc!r}"
                log.warning("%s", self.reason)
                await self._sleep(backoff.next_delay())

    def start(self) -> None:
        """Boot in the background, then heartbeat and (with a queue) consume."""
        self._background.append(asyncio.create_task(self._main(), name="rollout-main"))

    async def _main(self) -> None:
        await self._boot_until_ready()
        if self.queue is None or self._stopping.is_set():
            return
        membership = Membership(
            self.queue, self.registry_entry, self.settings.heartbeat_s, self.settings.registry_ttl_s
        )
        self.membership = membership
        # beats until stop() cancels it, after the drain: the entry outlives in-flight work
        beating = membership.run(asyncio.Event())
        self._background.append(asyncio.create_task(beating, name="rollout-heartbeat"))
        if self.settings.consume:
            await self.run()

    # ----------------------------------------------------------------- running tasks

    async def run_task(self, task: Task, score: bool = True) -> Group:
        """The task's n episodes on this worker's engine, as a Group (no Redis involved)."""
        if self.groups is None:
            raise NotBooted(self.reason or "starting")
        return await self.groups.run(task, score=score)

    async def run(self, burst: bool = False) -> int:
        """Consume tasks until stopped (or, ``burst``, until the stream is drained).

        Returns the number of tasks claimed (each one published or failed)."""
        assert self.queue is not None
        slots = asyncio.Semaphore(self.settings.max_concurrent_tasks)
        backoff = Backoff(base=0.2, cap=10.0)
        handled, groups_exist, rescanned = 0, False, False
        self.consuming = True
        try:
            while not self._stopping.is_set():
                await slots.acquire()
                try:
                    if not groups_exist:
                        await self.queue.ensure_groups()
                        groups_exist = True
                    await self.sync_policy()
                    delivery = await self.queue.claim_task(
                        block_ms=None if burst else self.settings.claim_block_ms
                    )
                except Exception as exc:  # Redis down, a stream deleted or a key malformed under us
                    slots.release()
                    groups_exist = False
                    self._cannot_consume(exc)
                    await self._sleep(backoff.next_delay())
                    continue
                backoff.reset()
                self.consume_reason = None
                if delivery is None:
                    slots.release()
                    if not burst:
                        continue
                    if self._handlers:
                        await asyncio.wait(set(self._handlers.values()), return_when=asyncio.FIRST_COMPLETED)
                        continue
                    if rescanned:
                        break  # drained: nothing new, nothing idle to reclaim
                    # The queue scans for idle tasks at most every claim_idle_ms / 4: let it.
                    rescanned = True
                    await asyncio.sleep(self.queue.claim_idle_ms / 4000)
                    continue
                rescanned = False
                if delivery.entry_id in self._handlers:
                    # Our own lease lapsed (a stalled event loop) and the idle scan handed the
                    # task back to us while it still runs: the running copy will ack it.
                    slots.release()
                    log.warning("task %s reclaimed while still running here; not run twice", delivery.entry_id)
                    continue
                handled += 1
                self._spawn(delivery, slots)
            await self._drain()
        finally:
            self.consuming = False
            await cancel_and_wait(list(self._handlers.values()))
        return handled

    def _cannot_consume(self, exc: Exception) -> None:
        """Record why the loop cannot claim (``/ready`` says it) and log it once per reason."""
        reason = f"cannot claim tasks: {type(exc).__name__}: {exc}"
        if reason != self.consume_reason:
            log.warning("%s; backing off and retrying", reason, exc_info=not isinstance(exc, RedisError))
        self.consume_reason = reason
        self.metrics.consume_failed(type(exc).__name__)

    def _spawn(self, delivery: Delivery[Task], slots: asyncio.Semaphore) -> None:
        entry_id = delivery.entry_id
        handler = asyncio.create_task(self.handle(delivery), name=f"task-{entry_id}")
        self._handlers[entry_id] = handler

        def done(t: asyncio.Task[bool]) -> None:
            self._handlers.pop(entry_id, None)
            slots.release()

        handler.add_done_callback(done)

    async def handle(self, delivery: Delivery[Task]) -> bool:
        """Run one claimed task; publish then ack, or record why it failed (no ack)."""
        assert self.queue is not None
        queue, task, entry_id = self.queue, delivery.record, delivery.entry_id
        started = time.perf_counter()
        self.metrics.task_started()
        released = asyncio.Event()
        lease = asyncio.create_task(self._keep_lease(entry_id, released))
        ok = False
        try:
            group = await self.run_task(task)
            await self._redis(lambda: queue.publish_group(group), "publish a group")
            await self._redis(lambda: queue.ack_task(entry_id), "ack a task")
            ok = True
        except Exception as exc:  # upstream failures; a bug is recorded the same way
            reason = f"{type(exc).__name__}: {exc}"
            log.warning("task %s (delivery %d) failed: %s", task.task_id, delivery.deliveries, reason)
            log.debug("task failure", exc_info=True)
            with contextlib.suppress(*REDIS_ERRORS):
                await self._redis(lambda: queue.record_failure(entry_id, reason), "record a failure")
        finally:
            released.set()  # the lease ends between two renewals
            await asyncio.wait([lease], timeout=2.0)
            await cancel_and_wait([lease])
            self.metrics.task_finished(ok, time.perf_counter() - started)
        if ok:
            try:
                await self.sync_policy()
            except Exception as exc:  # the next claim retries it (and reports it)
                log.warning("after task %s: %s: %s", task.task_id, type(exc).__name__, exc)
        return ok

    async def _keep_lease(self, entry_id: str, done: asyncio.Event) -> None:
        """Renew the task's lease every claim_idle_ms / 3 until ``done`` is set."""
        assert self.queue is not None
        interval = max(self.queue.claim_idle_ms / 3000.0, 0.01)
        while not done.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(done.wait(), interval)
                return
            try:
                if not await self.queue.renew_task(entry_id):
                    log.warning("task %s was reclaimed by another worker", entry_id)
                    return
            except RedisError as exc:
                log.warning("renewing the lease of %s failed: %s", entry_id, exc)

    # ----------------------------------------------------------------- policy and registry

    async def sync_policy(self) -> None:
        """Load ``mempo:policy`` into the engine if the engine's weights are older. The
        engine is asked each time (one GET before each task): one that restarted since
        (back on its base weights) is caught up before it takes work."""
        if self.queue is None or self.groups is None:
            return
        async with self._policy_lock:
            policy = await self.queue.get_policy()
            if policy is None:
                return
            self.policy_version = policy.version
            episodes = self.groups.episodes
            try:
                info = await self.upstreams.engine.model_info()
                episodes.engine_version = info.weight_version
                current = parse_weight_version(info.weight_version)
                if current is None or current >= policy.version:  # None: weights loaded by hand
                    return
                log.info("engine at weights %s, policy at %d: updating", info.weight_version, policy.version)
                reply = await self.upstreams.engine.update_weights_from_disk(policy.path, str(policy.version))
            except (EngineError, httpx.HTTPError, OSError) as exc:
                log.warning("could not bring the engine to policy %d: %s", policy.version, exc)
                return
            if reply.success:
                episodes.engine_version = str(policy.version)
            else:
                log.warning("the engine refused policy %d: %s", policy.version, reply.message)

    async def update_engine(
        self, update: Awaitable[UpdateWeightsResponse], weight_version: str | None
    ) -> UpdateWeightsResponse:
        """The learner's weight push (from disk, or one bucket of a broadcast), forwarded to
        this replica's engine with its admin key: a version it carries is known at once
        for the groups in flight."""
        async with self._policy_lock:
            in_flight = self.metrics.in_flight_episodes
            reply = await update
            if reply.success and weight_version is not None and self.groups is not None:
                self.groups.episodes.engine_version = weight_version
        if weight_version is not None:
            log.info(
                "engine update to weights %s: %s (%d episodes in flight)",
                weight_version, "done" if reply.success else reply.message, in_flight,
            )  # fmt: skip
        return reply

    def registry_entry(self) -> EngineInfo:
        """The learner updates this replica through the worker: the entry's URL is ours,
        signed with our admin token (the learner's token for the role)."""
        s = self.settings
        version = self.groups.episodes.engine_version if self.groups else "0"
        return EngineInfo(
            id=s.worker_id,
            role="rollout",
            url=s.own_url(),
            weight_version=version,
            started_at=self.started_at,
            worker_url=s.own_url(),
        ).signed(s.admin_token_value())

    # ----------------------------------------------------------------- shutdown and status

    async def stop(self) -> None:
        """Stop claiming, let in-flight tasks finish (bounded), then cancel the rest."""
        self._stopping.set()
        main = [t for t in self._background if t.get_name() == "rollout-main"]
        if main:
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(main[0]), self.settings.drain_timeout_s + 5)
        await cancel_and_wait(self._background)
        if self.membership is not None:
            await self.membership.leave(self.settings.worker_id)

    async def _drain(self) -> None:
        if self._handlers:
            log.info("draining %d in-flight tasks", len(self._handlers))
            await asyncio.wait(set(self._handlers.values()), timeout=self.settings.drain_timeout_s)

    def readiness(self) -> tuple[bool, str | None]:
        if self._stopping.is_set():
            return False, "shutting down"
        if self.groups is None:
            return False, self.reason
        reason = self.redis_reason or self.consume_reason
        return reason is None, reason

    async def check_redis(self) -> None:
        """Refresh ``redis_reason`` (a PING, at most once a second): a worker that cannot
        reach Redis, or is refused by it, is not ready."""
        if self.queue is None or time.monotonic() - self._redis_checked < 1.0:
            return
        self._redis_checked = time.monotonic()
        self.redis_reason = await redis_problem(self.queue.redis)

    def status(self) -> WorkerStatus:
        ready, reason = self.readiness()
        m = self.metrics
        return WorkerStatus(
            worker_id=self.settings.worker_id,
            ready=ready,
            reason=reason,
            consuming=self.consuming,
            engine_url=self.settings.engine_url,
            engine_weight_version=self.groups.episodes.engine_version if self.groups else None,
            policy_version=self.policy_version,
            max_context_tokens=self.max_context_tokens,
            in_flight_tasks=m.in_flight_tasks,
            in_flight_episodes=m.in_flight_episodes,
            tasks_done=m.tasks_done,
            tasks_failed=m.tasks_failed,
            episodes=m.episodes,
            rounds=m.rounds,
            tokens=m.tokens,
        )

    async def _sleep(self, seconds: float) -> None:
        """Sleep, waking early when the worker stops."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)

    async def _redis(self, fn: Callable[[], Awaitable[T]], what: str) -> T:
        return await retry_async(
            fn, attempts=30, backoff=Backoff(base=0.2, cap=10.0), retry_on=REDIS_ERRORS, what=what
        )
