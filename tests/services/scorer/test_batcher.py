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
        self.gate = gate
        self.started = threading.Event()

    def __call__(self, rows: Sequence[Row]) -> tuple[LogProbTable, str]:
        self.started.set()
        if self.gate is not None:
            self.gate.wait(10)
        self.batches.append(len(rows))
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
