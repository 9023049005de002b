"""mempo/batching.py, the batcher of the scorer and of retrieval: batching by time and
cost, each request its own outputs, fairness, versions, 503 when full, threads, stop."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence

import pytest

from mempo.batching import Batcher
from mempo.service import NotReady, Overloaded


class Recorder:
    """A run_rows that echoes each row, records every batch (and its thread), and can be
    held at a gate."""

    def __init__(self, gate: threading.Event | None = None, delay_s: float = 0.0) -> None:
        self.batches: list[list[int]] = []
        self.threads: set[int] = set()
        self.gate = gate
        self.delay_s = delay_s
        self.started = threading.Event()

    def __call__(self, rows: Sequence[int]) -> tuple[list[int], str]:
        self.started.set()
        if self.gate is not None:
            self.gate.wait(10)
        time.sleep(self.delay_s)
        self.batches.append(list(rows))
        self.threads.add(threading.get_ident())
        return list(rows), "v7"


def batcher(run: object, cost: int = 4, **options: object) -> Batcher[int, int]:
    """A batcher of int rows, each costing ``cost``."""
    defaults: dict[str, object] = {"max_batch_cost": 10_000, "max_wait_s": 0.0, "max_queue": 16}
    made: Batcher[int, int] = Batcher(run, lambda _row: cost, **{**defaults, **options})  # type: ignore[arg-type]
    made.start()
    return made


async def test_concurrent_requests_batch_and_get_their_own_rows() -> None:
    run = Recorder()
    b = batcher(run, max_wait_s=0.2)
    try:
        results = await asyncio.gather(*(b.submit([t] * t) for t in range(1, 6)))
    finally:
        b.stop()
    assert [(r.outputs, r.version) for r in results] == [([t] * t, "v7") for t in range(1, 6)]
    assert len(run.batches) < 5 and sum(map(len, run.batches)) == 15
    assert threading.get_ident() not in run.threads  # never on the event loop's thread


async def test_the_cost_budget_splits_batches() -> None:
    run = Recorder()
    b = batcher(run, max_batch_cost=8)
    try:
        await asyncio.gather(*(b.submit([t]) for t in range(1, 7)))
    finally:
        b.stop()
    assert run.batches and max(map(len, run.batches)) <= 2  # 4 a row, 8 a batch


async def test_a_full_queue_is_overloaded_with_retry_after_and_a_stopped_one_refuses() -> None:
    gate = threading.Event()
    run = Recorder(gate)
    b = batcher(run, max_batch_cost=4, max_queue=2)
    try:
        first = asyncio.ensure_future(b.submit([1]))
        assert await asyncio.to_thread(run.started.wait, 5)  # the worker holds the first
        queued = [asyncio.ensure_future(b.submit([t])) for t in (2, 3)]
        while b.depth < 2:
            await asyncio.sleep(0.01)
        with pytest.raises(Overloaded) as info:
            await b.submit([4])
        assert info.value.status_code == 503 and "Retry-After" in (info.value.headers or {})
        gate.set()
        await asyncio.gather(first, *queued)
    finally:
        gate.set()
        b.stop()
    with pytest.raises(NotReady, match="the service is shutting down"):
        await b.submit([5])


async def test_a_failing_batch_fails_its_requests_only() -> None:
    calls = 0

    def flaky(rows: Sequence[int]) -> tuple[list[int], str]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("boom")
        if calls == 2:
            return [], "0"  # an output short: the batch's requests fail
        return list(rows), "0"

    b = batcher(flaky, max_batch_cost=100)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            await b.submit([1])
        with pytest.raises(RuntimeError, match="0 outputs for a batch of 1 rows"):
            await b.submit([2])
        assert (await b.submit([3])).outputs == [3]
    finally:
        b.stop()


async def test_a_huge_request_does_not_starve_a_small_one() -> None:
    """The small request waits for one turn of the big one (2 rows), not for a whole
    budget of its rows (10): the big one's turn is bounded even while it runs alone."""
    gate = threading.Event()
    run = Recorder(gate)
    # 4 a row; a batch 40; a turn 10 (2 rows)
    b = batcher(run, max_batch_cost=40, max_queue=8, max_share=0.25)
    finished: list[str] = []
    try:
        big = asyncio.ensure_future(b.submit(list(range(200))))
        big.add_done_callback(lambda _: finished.append("big"))
        assert await asyncio.to_thread(run.started.wait, 5)  # the big one's first batch runs
        small = asyncio.ensure_future(b.submit([999]))
        small.add_done_callback(lambda _: finished.append("small"))
        while b.depth < 2:
            await asyncio.sleep(0.001)
        gate.set()
        assert (await small).outputs == [999]
        result = await big
        await asyncio.sleep(0)  # let the done callbacks run
    finally:
        gate.set()
        b.stop()
    assert run.batches[0] == [0, 1]  # alone, the big one still ran one turn, not 10 rows
    assert run.batches[1] == [2, 3, 999]  # the small one: the next batch, not 200 rows later
    assert result.outputs == list(range(200))  # its own rows, in order
    assert finished == ["small", "big"] and max(map(len, run.batches)) <= 3


async def test_share_one_puts_a_whole_request_in_one_batch_when_it_fits() -> None:
    run = Recorder()
    b = batcher(run, cost=1, max_batch_cost=5, max_share=1.0)
    try:
        results = await asyncio.gather(*(b.submit(qs) for qs in ([1, 2, 3], [4] * 7, [5])))
    finally:
        b.stop()
    assert [r.outputs for r in results] == [[1, 2, 3], [4] * 7, [5]]
    assert max(map(len, run.batches)) <= 5 and [1, 2, 3] in [b[:3] for b in run.batches]


async def test_a_request_spanning_two_versions_is_rerun_on_one() -> None:
    versions = iter(["v1", "v2", "v2", "v2", "v2", "v2", "v2"])

    def run(rows: Sequence[int]) -> tuple[list[int], str]:
        return list(rows), next(versions)

    b = batcher(run, max_batch_cost=8, max_queue=4)
    try:
        result = await b.submit([0, 1, 2, 3])  # two rows a batch: v1, v2 -> rerun
    finally:
        b.stop()
    assert (result.outputs, result.version) == ([0, 1, 2, 3], "v2")


async def test_the_rest_of_a_cancelled_request_is_dropped() -> None:
    gate = threading.Event()
    run = Recorder(gate)
    b = batcher(run, max_batch_cost=8, max_queue=4)
    try:
        gone = asyncio.ensure_future(b.submit(list(range(50))))
        assert await asyncio.to_thread(run.started.wait, 5)
        gone.cancel()  # the client went away
        await asyncio.sleep(0)
        gate.set()
        assert (await b.submit([3])).outputs == [3]
    finally:
        gate.set()
        b.stop()
    assert sum(map(len, run.batches)) <= 2 + 2 + 1  # its running batch, maybe one more, the next


async def test_the_loop_stays_responsive_and_wait_gathers_a_fuller_batch() -> None:
    run = Recorder(delay_s=0.3)
    b = batcher(run)
    pending = asyncio.ensure_future(b.submit([1]))
    started = time.perf_counter()
    await asyncio.sleep(0.01)
    assert time.perf_counter() - started < 0.2
    assert (await pending).outputs == [1]
    b.stop()

    run = Recorder()
    b = batcher(run, max_wait_s=0.1)

    async def later(i: int) -> None:
        await asyncio.sleep(0.01 * i)
        await b.submit([i])

    await asyncio.gather(*(later(i) for i in range(5)))
    b.stop()
    assert run.batches == [[0, 1, 2, 3, 4]]


async def test_stop_drains_what_is_queued() -> None:
    run = Recorder(delay_s=0.05)
    b = batcher(run, max_batch_cost=4)
    tasks = [asyncio.ensure_future(b.submit([i])) for i in range(4)]
    await asyncio.sleep(0)
    await asyncio.to_thread(b.stop)
    assert [(await t).outputs for t in tasks] == [[i] for i in range(4)]


async def test_several_threads_run_batches_at_once() -> None:
    run = Recorder(delay_s=0.2)
    b = batcher(run, max_batch_cost=4, threads=2)
    started = time.perf_counter()
    await asyncio.gather(b.submit([1]), b.submit([2]))
    assert time.perf_counter() - started < 0.35 and len(run.threads) == 2
    b.stop()
