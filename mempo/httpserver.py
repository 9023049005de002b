"""uvicorn's h11 protocol with a read timeout on half-sent requests.

uvicorn times out idle keep-alive connections but never a request that stops halfway:
headers without their blank line, or a body shorter than its Content-Length, hold a
connection (and, for a body, a running handler) for as long as the client likes. Here a
request whose first byte came ``read_timeout_s`` ago and that has still not fully arrived
has its connection closed (the handler, if one runs, sees a disconnect). A request fully
read is never cut, however long its answer takes.
"""

from __future__ import annotations

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)


class ReadTimeoutH11(H11Protocol):
    read_timeout_s: float = 30.0
    _read_deadline: asyncio.TimerHandle | None = None

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._reading():
            if self._read_deadline is None:
                self._read_deadline = self.loop.call_later(self.read_timeout_s, self._read_timed_out)
        else:
            self._cancel_read_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
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

    def _read_timed_out(self) -> None:
        self._read_deadline = None
        if not self._reading() or self.transport.is_closing():
            return
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        log.warning(
            "closed the connection of %s: its request was not fully sent %.0fs after it began "
            "(request_read_timeout_s)", client, self.read_timeout_s,
        )
        self.transport.close()


def read_timeout_protocol(read_timeout_s: float) -> type[ReadTimeoutH11]:
    """The protocol class to give uvicorn as ``http=``."""
    return type("ReadTimeoutH11", (ReadTimeoutH11,), {"read_timeout_s": read_timeout_s})
