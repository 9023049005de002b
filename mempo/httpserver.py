"""uvicorn's h11 protocol guarded against connections that hold a server's sockets.

uvicorn closes an idle keep-alive connection after a response, but never one that has
sent nothing yet, nor a request that stops halfway (headers without their blank line, or a
body shorter than its Content-Length), and it accepts connections until the process runs
out of file descriptors. ``guarded_protocol`` gives uvicorn a protocol that

- closes a connection that has sent no byte ``idle_timeout_s`` after it was accepted;
- closes a connection whose request began ``read_timeout_s`` ago and has still not fully
  arrived (the handler, if one runs, sees a disconnect); a request fully read is never
  cut, however long its answer takes; between requests, keep-alive is uvicorn's;
- answers a connection beyond ``max_connections`` open ones at once with a 503 and
  closes it.

Each of these logs at most one line per ``LOG_INTERVAL_S`` with the count of those not
logged, and ``install_accept_error_filter`` does the same for asyncio's
"socket.accept() out of system resource", which it otherwise logs, with a traceback, for
every accept that fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import threading
import time
from collections.abc import Callable
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

LOG_INTERVAL_S = 10.0
ACCEPT_ERROR = "socket.accept() out of system resource"
# Descriptors kept for the process's own files, pipes and clients when max_connections is
# fitted under the open-files limit.
FD_RESERVE = 256


class RateLimit:
    """Lets one event through per ``interval_s`` and counts the ones held back."""

    def __init__(
        self, interval_s: float = LOG_INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._last: float | None = None
        self._held = 0
        self._lock = threading.Lock()  # a logger may be called from several threads

    def admit(self) -> int | None:
        """None: hold this one back. Otherwise let it through: the number held back since
        the last one let through."""
        with self._lock:
            now = self._clock()
            if self._last is not None and now - self._last < self.interval_s:
                self._held += 1
                return None
            self._last = now
            held, self._held = self._held, 0
            return held


def _more(held: int) -> str:
    return f" ({held} more like it not logged since the last)" if held else ""


class AcceptErrorFilter(logging.Filter):
    """On the ``asyncio`` logger: at most one "socket.accept() out of system resource" per
    ``interval_s``; the one let through says how many were not logged before it."""

    def __init__(
        self, interval_s: float = LOG_INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self.rate = RateLimit(interval_s, clock)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.msg if isinstance(record.msg, str) else ""
        if not message.startswith(ACCEPT_ERROR):
            return True
        held = self.rate.admit()
        if held is None:
            return False
        rest = message[len(ACCEPT_ERROR) :]
        hint = " (out of file descriptors: see the open-files limit and max_connections)"
        record.msg = ACCEPT_ERROR + hint + _more(held).replace("%", "%%") + rest
        return True


def install_accept_error_filter(interval_s: float = LOG_INTERVAL_S) -> AcceptErrorFilter:
    """Add the filter to the ``asyncio`` logger, once per process."""
    logger = logging.getLogger("asyncio")
    for existing in logger.filters:
        if isinstance(existing, AcceptErrorFilter):
            return existing
    added = AcceptErrorFilter(interval_s)
    logger.addFilter(added)
    return added


def fit_connection_limit(max_connections: int) -> int:
    """Raise the process's soft open-files limit to its hard one; ``max_connections``, or
    less where that limit leaves too few descriptors for it (with a warning)."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or soft < hard:
            target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
            # Above the kernel's nr_open: keep the soft limit.
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ValueError, OSError):
        return max_connections
    if soft == resource.RLIM_INFINITY or max_connections <= soft - FD_RESERVE:
        return max_connections
    fitted = max(1, soft - FD_RESERVE)
    log.warning(
        "max_connections %d lowered to %d: the open-files limit is %d (raise it, ulimit -n)",
        max_connections, fitted, soft,
    )  # fmt: skip
    return fitted


class GuardedH11(H11Protocol):
    read_timeout_s: float = 30.0
    idle_timeout_s: float = 10.0
    max_connections: int = 2048
    # One set per generated class, so per server.
    refused_log = RateLimit()
    idle_log = RateLimit()
    read_log = RateLimit()

    _read_deadline: asyncio.TimerHandle | None = None
    _idle_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # counts it in server_state.connections
        if len(self.connections) > self.max_connections:
            self._refuse()
            return
        self._idle_deadline = self.loop.call_later(self.idle_timeout_s, self._idle_timed_out)

    def data_received(self, data: bytes) -> None:
        self._cancel_idle_deadline()
        super().data_received(data)
        if self._reading():
            if self._read_deadline is None:
                self._read_deadline = self.loop.call_later(
                    self.read_timeout_s, self._read_timed_out
                )
        else:
            self._cancel_read_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_idle_deadline()
        self._cancel_read_deadline()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self._reading():  # a pipelined request read whole meanwhile
            self._cancel_read_deadline()

    def _reading(self) -> bool:
        """A request has begun to arrive and has not all arrived."""
        state = self.conn.their_state
        return state is h11.SEND_BODY or (state is h11.IDLE and bool(self.conn.trailing_data[0]))

    def _cancel_read_deadline(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _cancel_idle_deadline(self) -> None:
        if self._idle_deadline is not None:
            self._idle_deadline.cancel()
            self._idle_deadline = None

    def _refuse(self) -> None:
        body = (
            f"503: this server has {self.max_connections} connections open, its limit "
            "(max_connections); try again later\n"
        ).encode()
        head = (
            "HTTP/1.1 503 Service Unavailable\r\n"
            "content-type: text/plain; charset=utf-8\r\n"
            f"content-length: {len(body)}\r\n"
            "retry-after: 1\r\n"
            "connection: close\r\n\r\n"
        ).encode()
        self.transport.write(head + body)
        self.transport.close()
        held = self.refused_log.admit()
        if held is not None:
            log.warning(
                "refused a connection with 503: %d connections open, the limit "
                "(max_connections)%s", self.max_connections, _more(held),
            )  # fmt: skip

    def _idle_timed_out(self) -> None:
        self._idle_deadline = None
        if self.transport.is_closing():
            return
        held = self.idle_log.admit()
        if held is not None:
            log.warning(
                "closed the connection of %s: it sent nothing %.0fs after it was accepted "
                "(idle_connection_timeout_s)%s", self._client(), self.idle_timeout_s, _more(held),
            )  # fmt: skip
        self.transport.close()

    def _read_timed_out(self) -> None:
        self._read_deadline = None
        if not self._reading() or self.transport.is_closing():
            return
        held = self.read_log.admit()
        if held is not None:
            log.warning(
                "closed the connection of %s: its request was not fully sent %.0fs after it "
                "began (request_read_timeout_s)%s", self._client(), self.read_timeout_s, _more(held),
            )  # fmt: skip
        self.transport.close()

    def _client(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "a client"


def guarded_protocol(
    read_timeout_s: float, idle_timeout_s: float, max_connections: int
) -> type[GuardedH11]:
    """The protocol class to give uvicorn as ``http=``: one per server (it holds the
    server's log rate limits)."""
    fields: dict[str, Any] = {
        "read_timeout_s": read_timeout_s,
        "idle_timeout_s": idle_timeout_s,
        "max_connections": max_connections,
        "refused_log": RateLimit(),
        "idle_log": RateLimit(),
        "read_log": RateLimit(),
    }
    return type("GuardedH11", (GuardedH11,), fields)
