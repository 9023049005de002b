"""What every client of a MemPO service shares: a base URL, an owned or borrowed httpx
client, retries (mempo.retry: connection errors, 5xx and 429, capped backoff) and one
error type per service that carries the HTTP status.

A 4xx is never retried; ``_call`` raises it as the client's error at once. A 5xx or 429
still failing after the last attempt is the same error (never mempo.retry's
``RetryableStatus``); a connection that never succeeds stays httpx's own error.
"""

from __future__ import annotations

from typing import Any, ClassVar, Self

import httpx

from mempo.retry import Backoff, RetryableStatus, request


class RemoteError(Exception):
    """A service refused a call, or answered 5xx / 429 after the last attempt."""

    def __init__(self, message: str, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


class ServiceClient:
    """Base of the typed clients (engine, scorer, retrieval)."""

    error: ClassVar[type[RemoteError]] = RemoteError

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float,
        attempts: int,
        backoff: Backoff,
        client: httpx.AsyncClient | None = None,
        connect_timeout_s: float = 5.0,
        **http_options: Any,
    ) -> None:
        """``client``: a shared httpx client (not closed by ``aclose``); else one of its own
        with ``timeout_s`` and ``http_options`` (headers, limits)."""
        self.base_url = base_url.rstrip("/")
        self.attempts = attempts
        self.backoff = backoff
        self._own_client = client is None
        self.http = client or httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s), **http_options
        )

    async def aclose(self) -> None:
        if self._own_client:
            await self.http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _error(self, path: str, response: httpx.Response) -> RemoteError:
        """The client's error for a failed response (subclasses read their bodies)."""
        return self.error(
            f"{path}: HTTP {response.status_code}: {response.text[:300]}", response.status_code
        )

    async def _send(
        self, method: str, path: str, attempts: int | None = None, **kwargs: Any
    ) -> httpx.Response:
        """One call with retries; the response as is, a 4xx included."""
        try:
            return await request(
                self.http,
                method,
                f"{self.base_url}{path}",
                attempts=attempts or self.attempts,
                backoff=self.backoff,
                **kwargs,
            )
        except RetryableStatus as exc:
            raise self._error(path, exc.response) from exc

    async def _call(
        self, method: str, path: str, attempts: int | None = None, **kwargs: Any
    ) -> httpx.Response:
        """``_send``, and any answer of 400 or more raised as the client's error."""
        response = await self._send(method, path, attempts, **kwargs)
        if response.status_code >= 400:
            raise self._error(path, response)
        return response
