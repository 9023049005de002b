"""Dynamic batching: concurrent requests share forwards, on one worker thread.

Requests wait in a bounded queue (full: ``Overloaded``, 503 with Retry-After). The
worker takes the oldest, then keeps taking more until the batch reaches the token
budget or ``max_wait_s`` has passed, runs them together and hands each request its
own results through its asyncio future. ``stop`` stops intake, drains what is queued,
then joins the thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from mempo.service import NotReady, Overloaded
from services.scorer.plan import LogProbTable, Row

log = logging.getLogger(__name__)

# rows in -> (log-prob table keyed by the rows' indices, weight version that ran them)
RunRows = Callable[[Sequence[Row]], tuple[LogProbTable, str]]


@dataclass(frozen=True)
class BatchResult:
    logprobs: LogProbTable  # keyed (row index within the job, segment)
    weight_version: str


@dataclass
class _Job:
    rows: list[Row]
    tokens: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[BatchResult]
    enqueued: float = field(default_factory=time.monotonic)


class Batcher:
    def __init__(
        self,
        run_rows: RunRows,
        max_batch_tokens: int,
        max_wait_s: float,
        max_queue: int,
        on_batch: Callable[[int, int, float], None] | None = None,
    ) -> None:
        self.run_rows = run_rows
        self.max_batch_tokens = max_batch_tokens
        self.max_wait_s = max_wait_s
        self.max_queue = max_queue
        self.on_batch = on_batch  # (jobs, tokens, seconds), for metrics
        self._jobs: deque[_Job] = deque()
        self._cond = threading.Condition()
        self._accepting = False
        self._thread: threading.Thread | None = None
        self._mean_batch_s = 0.05

    @property
    def running(self) -> bool:
        return self._accepting and self._thread is not None and self._thread.is_alive()

    @property
    def depth(self) -> int:
        return len(self._jobs)

    def start(self) -> None:
        self._accepting = True
        self._thread = threading.Thread(target=self._work, name="scorer-batcher", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop intake, let the worker drain the queue, join it."""
        with self._cond:
            self._accepting = False
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)

    async def submit(self, rows: list[Row]) -> BatchResult:
        loop = asyncio.get_running_loop()
        job = _Job(rows, sum(r.num_tokens for r in rows), loop, loop.create_future())
        with self._cond:
            if not self._accepting:
                raise NotReady("the scorer is shutting down")
            if len(self._jobs) >= self.max_queue:
                wait = self._mean_batch_s * (1 + len(self._jobs) / 4)
                raise Overloaded(f"the scoring queue is full ({len(self._jobs)} requests)", wait)
            self._jobs.append(job)
            self._cond.notify()
        return await job.future

    # ----------------------------------------------------------------- worker thread

    def _take_batch(self) -> list[_Job] | None:
        """The next batch, or None once stopped and drained."""
        with self._cond:
            while not self._jobs:
                if not self._accepting:
                    return None
                self._cond.wait()
            batch = [self._jobs.popleft()]
            tokens = batch[0].tokens
            deadline = time.monotonic() + self.max_wait_s
            while tokens < self.max_batch_tokens:
                if self._jobs:
                    if tokens + self._jobs[0].tokens > self.max_batch_tokens:
                        break
                    job = self._jobs.popleft()
                    batch.append(job)
                    tokens += job.tokens
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._accepting:
                    break
                self._cond.wait(remaining)
            return batch

    def _work(self) -> None:
        while (batch := self._take_batch()) is not None:
            started = time.monotonic()
            rows = [row for job in batch for row in job.rows]
            try:
                table, version = self.run_rows(rows)
            except Exception as exc:  # the requests fail, the worker lives on
                log.exception("scoring a batch of %d requests failed", len(batch))
                for job in batch:
                    _deliver(job, _set_exception, exc)
                continue
            owner: list[tuple[int, int]] = []  # batch row -> (job, row within the job)
            for j, job in enumerate(batch):
                owner.extend((j, r) for r in range(len(job.rows)))
            own: list[LogProbTable] = [{} for _ in batch]
            for (r, s), values in table.items():
                j, local = owner[r]
                own[j][(local, s)] = values
            for job, logprobs in zip(batch, own, strict=True):
                _deliver(job, _set_result, BatchResult(logprobs, version))
            elapsed = time.monotonic() - started
            self._mean_batch_s = 0.8 * self._mean_batch_s + 0.2 * elapsed
            if self.on_batch is not None:
                self.on_batch(len(batch), sum(j.tokens for j in batch), elapsed)


def _deliver(job: _Job, setter: Callable[..., None], value: object) -> None:
    try:
        job.loop.call_soon_threadsafe(setter, job.future, value)
    except RuntimeError:  # the event loop is gone (shutdown): nobody waits any more
        log.debug("dropped a result: its event loop is closed")


def _set_result(future: asyncio.Future[BatchResult], result: BatchResult) -> None:
    if not future.done():  # the client may have gone away
        future.set_result(result)


def _set_exception(future: asyncio.Future[BatchResult], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
