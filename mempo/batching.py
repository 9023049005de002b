"""Dynamic, fair batching: concurrent requests share each run, on worker threads.

One batcher serves the scorer (rows of tokens, one forward a batch) and retrieval
(queries, one search a batch). A request is a list of rows with a cost each (tokens,
or 1 a query). Requests wait in a queue (bounded: full is ``Overloaded``, 503 with
Retry-After). A worker thread fills a batch up to ``max_batch_cost``, waiting up to
``max_wait_s`` for more requests after the first, runs it, and hands each request its
own outputs through its asyncio future once all of its rows have run.

Fairness: a request is cut into pieces of rows. A batch holds at most one piece of each
request, of at most ``max_share`` of the budget (a turn), and a request with rows left
goes to the back of the queue; so a request of thousands of rows runs a piece per batch,
even alone, and a small request that comes after it waits for the one batch running (a
turn of each request queued), not for the whole budget or all its rows. ``max_share`` 1
gives every request the whole budget (retrieval: a request's queries go in one search
when they fit).

``run_rows`` answers the version that ran a batch (the scorer's weight version); a
request whose pieces ran under two versions is run again from its first row, so its
outputs always come from one version. A request whose client has gone (its future is
done) is dropped. With several threads, batches run at once. ``stop`` stops intake,
drains what is queued, then joins the threads.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from mempo.service import NotReady, Overloaded

log = logging.getLogger(__name__)

Row = TypeVar("Row")
Out = TypeVar("Out")


@dataclass(frozen=True)
class BatchResult(Generic[Out]):
    outputs: list[Out]  # one per row of the request, in order
    version: str  # what ran every one of them ("" where nothing changes)


@dataclass(eq=False)
class _Job(Generic[Row, Out]):
    rows: list[Row]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[BatchResult[Out]]
    next_row: int = 0  # rows before this one are in a batch already
    done_rows: int = 0
    outputs: dict[int, Out] = field(default_factory=dict)
    version: str | None = None  # the version its finished pieces ran under

    def restart(self) -> None:
        self.next_row, self.done_rows, self.version = 0, 0, None
        self.outputs = {}


@dataclass(frozen=True)
class _Piece(Generic[Row, Out]):
    job: _Job[Row, Out]
    start: int
    stop: int


class Batcher(Generic[Row, Out]):
    def __init__(
        self,
        run_rows: Callable[[Sequence[Row]], tuple[list[Out], str]],
        cost: Callable[[Row], int],
        max_batch_cost: int,
        max_wait_s: float,
        max_queue: int | None = None,
        on_batch: Callable[[int, int, float], None] | None = None,
        max_share: float = 0.25,
        threads: int = 1,
        name: str = "the service",
    ) -> None:
        """``run_rows``: a batch's rows -> (an output per row, the version that ran them);
        ``on_batch(requests, cost, seconds)`` after each batch, for metrics; ``name`` is
        what refusals call the service."""
        self.run_rows = run_rows
        self.cost = cost
        self.max_batch_cost = max_batch_cost
        self.max_wait_s = max_wait_s
        self.max_queue = max_queue
        self.on_batch = on_batch
        self.share = max(1, int(max_batch_cost * max_share))
        self.threads = threads
        self.name = name
        self._jobs: deque[_Job[Row, Out]] = deque()  # rows not yet in a batch, in turn order
        self._cond = threading.Condition()
        self._accepting = False
        self._workers: list[threading.Thread] = []
        self._mean_batch_s = 0.05

    @property
    def running(self) -> bool:
        return self._accepting and any(t.is_alive() for t in self._workers)

    @property
    def depth(self) -> int:
        return len(self._jobs)

    def start(self) -> None:
        self._accepting = True
        self._workers = [
            threading.Thread(target=self._work, name=f"batcher-{i}", daemon=True)
            for i in range(self.threads)
        ]
        for worker in self._workers:
            worker.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop intake, let the workers drain the queue, join them."""
        with self._cond:
            self._accepting = False
            self._cond.notify_all()
        deadline = time.monotonic() + timeout_s
        for worker in self._workers:
            worker.join(max(0.0, deadline - time.monotonic()))

    async def submit(self, rows: Sequence[Row]) -> BatchResult[Out]:
        loop = asyncio.get_running_loop()
        job: _Job[Row, Out] = _Job(list(rows), loop, loop.create_future())
        with self._cond:
            if not self._accepting:
                raise NotReady(f"{self.name} is shutting down")
            if self.max_queue is not None and len(self._jobs) >= self.max_queue:
                wait = self._mean_batch_s * (1 + len(self._jobs) / 4)
                raise Overloaded(f"the queue is full ({len(self._jobs)} requests)", wait)
            self._jobs.append(job)
            self._cond.notify()
        return await job.future

    # ----------------------------------------------------------------- worker threads

    def _cut(
        self, job: _Job[Row, Out], budget: int, first: bool
    ) -> tuple[_Piece[Row, Out], int] | None:
        """The job's next piece within ``budget`` and a turn's share (its first row goes
        alone if larger); None when not even that row fits a batch that has pieces."""
        limit = min(budget, self.share)
        start = stop = job.next_row
        used = 0
        while stop < len(job.rows):
            cost = self.cost(job.rows[stop])
            if stop == start:
                if cost > budget and not first:
                    return None
            elif used + cost > limit:
                break
            used += cost
            stop += 1
        job.next_row = stop
        return _Piece(job, start, stop), used

    def _take_batch(self) -> tuple[list[_Piece[Row, Out]], int] | None:
        """The next batch's pieces and cost, or None once stopped and drained."""
        with self._cond:
            while not self._jobs:
                if not self._accepting:
                    return None
                self._cond.wait()
            pieces: list[_Piece[Row, Out]] = []
            cost = 0
            deadline = time.monotonic() + self.max_wait_s
            while cost < self.max_batch_cost:
                if self._jobs:
                    job = self._jobs[0]
                    if job.future.done():  # the client went away
                        self._jobs.popleft()
                        continue
                    if any(p.job is job for p in pieces):  # every queued job had its turn
                        break
                    cut = self._cut(job, self.max_batch_cost - cost, first=not pieces)
                    if cut is None:
                        break
                    pieces.append(cut[0])
                    cost += cut[1]
                    self._jobs.popleft()
                    if job.next_row < len(job.rows):
                        self._jobs.append(job)  # its next turn comes after the others'
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._accepting:
                    break
                self._cond.wait(remaining)
            return pieces, cost

    def _work(self) -> None:
        while (taken := self._take_batch()) is not None:
            pieces, cost = taken
            if not pieces:
                continue
            started = time.monotonic()
            rows = [row for p in pieces for row in p.job.rows[p.start : p.stop]]
            jobs = list(dict.fromkeys(p.job for p in pieces))
            try:
                outputs, version = self.run_rows(rows)
                if len(outputs) != len(rows):
                    raise RuntimeError(f"{len(outputs)} outputs for a batch of {len(rows)} rows")
            except Exception as exc:  # the requests fail, the worker lives on
                log.exception("a batch of %d requests failed", len(jobs))
                self._fail(jobs, exc)
                continue
            with self._cond:
                self._merge(pieces, jobs, outputs, version)
            elapsed = time.monotonic() - started
            self._mean_batch_s = 0.8 * self._mean_batch_s + 0.2 * elapsed
            if self.on_batch is not None:
                self.on_batch(len(jobs), cost, elapsed)

    def _merge(
        self,
        pieces: list[_Piece[Row, Out]],
        jobs: list[_Job[Row, Out]],
        outputs: list[Out],
        version: str,
    ) -> None:
        """File the batch's outputs under their jobs; deliver the jobs now complete."""
        stale = {j for j in jobs if j.version is not None and j.version != version}
        at = 0
        for piece in pieces:
            if piece.job not in stale:
                for local in range(piece.start, piece.stop):
                    piece.job.outputs[local] = outputs[at + local - piece.start]
            at += piece.stop - piece.start
            piece.job.done_rows += piece.stop - piece.start
        for job in jobs:
            if job in stale:  # the version changed between its pieces: run it again
                log.info("a request spanned versions %s, %s: rerun", job.version, version)
                job.restart()
                if job not in self._jobs:
                    self._jobs.append(job)
                continue
            job.version = version
            if job.done_rows == len(job.rows):
                result = BatchResult([job.outputs[i] for i in range(len(job.rows))], version)
                _deliver(job, _set_result, result)

    def _fail(self, jobs: list[_Job[Row, Out]], exc: Exception) -> None:
        with self._cond:
            for job in jobs:
                if job in self._jobs:
                    self._jobs.remove(job)
        for job in jobs:
            _deliver(job, _set_exception, exc)


def _deliver(job: _Job[Row, Out], setter: Callable[..., None], value: object) -> None:
    try:
        job.loop.call_soon_threadsafe(setter, job.future, value)
    except RuntimeError:  # the event loop is gone (shutdown): nobody waits any more
        log.debug("dropped a result: its event loop is closed")


def _set_result(future: asyncio.Future[BatchResult[Out]], result: BatchResult[Out]) -> None:
    if not future.done():  # the client may have gone away
        future.set_result(result)


def _set_exception(future: asyncio.Future[BatchResult[Out]], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
