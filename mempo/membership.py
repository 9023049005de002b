"""A service's place in the engine registry: the heartbeat every receiver of weight
updates keeps (rollout workers for their engines, the scorer).

Every ``heartbeat_s`` the entry is written again with a TTL of about three beats, so a
dead replica leaves the registry by itself; after each beat ``after_beat`` runs (the
scorer catches up with the policy pointer there). Redis errors are retried (once at once,
for a connection Redis closed, then with capped backoff) and never stop the heartbeat;
``problem`` says why the entry is not registered (None once it is).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from redis.exceptions import RedisError

from mempo.queue import RedisQueue
from mempo.registry import EngineInfo
from mempo.retry import Backoff

log = logging.getLogger(__name__)


class Membership:
    def __init__(
        self,
        queue: RedisQueue,
        entry: Callable[[], EngineInfo],
        heartbeat_s: float,
        ttl_s: int,
        after_beat: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.queue, self.entry = queue, entry
        self.heartbeat_s, self.ttl_s = heartbeat_s, ttl_s
        self.after_beat = after_beat
        self.beats = 0
        self.problem: str | None = "not registered in Redis yet"

    async def register(self) -> None:
        """Write the entry now (also after a change it must show at once)."""
        await self.queue.register_engine(self.entry(), self.ttl_s)

    async def beat(self) -> None:
        await self.register()
        self.beats += 1
        self.problem = None
        if self.after_beat is not None:
            await self.after_beat()

    async def run(self, stop: asyncio.Event) -> None:
        """Beat until ``stop`` is set."""
        backoff = Backoff(base=0.5, cap=30.0)
        retried = False
        while not stop.is_set():
            try:
                await self.beat()
                retried = False
                backoff.reset()
                delay = self.heartbeat_s
            except (RedisError, OSError) as exc:
                if self.problem is None and not retried:
                    retried, delay = True, 0.0  # once at once: a connection Redis closed
                else:
                    delay = backoff.next_delay()
                    self.problem = f"cannot register in Redis: {type(exc).__name__}: {exc}"[:300]
                log.warning("registry heartbeat failed (%s); retrying in %.1fs", exc, delay)
            except Exception:  # never let the heartbeat die
                delay = backoff.next_delay()
                self.problem = "cannot register in Redis: unexpected error (see the log)"
                log.exception("registry heartbeat failed; retrying in %.1fs", delay)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=delay)

    async def leave(self, entry_id: str) -> None:
        """Remove the entry (on shutdown: the learner stops pushing to it at once)."""
        try:
            await self.queue.unregister_engine(entry_id)
        except (RedisError, OSError) as exc:
            log.warning("could not unregister %s: %s", entry_id, exc)
