"""The learner's persisted counters, in the learner state hash (``mempo:learner:state``).

Counters are incremented atomically (HINCRBY), so a restart resumes the counts and
the admission bound keeps holding across it (AReaL's staleness bound broke on resume,
AReaL#1388). ``run_id`` names this run's tasks: task ``i`` of a run always has the
same ids, so one admitted twice around a crash is dropped downstream as a duplicate.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Literal

from mempo.queue import MalformedKey, RedisQueue

DropReason = Literal["duplicate", "stale"]
_COUNTERS = ("admitted", "consumed", "dropped_duplicate", "dropped_stale", "foreign")


@dataclass(frozen=True)
class Counts:
    """Tasks admitted, groups trained on, groups dropped (duplicate / stale): of this run's
    tasks; ``foreign``: groups of tasks this run never admitted (another run's, or pushed
    by hand), trained on or dropped, and never counted against admission."""

    admitted: int = 0
    consumed: int = 0
    dropped_duplicate: int = 0
    dropped_stale: int = 0
    foreign: int = 0

    @property
    def in_flight(self) -> int:
        """Admitted tasks whose group is not trained on or dropped yet.

        Duplicates are not subtracted: a duplicate is a second group of a task already
        counted once (a worker died between pushing the group and acking the task).
        """
        return self.admitted - self.consumed - self.dropped_stale


class LearnerState:
    """Read and update the learner state hash through the queue's Redis connection."""

    def __init__(self, queue: RedisQueue) -> None:
        self.queue = queue

    async def counts(self) -> Counts:
        raw = await self.queue.get_state()
        try:
            return Counts(**{name: int(raw.get(name, 0)) for name in _COUNTERS})
        except ValueError as exc:
            raise MalformedKey(f"{self.queue.keys.learner_state} is malformed: {exc}") from exc

    async def add(self, **deltas: int) -> None:
        """Atomically add to counters, e.g. ``add(consumed=4)``."""
        unknown = set(deltas) - set(_COUNTERS)
        if unknown:
            raise ValueError(f"unknown counters {sorted(unknown)}")
        await self.queue.add_to_state(**deltas)

    async def count_dropped(self, reason: DropReason, n: int = 1) -> None:
        await self.add(**{f"dropped_{reason}": n})

    async def run_id(self) -> str:
        """This run's id, created on first start and kept across restarts."""
        return await self.queue.state_once("run_id", f"run-{uuid.uuid4().hex[:12]}")
