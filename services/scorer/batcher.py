"""Dynamic, fair batching: concurrent requests share forwards, on one worker thread.

Requests wait in a bounded queue (full: ``Overloaded``, 503 with Retry-After). The
worker fills a batch up to the token budget, waiting up to ``max_wait_s`` for more
requests after the first, and hands each request its own results through its asyncio
future once all of its rows have run.

Fairness: a request is cut into pieces of rows. A batch holds at most one piece of each
request, of at most ``max_share`` of the budget (a turn), and a request with rows left
goes to the back of the queue; so a request of thousands of rows runs a piece per batch,
even alone, and a small request that comes after it waits for the one batch running (a
turn of each request queued), not for the whole budget or all its rows. A request whose pieces ran under two weight versions is
run again from its first row (its results always come from one version). A request
whose client has gone (its future is done) is dropped. ``stop`` stops intake, drains
what is queued, then joins the thread.
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


@dataclass(eq=False)
class _Job:
    rows: list[Row]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[BatchResult]
    enqueued: float = field(default_factory=time.monotonic)
    next_row: int = 0  # rows before this one are in a batch already
    done_rows: int = 0
    logprobs: LogProbTable = field(default_factory=dict)
    version: str | None = None  # the weight version its finished pieces ran under

    def restart(self) -> None:
        self.next_row, self.done_rows, self.version = 0, 0, None
        self.logprobs = {}


@dataclass(frozen=True)
class _Piece:
    job: _Job
    start: int
    stop: int


class Batcher:
    def __init__(
        self,
        run_rows: RunRows,
        max_batch_tokens: int,
        max_wait_s: float,
        max_queue: int,
        on_batch: Callable[[int, int, float], None] | None = None,
        max_share: float = 0.25,
    ) -> None:
        self.run_rows = run_rows
        self.max_batch_tokens = max_batch_tokens
        self.max_wait_s = max_wait_s
        self.max_queue = max_queue
        self.on_batch = on_batch  # (jobs, tokens, seconds), for metrics
        self.share_tokens = max(1, int(max_batch_tokens * max_share))
        self._jobs: deque[_Job] = deque()  # jobs with rows not yet in a batch, in turn order
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
        job = _Job(rows, loop, loop.create_future())
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

    def _cut(self, job: _Job, budget: int, first: bool) -> tuple[_Piece, int] | None:
        """The job's next piece within ``budget`` tokens and a turn's share (its first row
        goes alone if larger); None when not even that row fits a batch that has pieces
        already."""
        limit = min(budget, self.share_tokens)
        start = stop = job.next_row
        used = 0
        while stop < len(job.rows):
            tokens = job.rows[stop].num_tokens
            if stop == start:
                if tokens > budget and not first:
                    return None
            elif used + tokens > limit:
                break
            used += tokens
            stop += 1
        job.next_row = stop
        return _Piece(job, start, stop), used

    def _take_batch(self) -> tuple[list[_Piece], int] | None:
        """The next batch's pieces and tokens, or None once stopped and drained."""
        with self._cond:
            while not self._jobs:
                if not self._accepting:
                    return None
                self._cond.wait()
            pieces: list[_Piece] = []
            tokens = 0
            deadline = time.monotonic() + self.max_wait_s
            while tokens < self.max_batch_tokens:
                if self._jobs:
                    job = self._jobs[0]
                    if job.future.done():  # the client went away
                        self._jobs.popleft()
                        continue
                    if any(p.job is job for p in pieces):  # every queued job had its turn
                        break
                    cut = self._cut(job, self.max_batch_tokens - tokens, first=not pieces)
                    if cut is None:
                        break
                    pieces.append(cut[0])
                    tokens += cut[1]
                    self._jobs.popleft()
                    if job.next_row < len(job.rows):
                        self._jobs.append(job)  # its next turn comes after the others'
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._accepting:
                    break
                self._cond.wait(remaining)
            return pieces, tokens

    def _work(self) -> None:
        while (taken := self._take_batch()) is not None:
            pieces, tokens = taken
            if not pieces:
                continue
            started = time.monotonic()
            rows = [row for p in pieces for row in p.job.rows[p.start : p.stop]]
            jobs = list(dict.fromkeys(p.job for p in pieces))
            try:
                table, version = self.run_rows(rows)
            except Exception as exc:  # the requests fail, the worker lives on
                log.exception("scoring a batch of %d requests failed", len(jobs))
                self._fail(jobs, exc)
                continue
            self._merge(pieces, jobs, table, version)
            elapsed = time.monotonic() - started
            self._mean_batch_s = 0.8 * self._mean_batch_s + 0.2 * elapsed
            if self.on_batch is not None:
                self.on_batch(len(jobs), tokens, elapsed)

    def _merge(
        self, pieces: list[_Piece], jobs: list[_Job], table: LogProbTable, version: str
    ) -> None:
        """File the batch's results under their jobs; deliver the jobs now complete."""
        stale = {j for j in jobs if j.version is not None and j.version != version}
        owner: list[tuple[_Piece, int]] = []  # batch row -> (piece, row within the job)
        for piece in pieces:
            owner.extend((piece, r) for r in range(piece.start, piece.stop))
        for (r, s), values in table.items():
            piece, local = owner[r]
            if piece.job not in stale:
                piece.job.logprobs[(local, s)] = values
        for piece in pieces:
            piece.job.done_rows += piece.stop - piece.start
        for job in jobs:
            if job in stale:  # the weights changed between its pieces: run it again
                log.info("a request spanned weight versions %s, %s: rerun", job.version, version)
                with self._cond:
                    job.restart()
                    if job not in self._jobs:
                        self._jobs.append(job)
                continue
            job.version = version
            if job.done_rows == len(job.rows):
                _deliver(job, _set_result, BatchResult(job.logprobs, version))

    def _fail(self, jobs: list[_Job], exc: Exception) -> None:
        with self._cond:
            for job in jobs:
                if job in self._jobs:
                    self._jobs.remove(job)
        for job in jobs:
            _deliver(job, _set_exception, exc)


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
