"""The scorer in the engine registry: heartbeat, and catching up with the policy pointer.

Every ``heartbeat_s`` the scorer registers itself (role "scorer", TTL three beats) so
the learner publishes weights to it like to an engine (``problem`` says why it is not
registered: the scorer's /ready is 503 until it is), and reads ``mempo:policy``:
when the pointer is newer than its weights (a late start, a failed push) it loads that
path itself. Redis errors are logged and retried with capped backoff; they never stop
the scorer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time

from redis.exceptions import RedisError

from mempo.keys import Keys
from mempo.queue import EngineInfo, PolicyPointer, RedisQueue, connect
from mempo.retry import Backoff
from mempo.schemas import parse_weight_version
from mempo.service import inside_root
from services.scorer.scorer import ScorerService
from services.scorer.settings import ScorerSettings

log = logging.getLogger(__name__)


def engine_id(settings: ScorerSettings) -> str:
    return settings.engine_id or f"scorer-{socket.gethostname()}-{settings.port}"


def public_url(settings: ScorerSettings) -> str:
    return (settings.public_url or f"http://{settings.host}:{settings.port}").rstrip("/")


def is_newer(pointer: PolicyPointer, version: str) -> bool:
    """The pointer is newer than weights of ``version`` (weights that are no policy
    version, loaded by hand, never are: mempo.schemas.parse_weight_version)."""
    current = parse_weight_version(version)
    return current is not None and pointer.version > current


class Registration:
    """The heartbeat task of one scorer process."""

    def __init__(self, service: ScorerService, settings: ScorerSettings) -> None:
        assert settings.redis_url, "registration needs a redis_url"
        self.service = service
        self.settings = settings
        self.id = engine_id(settings)
        self.url = public_url(settings)
        self.started_at = time.time()
        password = settings.redis_password.get_secret_value() if settings.redis_password else None
        self.queue = RedisQueue(connect(settings.redis_url, password), Keys(settings.key_prefix))
        self.ttl_s = max(1, round(3 * settings.heartbeat_s))
        self.beats = 0
        self.problem: str | None = "not registered in Redis yet"  # None: registered
        self._failed_version: int | None = None  # a pointer that failed to load, not retried

    async def beat(self) -> None:
        """One heartbeat: register, then catch up with the policy pointer if it is newer."""
        await self.queue.register_engine(self._info(), self.ttl_s)
        self.beats += 1
        self.problem = None
        pointer = await self.queue.get_policy()
        if pointer is None or not is_newer(pointer, self.service.current.version):
            return
        if pointer.version == self._failed_version:
            return
        log.info("policy pointer is at version %d: loading %s", pointer.version, pointer.path)
        try:
            path = inside_root(pointer.path, self.settings.weights_root)
            await self.service.update_weights(path, str(pointer.version))
        except Exception as exc:  # a bad checkpoint must not stop the heartbeat
            self._failed_version = pointer.version
            log.warning(
                "cannot load policy version %d from %s: %s", pointer.version, pointer.path, exc
            )
            return
        await self.queue.register_engine(self._info(), self.ttl_s)

    def _info(self) -> EngineInfo:
        return EngineInfo(
            id=self.id,
            role="scorer",
            url=self.url,
            weight_version=self.service.current.version,
            started_at=self.started_at,
        )

    async def run(self, stop: asyncio.Event) -> None:
        backoff = Backoff(base=0.5, cap=30.0)
        retried = False
        while not stop.is_set():
            try:
                await self.beat()
                retried = False
                backoff.reset()
                delay = self.settings.heartbeat_s
            except (RedisError, OSError) as exc:
                if self.problem is None and not retried:
                    retried, delay = True, 0.0  # once at once: a connection Redis closed
                else:
                    delay = backoff.next_delay()
                    self.problem = f"cannot register in Redis: {type(exc).__name__}: {exc}"[:300]
                log.warning("registry heartbeat failed (%s); retrying in %.1fs", exc, delay)
            except Exception as exc:  # never let the heartbeat die
                delay = backoff.next_delay()
                self.problem = f"cannot register in Redis: {type(exc).__name__}"
                log.exception("registry heartbeat failed; retrying in %.1fs", delay)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=delay)

    async def close(self) -> None:
        try:
            await self.queue.unregister_engine(self.id)
        except (RedisError, OSError) as exc:
            log.warning("could not unregister %s: %s", self.id, exc)
        await self.queue.redis.aclose()
