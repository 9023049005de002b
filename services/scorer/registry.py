"""The scorer in the engine registry: heartbeat, and catching up with the policy pointer.

Every ``heartbeat_s`` the scorer registers itself (role "scorer", TTL three beats;
mempo/membership.py) so the learner publishes weights to it like to an engine
(``problem`` says why it is not registered: the scorer's /ready is 503 until it is), and
after each beat reads ``mempo:policy``: when the pointer is newer than its weights (a
late start, a failed push) it loads that path itself. Redis errors never stop the scorer.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time

from mempo.membership import Membership
from mempo.queue import RedisQueue, connect
from mempo.registry import EngineInfo, PolicyPointer
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
    """The scorer's membership of the registry, and its policy catch-up after each beat."""

    def __init__(self, service: ScorerService, settings: ScorerSettings) -> None:
        assert settings.redis_url, "registration needs a redis_url"
        self.service = service
        self.settings = settings
        self.id = engine_id(settings)
        self.url = public_url(settings)
        self.started_at = time.time()
        self.queue = RedisQueue(
            connect(settings.redis_url, settings.redis_password_value()), settings.keys()
        )
        ttl_s = max(1, round(3 * settings.heartbeat_s))
        self.membership = Membership(
            self.queue, self._info, settings.heartbeat_s, ttl_s, after_beat=self.catch_up
        )
        self._failed_version: int | None = None  # a pointer that failed to load, not retried

    @property
    def problem(self) -> str | None:
        """Why the scorer is not registered (its /ready is 503 until it is); None once it is."""
        return self.membership.problem

    @property
    def beats(self) -> int:
        return self.membership.beats

    async def beat(self) -> None:
        """One heartbeat: register, then catch up with the policy pointer if it is newer."""
        await self.membership.beat()

    async def run(self, stop: asyncio.Event) -> None:
        await self.membership.run(stop)

    async def catch_up(self) -> None:
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
        await self.membership.register()

    def _info(self) -> EngineInfo:
        return EngineInfo(
            id=self.id,
            role="scorer",
            url=self.url,
            weight_version=self.service.current.version,
            started_at=self.started_at,
        ).signed(self.settings.admin_token_value())

    async def close(self) -> None:
        await self.membership.leave(self.id)
        await self.queue.redis.aclose()
