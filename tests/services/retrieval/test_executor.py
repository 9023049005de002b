"""services/retrieval/executor.py: batching concurrent requests off the event loop."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from mempo.service import NotReady
from services.retrieval.executor import BatchingExecutor


class RecordingSearch:
    """Per query, k results naming the query; records every batch and its thread."""

    def __init__(self, delay_s: float = 0.02, fail_on: str | None = None) -> None:
        self.delay_s = delay_s
        self.fail_on = fail_on
        self.batches: list[tuple[list[str], int]] = []
        self.threads: set[int] = set()

    def __call__(self, queries: list[str], k: int) -> list[list[str]]:
        self.batches.append((list(queries), k))
        self.threads.add(threading.get_ident())
        time.sleep(self.delay_s)  # blocks its thread, not the event loop
        if self.fail_on is not None and self.fail_on in queries:
            raise RuntimeError(f"cannot search {self.fail_on}")
        return [[f"{q}#{i}" for i in range(k)] for q in queries]


async def test_concurrent_requests_are_batched_and_routed_back() -> None:
    search = RecordingSearch()
    executor: BatchingExecutor[str] = BatchingExecutor(search, max_queries=64)
    requests = [[f"q{i}-{j}" for j in range(i % 3 + 1)] for i in range(30)]
    results = await asyncio.gather(
        *(executor.run(qs, k=i % 4 + 1) for i, qs in enumerate(requests))
    )
    await executor.close()
    for i, (queries, result) in enumerate(zip(requests, results, strict=True)):
        assert result == [[f"{q}#{n}" for n in range(i % 4 + 1)] for q in queries]
    assert len(search.batches) < len(requests) / 3  # merged, not one search per request
    assert threading.get_ident() not in search.threads  # never on the event loop's thread


async def test_the_loop_stays_responsive_during_a_search() -> None:
    executor: BatchingExecutor[str] = BatchingExecutor(RecordingSearch(delay_s=0.3))
    pending = asyncio.create_task(executor.run(["slow"], 1))
    started = time.perf_counter()
    await asyncio.sleep(0.01)
    assert time.perf_counter() - started < 0.2
    assert await pending == [["slow#0"]]
    await executor.close()


async def test_batches_respect_the_query_limit_and_never_split_a_request() -> None:
    search = RecordingSearch()
    executor: BatchingExecutor[str] = BatchingExecutor(search, max_queries=5)
    requests = [["a", "b", "c"], ["d", "e", "f"], ["g"] * 7, ["h"]]
    results = await asyncio.gather(*(executor.run(qs, 1) for qs in requests))
    await executor.close()
    assert [len(r) for r in results] == [3, 3, 7, 1]
    sizes = [len(batch) for batch, _ in search.batches]
    assert all(size <= 5 for size in sizes if size != 7) and 7 in sizes
    assert sorted(q for batch, _ in search.batches for q in batch) == sorted(
        q for qs in requests for q in qs
    )


async def test_a_failed_batch_fails_each_of_its_requests() -> None:
    executor: BatchingExecutor[str] = BatchingExecutor(RecordingSearch(delay_s=0.05, fail_on="bad"))
    first = asyncio.create_task(executor.run(["warm"], 1))  # occupies the thread
    await asyncio.sleep(0.01)
    doomed = [asyncio.create_task(executor.run(qs, 1)) for qs in (["bad"], ["innocent"])]
    assert await first == [["warm#0"]]
    for task in doomed:
        with pytest.raises(RuntimeError, match="cannot search bad"):
            await task
    assert await executor.run(["after"], 2) == [["after#0", "after#1"]]  # it recovers
    await executor.close()


async def test_wait_gathers_a_fuller_batch() -> None:
    search = RecordingSearch(delay_s=0.0)
    executor: BatchingExecutor[str] = BatchingExecutor(search, wait_s=0.1)

    async def later(i: int) -> list[list[str]]:
        await asyncio.sleep(0.01 * i)
        return await executor.run([f"q{i}"], 1)

    await asyncio.gather(*(later(i) for i in range(5)))
    await executor.close()
    assert len(search.batches) == 1 and len(search.batches[0][0]) == 5


async def test_close_drains_then_refuses() -> None:
    search = RecordingSearch(delay_s=0.05)
    executor: BatchingExecutor[str] = BatchingExecutor(search)
    tasks = [asyncio.create_task(executor.run([f"q{i}"], 1)) for i in range(4)]
    await asyncio.sleep(0)
    await executor.close()
    assert [await t for t in tasks] == [[[f"q{i}#0"]] for i in range(4)]
    with pytest.raises(NotReady):
        await executor.run(["late"], 1)


async def test_several_threads_run_batches_at_once() -> None:
    search = RecordingSearch(delay_s=0.2)
    executor: BatchingExecutor[str] = BatchingExecutor(search, max_queries=1, threads=2)
    started = time.perf_counter()
    await asyncio.gather(executor.run(["a"], 1), executor.run(["b"], 1))
    assert time.perf_counter() - started < 0.35 and len(search.threads) == 2
    await executor.close()
