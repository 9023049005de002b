"""The dynamic batcher: batching by time and tokens, routing results, 503 when full."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import pytest

from mempo.service import NotReady, Overloaded
from services.scorer.batcher import Batcher
from services.scorer.plan import LogProbTable, Row


def _rows(tag: int, n: int = 1, tokens: int = 4) -> list[Row]:
    rows = []
    for _ in range(n):
        row = Row(trunk=[tag] * (tokens - 2))
        root = row.add([tag], len(row.trunk))
        row.add([tag], len(row.trunk), parent=root, scored=True)
        rows.append(row)
    return rows


class Recorder:
    """A run_rows that echoes each row's tag and records the batch sizes it saw."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.batches: list[int] = []
        self.tags: list[list[int]] = []  # each batch's rows' tags
        self.gate = gate
        self.started = threading.Event()

    def __call__(self, rows: Sequence[Row]) -> tuple[LogProbTable, str]:
        self.started.set()
        if self.gate is not None:
            self.gate.wait(10)
        self.batches.append(len(rows))
        self.tags.append([r.trunk[0] for r in rows])
        return {(i, 1): [float(r.trunk[0])] for i, r in enumerate(rows)}, "v7"


async def test_concurrent_jobs_batch_and_get_their_own_rows() -> None:
    run = Recorder()
    batcher = Batcher(run, max_batch_tokens=10_000, max_wait_s=0.2, max_queue=16)
    batcher.start()
    try:
        results = await asyncio.gather(*(batcher.submit(_rows(t, n=t)) for t in range(1, 6)))
    finally:
        batcher.stop()
    for t, result in enumerate(results, start=1):
        assert result.weight_version == "v7"
        assert result.logprobs == {(i, 1): [float(t)] for i in range(t)}
    assert len(run.batches) < 5 and sum(run.batches) == 15


async def test_token_budget_splits_batches() -> None:
    run = Recorder()
    batcher = Batcher(run, max_batch_tokens=8, max_wait_s=0.2, max_queue=16)
    batcher.start()
    try:
        await asyncio.gather(*(batcher.submit(_rows(t)) for t in range(1, 7)))
    finally:
        batcher.stop()
    assert run.batches and max(run.batches) <= 2  # 4 tokens a job, 8 a batch


async def test_full_queue_is_overloaded_with_retry_after() -> None:
    gate = threading.Event()
    run = Recorder(gate)
    batcher = Batcher(run, max_batch_tokens=4, max_wait_s=0.0, max_queue=2)
    batcher.start()
    try:
        first = asyncio.ensure_future(batcher.submit(_rows(1)))
        assert await asyncio.to_thread(run.started.wait, 5)  # the worker holds the first job
        queued = [asyncio.ensure_future(batcher.submit(_rows(t))) for t in (2, 3)]
        while batcher.depth < 2:
            await asyncio.sleep(0.01)
        with pytest.raises(Overloaded) as info:
            await batcher.submit(_rows(4))
        assert info.value.status_code == 503 and "Retry-After" in (info.value.headers or {})
        gate.set()
        await asyncio.gather(first, *queued)
    finally:
        gate.set()
        batcher.stop()
    with pytest.raises(NotReady):
        await batcher.submit(_rows(5))


async def test_a_failing_batch_fails_its_requests_only() -> None:
    calls = 0

    def flaky(rows: Sequence[Row]) -> tuple[LogProbTable, str]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("boom")
        return {(i, 1): [0.0] for i in range(len(rows))}, "0"

    batcher = Batcher(flaky, max_batch_tokens=100, max_wait_s=0.0, max_queue=4)
    batcher.start()
    try:
        with pytest.raises(RuntimeError, match="boom"):
            await batcher.submit(_rows(1))
        assert (await batcher.submit(_rows(2))).logprobs == {(0, 1): [0.0]}
    finally:
        batcher.stop()


def _tagged(n: int, tokens: int = 4) -> list[Row]:
    """n rows; row i echoes i (Recorder returns each row's first trunk token)."""
    return [_rows(i, tokens=tokens)[0] for i in range(n)]


async def test_a_huge_request_does_not_starve_a_small_one() -> None:
    """The small request waits for one turn of the big one (2 rows), not for a whole
    budget of its rows (10): the big one's turn is bounded even while it runs alone."""
    gate = threading.Event()
    run = Recorder(gate)
    # 4 tokens a row; a batch 40; a turn takes 10 (2 rows)
    batcher = Batcher(run, max_batch_tokens=40, max_wait_s=0.0, max_queue=8, max_share=0.25)
    batcher.start()
    finished: list[str] = []
    try:
        big = asyncio.ensure_future(batcher.submit(_tagged(200)))
        big.add_done_callback(lambda _: finished.append("big"))
        assert await asyncio.to_thread(run.started.wait, 5)  # the big one's first batch runs
        small = asyncio.ensure_future(batcher.submit(_rows(999)))
        small.add_done_callback(lambda _: finished.append("small"))
        while batcher.depth < 2:
            await asyncio.sleep(0.001)
        gate.set()
        assert (await small).logprobs == {(0, 1): [999.0]}
        result = await big
        await asyncio.sleep(0)  # let the done callbacks run
        turn = next(i for i, tags in enumerate(run.tags) if 999 in tags)
        assert run.tags[0] == [0, 1]  # alone, the big one still ran one turn, not 10 rows
        assert turn == 1 and run.tags[1] == [2, 3, 999]  # the next batch, not 200 rows later
    finally:
        gate.set()
        batcher.stop()
    assert result.logprobs == {(i, 1): [float(i)] for i in range(200)}  # its own rows, in order
    assert finished == ["small", "big"] and max(run.batches) <= 3  # one turn of each job


async def test_a_request_spanning_two_weight_versions_is_rerun_on_one() -> None:
    versions = iter(["v1", "v2", "v2", "v2", "v2", "v2", "v2"])

    def run(rows: Sequence[Row]) -> tuple[LogProbTable, str]:
        return {(i, 1): [float(r.trunk[0])] for i, r in enumerate(rows)}, next(versions)

    batcher = Batcher(run, max_batch_tokens=8, max_wait_s=0.0, max_queue=4)
    batcher.start()
    try:
        result = await batcher.submit(_tagged(4))  # two rows a batch: v1, v2 -> rerun
    finally:
        batcher.stop()
    assert result.weight_version == "v2"
    assert result.logprobs == {(i, 1): [float(i)] for i in range(4)}


async def test_the_rest_of_a_cancelled_request_is_dropped() -> None:
    gate = threading.Event()
    run = Recorder(gate)
    batcher = Batcher(run, max_batch_tokens=8, max_wait_s=0.0, max_queue=4)
    batcher.start()
    try:
        gone = asyncio.ensure_future(batcher.submit(_tagged(50)))
        assert await asyncio.to_thread(run.started.wait, 5)
        gone.cancel()  # the client went away
        await asyncio.sleep(0)
        gate.set()
        assert (await batcher.submit(_rows(3))).logprobs == {(0, 1): [3.0]}
    finally:
        gate.set()
        batcher.stop()
    assert sum(run.batches) <= 2 + 2 + 1  # its running batch, maybe one more, the next job
