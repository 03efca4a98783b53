"""The gateway's HTTP/1.1 protocol: uvicorn's (httptools) with the limits an untrusted client needs.

The agent behind a session is the policy under training, and nothing it sends is trusted. uvicorn
bounds a request's body only as the app reads it (:meth:`Gateway._body` caps that); with httptools
it bounds neither the size of a request's head nor the time a client takes to send a request, and
it keeps every connection it accepts. One client could then hold the driver's memory with headers
that never end, or its file descriptors with connections that send nothing, and every other
session's agent would wait. :class:`GuardedHttp` adds, per connection:

* the head (request line and headers) is at most ``head_bytes``: a larger one is answered 431 and
  the connection closed, before more of it is kept. Complete header lines are counted as the parser
  hands them over, and so is every read that arrives while the head is still incomplete, since
  httptools keeps a header line that has not ended to itself;
* a request arrives whole (head and body) within ``request_s`` of its first byte, and a new
  connection starts one within ``request_s``: else it is closed (408 when nothing of it is being
  answered). Any byte that arrives outside a request starts that time too (blank lines between
  requests begin none, and would otherwise hold a connection for ever, uvicorn's keep-alive timer
  stopped). The time a turn takes to generate is not counted, nor a kept-alive idle connection's
  (uvicorn's keep-alive timeout closes those);
* at most ``max_connections`` are open: one more is answered 503 and closed as soon as it is
  accepted, without reading it, so no flood of connections holds descriptors for long.

Refusals are JSON in OpenAI's error shape, as every other error of the gateway before routing.
"""

from __future__ import annotations

import asyncio
import json
import resource
from http import HTTPStatus
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from loongsage.agentflow.chat.errors import APIError

HEAD_BYTES = 32 << 10  # a request's line and headers; h11's own default is 16 KiB, nginx's 32 KiB
REQUEST_S = 60.0  # to send one whole request: an agent on this machine sends it in milliseconds
_DESCRIPTORS_PER_CONNECTION = 4  # a jailed agent's connection: the relay's two sockets and the gateway's, and slack
_MAX_CONNECTIONS = 16384


def default_max_connections() -> int:
    """Connections the gateway keeps open at most: a share of this process's descriptor limit
    (a connection through an agent's jail costs three), at least 64 and at most 16,384."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return _MAX_CONNECTIONS
    return max(64, min(_MAX_CONNECTIONS, soft // _DESCRIPTORS_PER_CONNECTION))


class _HeadTooLarge(Exception):
    """Raised from a parser callback: httptools stops parsing and uvicorn answers the error."""


class GuardedHttp(HttpToolsProtocol):
    """See the module docstring; :func:`guarded` sets the limits of one gateway."""

    head_bytes = HEAD_BYTES
    request_s = REQUEST_S
    max_connections = _MAX_CONNECTIONS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head = 0  # bytes of the current request's head in the lines the parser handed over
        self._unparsed = 0  # bytes of the reads that all went into the head (a line not yet ended)
        self._in_head = False  # a request began and its headers are not complete
        self._deadline: asyncio.TimerHandle | None = None
        self._refusal: APIError | None = None

    # ----------------------------------------------------------------------- the connection
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self._answer(APIError(503, f"the gateway holds {self.max_connections} connections, its limit; retry"))
            return
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return  # refused: nothing more of it is read
        self._arm()  # no-op inside a request; outside one, these bytes start the next
        within_head = self._in_head
        super().data_received(data)
        if within_head and self._in_head and not self.transport.is_closing():
            # all of it went into a head still incomplete (a header line that does not end, say)
            self._unparsed += len(data)
            if self._unparsed > self.head_bytes:
                self._answer(self._head_too_large())

    # ----------------------------------------------------------------------- parser callbacks
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head, self._unparsed, self._in_head = 0, 0, True
        self._arm()

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)  # with ": " and the line's end
        super().on_header(name, value)

    def on_message_complete(self) -> None:
        self._disarm()  # the request is in: what follows is the turn's time
        super().on_message_complete()

    def send_400_response(self, msg: str) -> None:
        # uvicorn's answer to a parser error, ours among them (a head over the limit)
        if self._refusal is None:
            super().send_400_response(msg)
        else:
            self._answer(self._refusal)

    # ----------------------------------------------------------------------- limits
    def _count(self, size: int) -> None:
        self._head += size
        if self._head > self.head_bytes:
            self._refusal = self._head_too_large()
            raise _HeadTooLarge

    def _head_too_large(self) -> APIError:
        return APIError(431, f"the request's line and headers are over {self.head_bytes} bytes")

    def _arm(self) -> None:
        if self._deadline is None:
            self._deadline = self.loop.call_later(self.request_s, self._too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self.cycle is None or self.cycle.response_complete:
            self._answer(APIError(408, f"no whole request within {self.request_s:g} s"))
        else:  # its head is in and the app waits for its body: the app hears of a disconnect
            self.transport.close()

    def _answer(self, error: APIError) -> None:
        """Write ``error`` as the connection's last response and close it."""
        body = json.dumps(error.openai_body()).encode()
        head = (
            f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        self.transport.write(head.encode() + body)
        self.transport.close()


def guarded(*, max_connections: int, head_bytes: int = HEAD_BYTES, request_s: float = REQUEST_S) -> type:
    """The protocol class of one gateway, with its limits (uvicorn makes one per connection)."""
    if max_connections < 1 or head_bytes < 1 or request_s <= 0:
        raise ValueError(
            f"gateway limits: max_connections={max_connections}, head_bytes={head_bytes}, request_s={request_s}: "
            "each must be positive"
        )
    limits = {"max_connections": max_connections, "head_bytes": head_bytes, "request_s": request_s}
    return type("GuardedHttp", (GuardedHttp,), limits)
