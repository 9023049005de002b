"""The learner service: the training loop as the app's background task, and its HTTP
routes (/health, /ready, /metrics, GET /v1/status).

The trainer loads inside the task, so ``/health`` answers at once and ``/ready`` turns
200 once the trainer is loaded and Redis answers. Redis connection errors are retried
with capped backoff (the step resumes from its pending groups), and so are Redis's
refusals and malformed keys (reported in ``/v1/status``, ``/ready`` and
``mempo_learner_redis_errors_total`` until the key is fixed); any other error stops
the loop, shows in ``/v1/status`` and ``/ready``, and with ``exit_on_error`` ends the
process so a supervisor restarts it from the latest checkpoint. Shutdown stops intake,
lets the running step finish (up to ``drain_timeout_s``), then cancels.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Request
from redis.exceptions import RedisError

from mempo.api.learner import LearnerStatus, LoopState
from mempo.queue import REDIS_ERRORS, MalformedKey, RedisQueue, connect
from mempo.retry import Backoff, cancel_and_wait
from mempo.service import NotReady, install_common
from services.learner.loop import LearnerLoop, learner_status
from services.learner.settings import LearnerSettings
from services.learner.telemetry import LearnerMetrics

log = logging.getLogger(__name__)


class Training:
    """The loop in the background: opened (the trainer loaded) inside the task, kept
    going across Redis outages, stopped with a drain."""

    def __init__(
        self, settings: LearnerSettings, queue: RedisQueue, metrics: LearnerMetrics
    ) -> None:
        self.settings, self.queue, self.metrics = settings, queue, metrics
        self.loop: LearnerLoop | None = None
        self.state: LoopState = "starting"
        self.error: str | None = None
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self._main(), name="learner-loop")

    async def _main(self) -> None:
        try:
            await self._train()
        except asyncio.CancelledError:
            self.state = "stopped"
            raise
        except Exception as exc:
            log.exception("the learner loop failed")
            self.state, self.error = "failed", f"{type(exc).__name__}: {exc}"[:2000]
            if self.settings.exit_on_error:  # uvicorn shuts down; the supervisor restarts us
                signal.raise_signal(signal.SIGTERM)

    async def _train(self) -> None:
        backoff = Backoff(base=0.5, cap=30.0)
        while not self._stop.is_set():
            try:
                if self.loop is None:
                    self.loop = await LearnerLoop.open(self.settings, self.queue, self.metrics)
                else:
                    self.loop.consumer.restart()
                    await self.loop.catch_up()
                backoff.reset()
                self.state, self.error = "training", None
                await self.loop.run(self._stop)
                break
            except (RedisError, MalformedKey) as exc:  # down, refusing, or a key of the wrong type
                delay = backoff.next_delay()
                self.error = f"{type(exc).__name__}: {exc}"[:2000]
                self.metrics.redis_errors.labels(type(exc).__name__).inc()
                log.warning("Redis: %s; retrying in %.1fs", self.error, delay)
                with contextlib.suppress(TimeoutError):  # a shutdown ends the wait
                    await asyncio.wait_for(self._stop.wait(), delay)
        self.state = "finished" if self.loop is not None and self.loop.finished else "stopped"

    async def stop(self) -> None:
        drain_timeout_s = self.settings.drain_timeout_s
        self._stop.set()
        if not self._task.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._task), drain_timeout_s)
            except TimeoutError:
                log.warning("the running step did not finish within %.0fs; cancelling", drain_timeout_s)
                await cancel_and_wait([self._task])
        if self.loop is not None:
            await self.loop.aclose()

    async def ready(self) -> tuple[bool, str | None]:
        if self.state == "failed":
            return False, f"the learner loop failed: {self.error}"
        if self.loop is None:
            return False, "loading the trainer"
        try:
            await self.queue.redis.ping()
        except REDIS_ERRORS as exc:
            return False, f"Redis unreachable: {type(exc).__name__}"
        if self.error is not None:  # the loop is retrying after a Redis error
            return False, f"the learner loop is retrying: {self.error}"
        return True, None


def get_training(request: Request) -> Training:
    running: Training | None = getattr(request.app.state, "training", None)
    if running is None:
        raise NotReady("the learner is starting")
    return running


TrainingDep = Annotated[Training, Depends(get_training)]
router = APIRouter()  # declarative routes; the training loop comes from app.state


@router.get("/v1/status", response_model=LearnerStatus, tags=["learner"])
async def status(running: TrainingDep) -> LearnerStatus:
    """Step, version, tasks admitted, groups consumed and dropped, the last metrics."""
    try:
        try:
            return await _status(running)
        except REDIS_ERRORS as exc:  # right after Redis restarts a pooled connection can fail once
            log.info("GET /v1/status: %s from Redis; trying once more", type(exc).__name__)
        await asyncio.sleep(0.2)
        return await _status(running)
    except REDIS_ERRORS as exc:
        raise NotReady(f"Redis unreachable: {type(exc).__name__}") from exc
    except (RedisError, MalformedKey) as exc:  # a key of the wrong type or content
        raise NotReady(f"cannot read the learner state: {type(exc).__name__}: {exc}"[:500]) from exc


async def _status(running: Training) -> LearnerStatus:
    return await learner_status(
        running.queue, running.settings, running.loop, running.state, running.error
    )


def create_app(settings: LearnerSettings | None = None) -> FastAPI:
    settings = settings or LearnerSettings()
    metrics = LearnerMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        redis = connect(settings.redis_url, settings.redis_password_value())
        queue = RedisQueue(
            redis,
            settings.keys(),
            consumer=settings.consumer_name,
            claim_idle_ms=settings.claim_idle_ms,
            max_deliveries=settings.max_deliveries,
        )
        app.state.training = Training(settings, queue, metrics)
        try:
            yield
        finally:
            await app.state.training.stop()
            await queue.aclose()
            await redis.aclose()

    app = FastAPI(title="MemPO learner", version="1", lifespan=lifespan)

    async def ready() -> tuple[bool, str | None]:
        running: Training | None = getattr(app.state, "training", None)
        return (False, "starting") if running is None else await running.ready()

    install_common(app, "learner", metrics, ready, settings)
    app.include_router(router)
    return app
