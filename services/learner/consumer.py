"""Group consumption: claim groups, drop duplicates and stale ones, build batches.

- On start, the groups this consumer claimed but never acked (a crash) are read back
  first; then new ones are claimed, and groups idle in another consumer's pending list
  for ``claim_idle_ms`` are taken over (RedisQueue.claim_groups).
- A duplicate (its group_id was trained on, per the checkpoint or this run, or is
  already in the batch) and a stale group (``policy_version < version - max_staleness``)
  are acked and counted; a malformed record is dead-lettered by the queue, and a group
  the trainer cannot use (``validate``: a token id outside the vocabulary) by us.
- Groups of a batch are acked only by ``ack``, which the loop calls after the
  checkpoint that includes them is durable (exactly-once training).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from statistics import fmean

from mempo.keys import LEARNER_GROUP
from mempo.queue import Delivery, RedisQueue
from mempo.schemas import Group
from services.learner.state import DropReason, LearnerState

log = logging.getLogger(__name__)


@dataclass
class Batch:
    """``batch_groups`` groups claimed together; trained, checkpointed, then acked."""

    deliveries: list[Delivery[Group]] = field(default_factory=list)

    @property
    def groups(self) -> list[Group]:
        return [d.record for d in self.deliveries]

    @property
    def group_ids(self) -> list[str]:
        return [d.record.group_id for d in self.deliveries]

    @property
    def entry_ids(self) -> list[str]:
        return [d.entry_id for d in self.deliveries]

    def staleness(self, version: int) -> dict[str, float]:
        """How many versions the groups lag the learner (the trainer reports the rest)."""
        lags = [version - g.policy_version for g in self.groups]
        return {"staleness_mean": fmean(lags), "staleness_max": float(max(lags))}


class TrainedIds:
    """Ids of the groups trained on, oldest first, bounded to the last ``limit``."""

    def __init__(self, ids: Iterable[str] = (), limit: int = 100_000) -> None:
        self.limit = limit
        self._ids: dict[str, None] = {}
        self.add(ids)

    def __contains__(self, group_id: object) -> bool:
        return group_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, ids: Iterable[str]) -> None:
        for group_id in ids:
            self._ids.pop(group_id, None)
            self._ids[group_id] = None
        while len(self._ids) > self.limit:
            del self._ids[next(iter(self._ids))]

    def with_(self, ids: Iterable[str]) -> list[str]:
        """These ids plus ``ids``, as the checkpoint should record them."""
        copy = TrainedIds(self._ids, self.limit)
        copy.add(ids)
        return list(copy._ids)


class GroupConsumer:
    """Builds batches of fresh, unique groups from the group stream."""

    def __init__(
        self,
        queue: RedisQueue,
        state: LearnerState,
        batch_groups: int,
        max_staleness: int,
        trained: TrainedIds | None = None,
        on_drop: Callable[[DropReason], None] | None = None,
        validate: Callable[[Group], str | None] | None = None,
        run_id: str | None = None,
    ) -> None:
        if batch_groups < 1 or max_staleness < 0:
            raise ValueError("batch_groups must be >= 1 and max_staleness >= 0")
        self.queue, self.state = queue, state
        self.batch_groups, self.max_staleness = batch_groups, max_staleness
        self.trained = trained or TrainedIds()
        self.on_drop = on_drop
        self.validate = validate
        # This run's groups are "{run_id}-g{i}" (admission.py); None: every group is ours.
        self.own_prefix = f"{run_id}-g" if run_id is not None else ""
        self._batch = Batch()
        self._pending_read = False

    def restart(self) -> None:
        """Forget the partial batch and read our pending groups again (after an error)."""
        self._batch = Batch()
        self._pending_read = False

    async def next_batch(self, version: int, block_ms: int | None = 1000) -> Batch | None:
        """A full batch, or None when the stream ran dry first (the partial batch is kept).

        ``block_ms=None`` is burst mode: never wait for new groups.
        """
        if not self._pending_read:
            # Our own unacked groups first: a crash left them pending under our name.
            await self._take(await self.queue.pending_groups(count=100_000), version)
            self._pending_read = True
        else:  # what waited since the last batch may have gone stale meanwhile
            waiting, self._batch = self._batch.deliveries, Batch()
            await self._take(waiting, version)
        while len(self._batch.deliveries) < self.batch_groups:
            need = self.batch_groups - len(self._batch.deliveries)
            dead_before = await self._dead_count()
            claimed = await self.queue.claim_groups(need, block_ms=block_ms)
            if not claimed:
                if await self._dead_count() > dead_before:
                    continue  # all it claimed was dead-lettered: the stream may hold more
                return None
            await self._take(claimed, version)
        ready = self._batch.deliveries
        self._batch = Batch(ready[self.batch_groups :])  # more pending than one batch
        return Batch(ready[: self.batch_groups])

    async def _dead_count(self) -> int:
        return (await self.queue.stream_lengths())["dead"]

    async def _take(self, deliveries: list[Delivery[Group]], version: int) -> None:
        for delivery in deliveries:
            if self.validate is not None and (why := self.validate(delivery.record)):
                await self._dead_letter(delivery, why)
                continue
            if delivery.record.policy_version > version:  # no engine serves a version not yet published
                await self._dead_letter(
                    delivery, f"policy_version {delivery.record.policy_version} is ahead of the learner's {version}"
                )
                continue
            reason = self._drop_reason(delivery.record, version)
            if reason is None:
                self._batch.deliveries.append(delivery)
                continue
            await self.queue.ack_groups([delivery.entry_id])
            if self.is_own(delivery.record):
                await self.state.count_dropped(reason)
            else:
                await self.state.add(foreign=1)
            if self.on_drop is not None:
                self.on_drop(reason)
            log.info(
                "dropped %s group %s (policy_version %d, learner version %d)",
                reason,
                delivery.record.group_id,
                delivery.record.policy_version,
                version,
            )

    async def _dead_letter(self, delivery: Delivery[Group], why: str) -> None:
        """A group the trainer cannot use goes to the dead stream now, not after crashes."""
        data = delivery.record.model_dump_json(context={"pack": True})
        await self.queue.dead_letter(
            self.queue.keys.groups,
            LEARNER_GROUP,
            delivery.entry_id,
            data,
            f"untrainable group: {why}",
        )

    async def dead_letter(self, batch: Batch, why: str) -> None:
        """Training on ``batch`` failed and left the trainer as it was: its groups go to
        the dead stream with the reason (replayable from there), the learner goes on."""
        for delivery in batch.deliveries:
            await self._dead_letter(delivery, why)

    def is_own(self, group: Group) -> bool:
        """Whether ``group`` answers a task this run admitted (only those count against
        admission: a foreign group consumed must not make room for more tasks)."""
        return group.group_id.startswith(self.own_prefix)

    def _drop_reason(self, group: Group, version: int) -> DropReason | None:
        if group.group_id in self.trained or group.group_id in self._batch.group_ids:
            return "duplicate"
        if group.policy_version < version - self.max_staleness:
            return "stale"
        return None

    def trained_on(self, batch: Batch) -> None:
        """The checkpoint holding ``batch`` is durable: its groups are never trained again."""
        self.trained.add(batch.group_ids)

    async def ack(self, batch: Batch) -> None:
        """The batch is trained and its checkpoint durable: ack and count it."""
        self.trained_on(batch)
        await self.queue.ack_groups(batch.entry_ids)
        own = sum(self.is_own(group) for group in batch.groups)
        await self.state.add(consumed=own, foreign=len(batch.deliveries) - own)

    async def release(self, batch: Batch, reason: str) -> None:
        """Training failed: record why; the groups stay pending and come back after
        ``claim_idle_ms``, and go to the dead stream after ``max_deliveries``."""
        for entry_id in batch.entry_ids:
            await self.queue.record_failure(entry_id, reason)
