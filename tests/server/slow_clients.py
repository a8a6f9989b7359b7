"""Misbehaving clients for the fault tests: slowloris sockets and a client that never reads.

They speak raw sockets on purpose: an HTTP library would finish the headers, read the
response, or time out on its own, which is exactly what these clients must not do.
"""
from __future__ import annotations

import json
import selectors
import socket
import threading
import time
from typing import Optional

# A request whose headers never end: sent one byte per tick, it stays incomplete for minutes.
_TCP_ESTABLISHED = 1
_SLOW_HEADER = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-Slow: " + b"a" * 4000


class Slowloris:
    """Keeps ``count`` connections open, each trickling one header byte per ``interval``.

    A socket the server closes is counted and replaced at once, so the pressure on the
    server's descriptors stays constant for as long as the attack runs.
    """

    def __init__(self, port: int, count: int, interval: float = 0.5) -> None:
        self.port, self.count, self.interval = port, count, interval
        self.opened = 0
        self.closed_by_server = 0
        self.connect_failures = 0
        self.most_open = 0
        self._selector = selectors.DefaultSelector()
        self._sent: dict[socket.socket, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="slowloris", daemon=True)

    def __enter__(self) -> "Slowloris":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        for sock in list(self._sent):
            self._drop(sock)
        self._selector.close()

    @property
    def open_now(self) -> int:
        return len(self._sent)

    def _open(self) -> None:
        sock = socket.socket()
        sock.setblocking(False)
        if sock.connect_ex(("127.0.0.1", self.port)) not in (0, 115):  # 115: EINPROGRESS
            self.connect_failures += 1
            sock.close()
            return
        self._sent[sock] = 0
        self._selector.register(sock, selectors.EVENT_READ)
        self.opened += 1

    def _drop(self, sock: socket.socket) -> None:
        self._selector.unregister(sock)
        del self._sent[sock]
        sock.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            while len(self._sent) < self.count:
                self._open()
            self.most_open = max(self.most_open, len(self._sent))
            self._trickle()
            deadline = time.monotonic() + self.interval
            while (left := deadline - time.monotonic()) > 0 and not self._stop.is_set():
                for key, _ in self._selector.select(min(left, 0.1)):
                    self._closed_by_server(key.fileobj)  # type: ignore[arg-type]

    def _trickle(self) -> None:
        for sock, sent in list(self._sent.items()):
            try:
                if sock.send(_SLOW_HEADER[sent % len(_SLOW_HEADER):][:1]) == 1:
                    self._sent[sock] = sent + 1
            except BlockingIOError:  # still connecting, or the server is not reading: try later
                pass
            except OSError:
                self._closed_by_server(sock)

    def _closed_by_server(self, sock: socket.socket) -> None:
        """The server answered (a 408) or hung up: either way this slot is reopened."""
        if sock not in self._sent:
            return
        try:
            sock.recv(65536)
        except OSError:
            pass
        self.closed_by_server += 1
        self._drop(sock)


def streaming_request(body: dict, path: str = "/v1/completions") -> bytes:
    """A complete HTTP/1.1 POST with a JSON body, as raw bytes."""
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


class NeverReader:
    """Sends a streaming request and then never reads: the response piles up on the server.

    A small receive buffer keeps the kernel from absorbing much of the stream on the
    client's behalf, so the server's own write buffer fills quickly.
    """

    def __init__(self, port: int, body: dict) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.connect(("127.0.0.1", port))
        self.sock.sendall(streaming_request(body))

    def tcp_state(self) -> int:
        """The kernel's TCP state of the socket (Linux ``TCP_INFO``), read without draining it."""
        return self.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]

    def wait_closed_by_server(self, timeout: float) -> bool:
        """Waits, still not reading, until the server resets or closes the connection.

        Reading would drain the backlog and let the server's writes go through again, so
        the connection's state is polled instead: ESTABLISHED until the server gives up.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.tcp_state() != _TCP_ESTABLISHED:
                return True
            time.sleep(0.1)
        return False

    def close(self) -> None:
        self.sock.close()


def response_status(sock: socket.socket, timeout: float) -> Optional[bytes]:
    """The first line of whatever the server sent on ``sock`` (None if nothing came)."""
    sock.settimeout(timeout)
    try:
        data = sock.recv(65536)
    except (socket.timeout, ConnectionResetError):
        return None
    return data.split(b"\r\n", 1)[0] if data else None
