"""The learner loop as a background task of the HTTP service: start, status, shutdown.

The trainer loads inside the task, so ``/health`` answers at once and ``/ready`` turns
200 once the trainer is loaded and Redis answers. Redis connection errors are retried
with capped backoff (the step resumes from its pending groups); any other error stops
the loop, shows in ``/v1/status`` and ``/ready``, and with ``exit_on_error`` ends the
process so a supervisor restarts it from the latest checkpoint. Shutdown stops intake,
lets the running step finish (up to ``drain_s``), then cancels.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from mempo.api.learner import DroppedCounts, LearnerStatus, LoopState, PublishStatus
from mempo.queue import RedisQueue, connect
from mempo.retry import Backoff
from mempo.service import NotReady
from services.learner.loop import LearnerLoop
from services.learner.settings import LearnerSettings
from services.learner.state import LearnerState
from services.learner.telemetry import LearnerMetrics

log = logging.getLogger(__name__)

_REDIS_ERRORS = (RedisConnectionError, RedisTimeoutError)


class LearnerRunner:
    def __init__(self, settings: LearnerSettings, metrics: LearnerMetrics) -> None:
        self.settings, self.metrics = settings, metrics
        self.redis = connect(settings.redis_url, settings.redis_password_value())
        self.queue = RedisQueue(
            self.redis,
            settings.keys(),
            consumer=settings.consumer_name,
            claim_idle_ms=settings.claim_idle_ms,
            max_deliveries=settings.max_deliveries,
        )
        self.loop: LearnerLoop | None = None
        self.state: LoopState = "starting"
        self.error: str | None = None
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
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
                self.state = "training"
                await self.loop.run(self._stop)
                break
            except _REDIS_ERRORS as exc:
                delay = backoff.next_delay()
                log.warning("Redis unavailable (%s); retrying in %.1fs", exc, delay)
                with contextlib.suppress(TimeoutError):  # a shutdown ends the wait
                    await asyncio.wait_for(self._stop.wait(), delay)
        self.state = "finished" if self.loop is not None and self.loop.finished else "stopped"

    async def stop(self) -> None:
        drain_s = self.settings.drain_s
        self._stop.set()
        if self._task is not None and not self._task.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._task), drain_s)
            except TimeoutError:
                log.warning("the running step did not finish within %.0fs; cancelling", drain_s)
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)
        if self.loop is not None:
            await self.loop.aclose()
        await self.queue.aclose()
        await self.redis.aclose()

    async def ready(self) -> tuple[bool, str | None]:
        if self.state == "failed":
            return False, f"the learner loop failed: {self.error}"
        if self.loop is None:
            return False, "loading the trainer"
        try:
            await self.redis.ping()
        except _REDIS_ERRORS as exc:
            return False, f"Redis unreachable: {type(exc).__name__}"
        return True, None

    async def status(self) -> LearnerStatus:
        loop = self.loop
        try:
            counts = await LearnerState(self.queue).counts()
            raw = await self.queue.get_state()
            in_flight = await loop.admission.in_flight(counts) if loop else counts.in_flight
        except _REDIS_ERRORS as exc:
            raise NotReady(f"Redis unreachable: {type(exc).__name__}") from exc
        report = loop.last_publish if loop else None
        last = loop.last_metrics if loop else None
        return LearnerStatus(
            state=self.state,
            step=loop.trainer.step if loop else int(raw.get("step", 0)),
            version=loop.trainer.version if loop else int(raw.get("version", 0)),
            admitted=counts.admitted,
            consumed=counts.consumed,
            dropped=DroppedCounts(
                duplicate=counts.dropped_duplicate, stale=counts.dropped_stale, foreign=counts.foreign
            ),
            in_flight=max(0, in_flight),
            capacity=self.settings.capacity,
            last_publish=None
            if report is None
            else PublishStatus(
                version=report.version,
                path=report.path,
                updated=report.updated,
                stale=report.stale,
                seconds=report.total_s,
                paths=report.paths,
            ),
            last_metrics=None
            if last is None
            else {k: v for k, v in last.items() if isinstance(v, (int, float)) or v is None},
            error=self.error,
        )


def follow(settings: LearnerSettings) -> None:
    """A torchrun rank > 0: build the same trainer, then run rank 0's commands until it closes."""
    from mempo.settings import configure_logging
    from services.learner.trainer import Trainer

    configure_logging(settings.log_level)
    trainer, _ = Trainer.resume(
        settings.trainer,
        settings.resolved_model_path(),
        settings.checkpoints,
        settings.resolved_device(),
    )
    trainer.follow()
    trainer.close()
