"""Retries: transient failures (connect errors, 5xx, 429) only, bounded, with backoff."""

from __future__ import annotations

import httpx
import pytest

from mempo.retry import Backoff, RetryableStatus, request


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
