"""Search off the event loop, merging concurrent requests into batches.

Requests queue up; a dispatcher takes everything queued (up to ``max_queries`` queries,
optionally waiting ``wait_s`` for more), runs one search over the whole batch in a worker
thread, and hands each request its own slice. A batch is searched at the largest k any
of its requests asked for and cut per request (top-k lists are prefixes of each other).
Shutdown stops intake, lets queued requests finish, then stops the dispatcher.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from mempo.service import NotReady

log = logging.getLogger(__name__)

R = TypeVar("R")
SearchFn = Callable[[list[str], int], list[list[R]]]


@dataclass
class _Pending(Generic[R]):
    queries: list[str]
    k: int
    future: asyncio.Future[list[list[R]]] = field(repr=False)


class BatchingExecutor(Generic[R]):
    """``await run(queries, k)`` -> per query, up to k results of ``search``."""

    def __init__(
        self,
        search: SearchFn[R],
        max_queries: int = 512,
        wait_s: float = 0.0,
        threads: int = 1,
        on_batch: Callable[[int, float], None] | None = None,
    ) -> None:
        self.search = search
        self.max_queries = max_queries
        self.wait_s = wait_s
        self.on_batch = on_batch  # (queries, seconds) of each batch, for metrics
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="search")
        self.slots = asyncio.Semaphore(threads)
        self.queue: asyncio.Queue[_Pending[R]] = asyncio.Queue()
        self.accepting = True
        self.running: set[asyncio.Task[None]] = set()
        self.held: _Pending[R] | None = None  # too big to join the last batch: leads the next
        self.dispatcher = asyncio.get_running_loop().create_task(self._dispatch())

    async def run(self, queries: Sequence[str], k: int) -> list[list[R]]:
        if not self.accepting:
            raise NotReady("the retrieval service is shutting down")
        future: asyncio.Future[list[list[R]]] = asyncio.get_running_loop().create_future()
        await self.queue.put(_Pending(list(queries), k, future))
        return await future

    async def _dispatch(self) -> None:
        while True:
            first, self.held = self.held or await self.queue.get(), None
            await self.slots.acquire()  # a thread is free: form the batch now
            batch = await self._collect(first)
            task = asyncio.create_task(self._execute(batch))
            self.running.add(task)
            task.add_done_callback(self.running.discard)

    async def _collect(self, first: _Pending[R]) -> list[_Pending[R]]:
        batch, size = [first], len(first.queries)
        deadline = time.monotonic() + self.wait_s
        while size < self.max_queries:
            try:
                if self.wait_s > 0 and (remaining := deadline - time.monotonic()) > 0:
                    item = await asyncio.wait_for(self.queue.get(), remaining)
                else:
                    item = self.queue.get_nowait()
            except (asyncio.QueueEmpty, asyncio.TimeoutError):
                break
            if size + len(item.queries) > self.max_queries:
                self.held = item  # requests are never split
                break
            batch.append(item)
            size += len(item.queries)
        return batch

    async def _execute(self, batch: list[_Pending[R]]) -> None:
        queries = [q for item in batch for q in item.queries]
        k = max(item.k for item in batch)
        started = time.perf_counter()
        try:
            loop = asyncio.get_running_loop()
            results = await loop.run_in_executor(self.pool, self.search, queries, k)
            if len(results) != len(queries):
                raise RuntimeError(
                    f"search returned {len(results)} lists for {len(queries)} queries"
                )
        except Exception as exc:  # every request of the batch gets the error
            log.exception("search of a batch of %d queries failed", len(queries))
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(exc)
            return
        finally:
            self.slots.release()
            for _ in batch:
                self.queue.task_done()
        if self.on_batch is not None:
            self.on_batch(len(queries), time.perf_counter() - started)
        offset = 0
        for item in batch:
            mine = results[offset : offset + len(item.queries)]
            offset += len(item.queries)
            if not item.future.done():  # the client may have gone away
                item.future.set_result([hits[: item.k] for hits in mine])

    async def close(self) -> None:
        """Stop intake, finish what is queued and running, then stop the dispatcher."""
        self.accepting = False
        await self.queue.join()
        if self.running:
            await asyncio.gather(*self.running, return_exceptions=True)
        self.dispatcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.dispatcher
        self.pool.shutdown(wait=True)
