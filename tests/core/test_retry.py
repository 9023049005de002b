"""Retries: transient failures (connect errors, 5xx, 429) only, bounded, with backoff."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from mempo.retry import Backoff, RetryableStatus, cancel_and_wait, request


def test_backoff_is_capped() -> None:
    b = Backoff(base=0.1, cap=1.0)
    delays = [b.next_delay() for _ in range(10)]
    assert all(0 < d <= 1.0 for d in delays) and delays[-1] >= 0.8
    b.reset()
    assert b.next_delay() <= 0.1


def transport(codes: list[int]) -> tuple[httpx.MockTransport, list[int]]:
    calls: list[int] = []

    def handler(req: httpx.Request) -> httpx.Response:
        calls.append(1)
        code = codes[min(len(calls) - 1, len(codes) - 1)]
        if code == 0:
            raise httpx.ConnectError("refused", request=req)
        return httpx.Response(code, json={"n": len(calls)})

    return httpx.MockTransport(handler), calls


@pytest.mark.parametrize(("codes", "calls", "final"), [([503, 429, 0, 200], 4, 200), ([404], 1, 404), ([422, 200], 1, 422)])
async def test_request_retries_transient_only(codes: list[int], calls: int, final: int) -> None:
    t, seen = transport(codes)
    async with httpx.AsyncClient(transport=t) as client:
        r = await request(client, "GET", "http://x/", attempts=4, backoff=Backoff(base=0.001, cap=0.002))
    assert r.status_code == final and len(seen) == calls


async def test_request_gives_up() -> None:
    t, seen = transport([500])
    async with httpx.AsyncClient(transport=t) as client:
        with pytest.raises(RetryableStatus):
            await request(client, "GET", "http://x/", attempts=3, backoff=Backoff(base=0.001, cap=0.002))
    assert len(seen) == 3


async def test_cancel_and_wait_ends_a_task_that_lost_a_cancellation() -> None:
    lost = 0

    async def loses_one() -> None:  # as asyncio.wait_for on Python 3.11 can (CPython gh-86296)
        nonlocal lost
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                if lost:
                    raise
                lost += 1

    task = asyncio.create_task(loses_one())
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.wait([task], timeout=0.1)
    assert not task.done() and lost == 1  # one cancel was not enough
    await asyncio.wait_for(cancel_and_wait([task], every_s=0.05), 5)
    assert task.cancelled()
