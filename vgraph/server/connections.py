"""Connection limits: slow, stalled or excess clients must not exhaust descriptors or the log.

Every open connection holds a file descriptor, and uvicorn with h11 bounds none of the ways a
client can keep one: it has no deadline for a request's headers (its keep-alive timer runs
only between requests, and one byte of the next request cancels it), none for the body, none
for a client that stops reading a response, and its ``limit_concurrency`` counts connections
that have not sent a request yet, so a slowloris holding the cap would turn every real request
into a 503. ``GuardedH11Protocol`` (passed to ``uvicorn.Config(http=...)``) adds:

- Read deadlines. A request's headers must arrive within ``header_timeout`` seconds of the
  connection opening (or of the previous response ending); its body within ``body_timeout``
  seconds plus one second per ``BODY_MIN_RATE`` bytes received, so a large upload at a fair
  rate passes and a trickle is cut. A request cut half-way gets a 408.
- A stall deadline. When the transport's write buffer has been over its high-water mark for
  ``stall_timeout`` seconds (the client stopped reading), the connection is reset: the app
  sees a disconnect and aborts the engine request. Nothing else queues for such a client:
  uvicorn's ``send`` waits while the buffer is full, so the stream's generator waits too, and
  the engine keeps only each request's latest output, so memory per stalled stream is bounded
  by the kernel's and the transport's buffers. The kernel's send buffer is fixed at
  ``SEND_BUFFER_BYTES``: left to autotuning it grows to ``tcp_wmem``'s maximum (4 MiB by
  default) for a client that does not read, which is both kernel memory per connection and
  thousands of tokens a stalled stream generates before anything notices.
- A connection cap below the descriptor limit. A connection over the cap closes the one that
  has waited longest for request headers (an idle keep-alive or a slowloris); when every open
  connection is busy with a request, the newcomer gets a 503 and is closed.
- Malformed HTTP answered in the OpenAI error shape instead of uvicorn's plain-text 400.

``LogRateLimit`` keeps errors that repeat per connection or per accept attempt from flooding
the log: when descriptors run out, CPython's accept loop logs EMFILE once per backlog slot per
event-loop tick (thousands of tracebacks a second).
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import re
import resource
import socket
import struct
import time
from dataclasses import dataclass
from http import HTTPStatus
from typing import Callable, Optional

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import APIError
from .header_limit import MAX_HEADER_BYTES

logger = logging.getLogger("vgraph.server")

BODY_MIN_RATE = 64 * 1024  # bytes per second a request body may arrive at, beyond body_timeout
DESCRIPTOR_RESERVE = 64  # descriptors kept for everything but connections (model files, logs, pipes)
DESCRIPTOR_TARGET = 65536  # the soft limit is raised towards this (as vLLM does), within the hard one
# Per-connection kernel send buffer (Linux doubles it): token streams need a few KB/s, and even
# a multi-megabyte JSON response at 100 ms RTT still moves at several MB/s.
SEND_BUFFER_BYTES = 256 * 1024
_HEADERS, _BODY = "headers", "body"  # what a connection is waiting to read


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout: float
    body_timeout: float
    stall_timeout: float
    max_connections: int
    backlog: int  # also how many connections one event-loop tick may accept


def raise_descriptor_limit(target: int = DESCRIPTOR_TARGET) -> int:
    """Raises the soft descriptor limit towards ``target`` (never past the hard one); returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(hard, target)
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
    return soft


def plan_connections(descriptor_limit: int, requested: Optional[int]) -> tuple[int, int]:
    """``(max_connections, backlog)`` that cannot run the process out of descriptors.

    asyncio's accept loop takes up to ``backlog`` connections per event-loop tick, a new
    connection reaches ``connection_made`` (where the cap is enforced) two ticks after its
    accept, and the connection it evicts closes a tick after that: against clients that
    reconnect as fast as they are closed, up to three backlogs of descriptors are in flight
    beyond the cap (measured: at 1,024 descriptors and twice the backlog reserved, 1,100
    slowloris sockets still hit EMFILE). The cap leaves four backlogs free besides the reserve.
    """
    backlog = min(2048, max(16, descriptor_limit // 16))
    fits = max(8, descriptor_limit - DESCRIPTOR_RESERVE - 4 * backlog)
    return (fits if requested is None else max(1, min(requested, fits))), backlog


class ConnectionGuard:
    """What the connections of one server share: the limits, and who waits for a request.

    ``_waiting`` is ordered by when each connection began waiting for request headers, so the
    first entry is the one to evict when a new connection needs its place.
    """

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self._waiting: collections.OrderedDict[GuardedH11Protocol, None] = collections.OrderedDict()

    def set_waiting(self, conn: "GuardedH11Protocol", waiting: bool) -> None:
        self._waiting.pop(conn, None)
        if waiting:
            self._waiting[conn] = None

    def admit(self, conn: "GuardedH11Protocol") -> bool:
        """Makes room for ``conn`` under the cap by evicting waiters; False if none is left."""
        while len(conn.connections) > self.limits.max_connections:
            victim = next(iter(self._waiting), None)
            if victim is None:
                return False
            logger.warning("%d connections open (the cap): closed the one waiting longest for its "
                           "request headers", self.limits.max_connections)
            victim.drop()
        return True


def protocol_class(guard: ConnectionGuard) -> type["GuardedH11Protocol"]:
    """A ``GuardedH11Protocol`` bound to ``guard``, for ``uvicorn.Config(http=...)``."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"guard": guard})


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with read and stall deadlines and the connection cap (see above)."""

    guard: ConnectionGuard

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._phase: Optional[str] = None
        self._phase_start = 0.0
        self._body_bytes = 0
        self._read_timer: Optional[asyncio.TimerHandle] = None
        self._stall_timer: Optional[asyncio.TimerHandle] = None
        if not self.guard.admit(self):
            self._refuse()
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        self._track_reads(0)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._track_reads(len(data))

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._track_reads(0)  # a keep-alive connection now waits for its next request

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._cancel(self._read_timer)
        self._cancel(self._stall_timer)
        self._read_timer = self._stall_timer = None
        self.guard.set_waiting(self, False)
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall_timer is None:
            self._stall_timer = self.loop.call_later(self.guard.limits.stall_timeout, self._on_stall)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel(self._stall_timer)
        self._stall_timer = None

    def send_400_response(self, msg: str) -> None:
        """Malformed HTTP (or headers over the limit): a 400 in the OpenAI shape, then close."""
        if len(self.conn.trailing_data[0]) > MAX_HEADER_BYTES:
            error = APIError(400, f"request headers exceed the {MAX_HEADER_BYTES // 1024} KiB limit",
                             code="headers_too_large")
        else:
            error = APIError(400, "malformed HTTP request: the request line or headers could not be parsed",
                             code="invalid_http_request")
        self._respond_and_close(error)

    def drop(self) -> None:
        """Resets the connection at once (no lingering send buffer) and stops counting it."""
        self.connections.discard(self)
        self.guard.set_waiting(self, False)
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()

    # ------------------------------------------------------------------ read deadlines

    def _track_reads(self, received: int) -> None:
        """Follows what the connection waits to read; a new phase gets a new deadline."""
        if self.transport.is_closing():
            return
        phase = _read_phase(self.conn)
        if phase == self._phase:
            if phase == _BODY:
                self._body_bytes += received
            return
        self._phase, self._phase_start, self._body_bytes = phase, self.loop.time(), 0
        self.guard.set_waiting(self, phase == _HEADERS)
        self._cancel(self._read_timer)
        deadline = self._read_deadline()
        self._read_timer = None if deadline is None else self.loop.call_at(deadline, self._on_read_deadline)

    def _read_deadline(self) -> Optional[float]:
        limits = self.guard.limits
        if self._phase == _HEADERS:
            return self._phase_start + limits.header_timeout
        if self._phase == _BODY:
            return self._phase_start + limits.body_timeout + self._body_bytes / BODY_MIN_RATE
        return None

    def _on_read_deadline(self) -> None:
        self._read_timer = None
        deadline = self._read_deadline()
        if deadline is None or self.transport.is_closing():
            return
        now = self.loop.time()
        if deadline > now or self.flow.read_paused:  # more bytes came, or the app is not reading
            self._read_timer = self.loop.call_at(max(deadline, now + 1.0), self._on_read_deadline)
            return
        self._cut_slow_request()

    def _cut_slow_request(self) -> None:
        """Closes a connection whose request is overdue; a half-sent request gets a 408."""
        limits = self.guard.limits
        if self._phase == _HEADERS:
            logger.info("closed a connection that sent no complete request headers within %g s",
                        limits.header_timeout)
            partial = bool(self.conn.trailing_data[0])
        else:
            logger.info("closed a connection whose request body did not arrive within %g s (+1 s per "
                        "%d KiB)", limits.body_timeout, BODY_MIN_RATE // 1024)
            partial = not self.cycle.response_started
        if not partial:
            self.transport.close()
            return
        what = "headers" if self._phase == _HEADERS else "body"
        self._respond_and_close(APIError(408, f"the request {what} did not arrive in time", code="request_timeout"))

    # ------------------------------------------------------------------ other ends

    def _on_stall(self) -> None:
        self._stall_timer = None
        logger.warning("a client read nothing for %g s while its response waited; dropped the connection",
                       self.guard.limits.stall_timeout)
        self.drop()

    def _refuse(self) -> None:
        logger.warning("%d connections open (the cap), each busy with a request: refused a new one with 503",
                       self.guard.limits.max_connections)
        self._respond_and_close(APIError(503, "the server has too many open connections",
                                         code="too_many_connections", headers={"Retry-After": "1"}))

    def _respond_and_close(self, error: APIError) -> None:
        """Writes ``error`` as a complete response outside h11 (the connection ends here)."""
        self.transport.write(raw_response(error))
        self.transport.close()

    @staticmethod
    def _cancel(timer: Optional[asyncio.TimerHandle]) -> None:
        if timer is not None:
            timer.cancel()


def _read_phase(conn: h11.Connection) -> Optional[str]:
    """What the client still owes: request headers, a body, or nothing for now."""
    if conn.their_state is h11.IDLE:
        return _HEADERS
    if conn.their_state is h11.SEND_BODY:
        return _BODY
    return None


def raw_response(error: APIError) -> bytes:
    """An HTTP/1.1 response carrying ``error``'s JSON body, ending the connection."""
    body = json.dumps(error.body()).encode()
    lines = [f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}", "content-type: application/json",
             f"content-length: {len(body)}", "connection: close",
             *(f"{name}: {value}" for name, value in error.headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class LogRateLimit(logging.Filter):
    """Lets through ``burst`` records of each kind per ``window`` seconds and counts the rest.

    A record's kind is its logger plus the first line of its message template with numbers
    and addresses blanked, so asyncio's "Exception in callback ...(when=689.47)" and the same
    at 689.48 are one kind. The first record let through after a suppression says how many
    of its kind were dropped.
    """

    _VARIABLE = re.compile(r"0x[0-9a-fA-F]+|\d+(?:\.\d+)?")
    _MAX_KINDS = 1024

    def __init__(self, burst: int = 5, window: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.burst, self.window, self._clock = burst, window, clock
        self._kinds: dict[tuple[str, str], list] = {}  # kind -> [window start, passed, dropped]

    def filter(self, record: logging.LogRecord) -> bool:
        first_line = str(record.msg).split("\n", 1)[0]
        key = (record.name, self._VARIABLE.sub("#", first_line)[:160])
        now = self._clock()
        entry = self._kinds.get(key)
        if entry is None:
            if len(self._kinds) >= self._MAX_KINDS:
                self._kinds.clear()
            entry = self._kinds[key] = [now, 0, 0]
        if now - entry[0] >= self.window:
            entry[0], entry[1] = now, 0
        if entry[1] >= self.burst:
            entry[2] += 1
            return False
        entry[1] += 1
        if entry[2]:
            record.msg = f"{record.msg} [{entry[2]} more like this in the last {self.window:g} s were not logged]"
            entry[2] = 0
        return True
