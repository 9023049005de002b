"""The learner's main loop: one training step reads top to bottom.

The data flow: docs/architecture.md, 'One training step'.

    groups -> advantages -> old / reference log-probs -> PPO epochs -> checkpoint
           -> publish weights -> ack the groups -> metrics -> admit more tasks

Exactly-once training of a group: its ack comes only after the checkpoint that holds
the step is durable, and that checkpoint records the ids of the groups it trained on.
A crash before the ack redelivers the groups to the restarted learner, which resumes
from the checkpoint and drops them as duplicates; a crash before the checkpoint trains
them again from the previous checkpoint, as if the step never happened.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from mempo.api.learner import DroppedCounts, LearnerStatus, LoopState, PublishStatus
from mempo.queue import MalformedKey, RedisQueue
from mempo.weights import NonFiniteWeights
from services.learner.admission import Admission, TaskSpec, open_source
from services.learner.checkpoint import (
    TrainerExporter,
    restore_trainer,
    resume_trainer,
    save_trainer,
)
from services.learner.consumer import Batch, GroupConsumer, TrainedIds
from services.learner.publish import PublishReport, WeightPublisher
from services.learner.settings import LearnerSettings
from services.learner.state import LearnerState
from services.learner.step import train_step
from services.learner.telemetry import LearnerMetrics, StepLog
from services.learner.trainer import Trainer

log = logging.getLogger(__name__)

class LearnerLoop:
    """Consumes groups, trains, checkpoints, publishes; ``open`` builds it from settings."""

    def __init__(
        self,
        settings: LearnerSettings,
        queue: RedisQueue,
        trainer: Trainer,
        consumer: GroupConsumer,
        admission: Admission,
        publisher: WeightPublisher,
        metrics: LearnerMetrics | None = None,
    ) -> None:
        self.settings, self.queue, self.trainer = settings, queue, trainer
        self.consumer, self.admission, self.publisher = consumer, admission, publisher
        self.state = consumer.state
        self.metrics = metrics or LearnerMetrics()
        self.step_log = StepLog(settings)
        self.last_metrics: dict[str, Any] | None = self.step_log.journal.last()
        self.last_publish: PublishReport | None = None
        self.failed_batches = 0  # in a row (each dead-lettered; training goes on)

    @classmethod
    async def open(
        cls, settings: LearnerSettings, queue: RedisQueue, metrics: LearnerMetrics | None = None
    ) -> LearnerLoop:
        """Resume the trainer from the latest checkpoint and re-publish it if engines lag."""
        from services.learner.batch import validate_group

        await queue.ensure_groups()
        trainer, resumed = await asyncio.to_thread(
            resume_trainer,
            settings.trainer,
            settings.resolved_model_path(),
            settings.checkpoints,
            settings.resolved_device(),
        )
        trained = TrainedIds(
            resumed.trained_group_ids if resumed else (), settings.keep_trained_ids
        )
        max_tokens = settings.max_sequence_tokens or trainer.max_positions
        state = LearnerState(queue)
        run_id = await state.run_id()
        metrics = metrics or LearnerMetrics()
        consumer = GroupConsumer(
            queue,
            state,
            settings.batch_groups,
            settings.max_staleness,
            trained,
            on_drop=lambda reason: metrics.groups_dropped.labels(reason).inc(),
            validate=lambda group: validate_group(group, trainer.vocab_size, max_tokens),
            run_id=run_id,
        )
        source = await asyncio.to_thread(
            open_source,
            settings.dataset,
            settings.questions_per_task,
            settings.world_seed,
            settings.task_seed,
        )
        scored = settings.trainer.mem_baseline != "full"  # P_task asked of the scorer
        spec = TaskSpec(settings.group_size, settings.mode, settings.max_rounds, score_task=scored)
        admission = Admission(queue, state, source, spec, settings.capacity, run_id)
        publisher = _publisher(settings, queue, trainer)
        loop = cls(settings, queue, trainer, consumer, admission, publisher, metrics)
        if resumed:
            log.info("resumed at step %d, version %d", resumed.step, resumed.version)
        await loop.catch_up()
        return loop

    async def aclose(self) -> None:
        """Close HTTP clients and trackers; under torchrun, release the ranks parked in
        ``follow()``."""
        await self.publisher.aclose()
        await asyncio.to_thread(self.step_log.close)
        close = getattr(self.trainer, "close", None)
        if close is None:
            return
        try:
            await asyncio.to_thread(close)
        except RuntimeError as exc:  # on SIGTERM torchrun stops every rank: they may be gone
            log.warning("could not release the other ranks: %s", exc)

    @property
    def finished(self) -> bool:
        total = self.settings.total_steps
        return total > 0 and self.trainer.step >= total

    # ----------------------------------------------------------------- the step

    async def training_step(self, block_ms: int | None = None) -> dict[str, Any] | None:
        """One MemPO step; None when no full batch arrived within ``block_ms``. A batch whose
        training failed is dead-lettered and the next one trained (see ``_train``)."""
        while True:
            batch = await self.consumer.next_batch(self.trainer.version, block_ms)
            if batch is None:
                return None
            started = time.perf_counter()
            staleness = batch.staleness(self.trainer.version)
            # advantages (outcome + memory) -> old / ref log-probs -> PPO epochs -> AdamW step
            train = await self._train(batch)
            if train is not None:
                break
        try:
            await asyncio.to_thread(
                save_trainer,
                self.trainer,
                self.settings.checkpoints,
                self.consumer.trained.with_(batch.group_ids),
            )
        except NonFiniteWeights as exc:  # never checkpointed nor published: stop loudly
            await self.consumer.release(batch, f"checkpoint refused: {exc}")
            raise
        self.consumer.trained_on(batch)
        report = await self.publish()
        await self.consumer.ack(batch)  # only now: the checkpoint holding this step is durable
        step_s = time.perf_counter() - started
        record = self._record(batch, {**staleness, **train}, report, step_s)
        await self.admit()
        return record

    async def _train(self, batch: Batch) -> dict[str, float] | None:
        """The step's metrics; None when training raised: the trainer is put back to the
        state before the step (its latest checkpoint: weights, AdamW, schedule, counters)
        and the batch dead-lettered, however many batches fail in a row."""
        try:
            train = await asyncio.to_thread(train_step, self.trainer, batch.groups)
        except Exception as exc:
            reason = f"train_step: {type(exc).__name__}: {exc}"
            self.failed_batches += 1
            self.metrics.failed_batches.inc()
            log.error(
                "dead-lettering a batch of %d groups (%d failed in a row): %s",
                len(batch.deliveries), self.failed_batches, reason,
            )  # fmt: skip
            await asyncio.to_thread(restore_trainer, self.trainer, self.settings.checkpoints)
            await self.consumer.dead_letter(batch, reason)
            return None
        self.failed_batches = 0
        return train

    async def publish(self) -> PublishReport:
        report = await self.publisher.publish(TrainerExporter(self.trainer), self.trainer.version)
        self.last_publish = report
        self.metrics.publish_seconds.observe(report.total_s)
        self.metrics.publish_failures.inc(len(report.stale))
        self.metrics.version.set(report.version)
        await self.queue.set_state(version=report.version, stale_engines=sorted(report.stale))
        return report

    def _record(
        self, batch: Batch, figures: dict[str, float], report: PublishReport, step_s: float
    ) -> dict[str, Any]:
        figures = {
            **figures,
            "publish_s": report.total_s,
            "engines_updated": float(len(report.updated)),
            "engines_stale": float(len(report.stale)),
            "step_s": step_s,
        }
        record = self.step_log.write(self.trainer.step, self.trainer.version, figures, batch.groups)
        self.last_metrics = record
        self.metrics.steps.inc()
        self.metrics.skipped_steps.inc(figures.get("skipped_steps", 0.0))
        self.metrics.step_seconds.observe(step_s)
        self.metrics.groups_consumed.inc(len(batch.deliveries))
        self.metrics.staleness.set(figures["staleness_mean"])
        log.info(
            "step %d (v%d): reward %.3f, %d groups, %.2fs",
            self.trainer.step,
            self.trainer.version,
            figures.get("reward_mean", float("nan")),
            len(batch.deliveries),
            step_s,
        )
        return record

    # ----------------------------------------------------------------- around the step

    async def admit(self) -> None:
        admitted = await self.admission.admit()
        self.metrics.tasks_admitted.inc(admitted)
        self.metrics.in_flight.set(await self.admission.in_flight())
        await self.queue.set_state(step=self.trainer.step, version=self.trainer.version)

    async def catch_up(self) -> None:
        """On start: drop half-written versions; publish the resumed version if the
        policy pointer does not hold it yet (a crash between checkpoint and publish)."""
        await asyncio.to_thread(self.publisher.remove_temp)
        self.metrics.version.set(self.trainer.version)
        if self.trainer.version == 0:
            return  # the engines started from the initial weights
        policy = await self.queue.get_policy()
        if (
            policy is None
            or policy.version != self.trainer.version
            or not Path(policy.path).is_dir()
        ):
            log.info("publishing resumed version %d (pointer: %s)", self.trainer.version, policy)
            await self.publish()

    async def run(self, stop: asyncio.Event | None = None, burst: bool = False) -> None:
        """Train until ``total_steps``, ``stop``, or (burst) until no full batch is left."""
        stop = stop or asyncio.Event()
        await self.admit()
        while not self.finished and not stop.is_set():
            record = await self.training_step(None if burst else self.settings.poll_ms)
            if record is None:
                if burst:
                    return
                await self.admit()  # idle: refill places freed by dead-lettered tasks


def _sharded(trainer: Any) -> bool:
    """A sharded (FSDP) trainer publishes through disk only: its full state is gathered by
    ``export_trainer``'s collective (a broadcast of it is not implemented)."""
    if trainer.dist.sharded:
        log.warning("weight_sync = broadcast: not with a sharded trainer; publishing through disk")
        return True
    return False


async def learner_status(
    queue: RedisQueue,
    settings: LearnerSettings,
    loop: LearnerLoop | None,
    state: LoopState,
    error: str | None,
) -> LearnerStatus:
    """GET /v1/status: the counters in Redis, and the loop's step, last publish and
    metrics once it is open (before, the step and version Redis last recorded)."""
    counts = await LearnerState(queue).counts()  # MalformedKey if a counter is not a number
    raw = await queue.get_state()
    in_flight = await loop.admission.in_flight(counts) if loop else counts.in_flight
    report = loop.last_publish if loop else None
    last = loop.last_metrics if loop else None
    return LearnerStatus(
        state=state,
        step=loop.trainer.step if loop else _number(raw, "step", queue),
        version=loop.trainer.version if loop else _number(raw, "version", queue),
        admitted=counts.admitted,
        consumed=counts.consumed,
        dropped=DroppedCounts(
            duplicate=counts.dropped_duplicate, stale=counts.dropped_stale, foreign=counts.foreign
        ),
        in_flight=max(0, in_flight),
        capacity=settings.capacity,
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
        error=error,
    )


def _publisher(settings: LearnerSettings, queue: RedisQueue, trainer: Trainer) -> WeightPublisher:
    """Publishes each version to the engines: from disk, or by broadcast when asked."""
    return WeightPublisher(
        queue,
        settings.weights_root,
        timeout_s=settings.publish_timeout_s,
        keep_versions=settings.keep_versions,
        role_tokens=settings.role_tokens(),
        protected=settings.model_path,  # the base model may live in the weights root (v0)
        broadcast=settings.weight_sync == "broadcast" and not _sharded(trainer),
        broadcast_options={
            "master_address": settings.weight_sync_address,
            "port": settings.weight_sync_port,
            "backend": settings.weight_sync_backend,
            "bucket_bytes": int(settings.weight_sync_bucket_mb * 1024 * 1024),
        },
    )


def _number(raw: dict[str, str], name: str, queue: RedisQueue) -> int:
    try:
        return int(raw.get(name, 0))
    except ValueError as exc:
        raise MalformedKey(f"{queue.keys.learner_state} is malformed ({name}: {exc})") from exc
