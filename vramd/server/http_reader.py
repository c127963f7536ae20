"""How a request is read off a connection: whole within a deadline, its head capped in bytes.

Owns `RequestReader`, the rfile of vramd/server/http.py's handler, and the
limits it enforces: MAX_HEAD bytes of request line and headers, HEAD_TIMEOUT
seconds for them (or the request timeout, if less), the request timeout for
head and body together, and for a kept-alive connection the wait for its next
request (the handler's IDLE_TIMEOUT), whose clocks start with its first byte.
"""

from __future__ import annotations

import http.client
import socket
import time

DEFAULT_REQUEST_TIMEOUT = 30.0    # seconds to send a whole request (or to take a reply)
HEAD_TIMEOUT = 5.0                # seconds to send the request head (never more than the request timeout)
MAX_HEAD = 64 << 10               # request line and headers together


class RequestReader:
    """A connection's rfile: each request must arrive whole within a deadline, its head capped.

    Reads straight from the socket, re-arming the socket timeout with what
    is left of the deadline before every recv, so a client that trickles a
    byte at a time cannot keep the thread past the deadline.
    """

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = bytearray()
        self.deadline: float | None = None
        self.head_left: int | None = None
        self._request_deadline: float | None = None
        self._timeouts = (DEFAULT_REQUEST_TIMEOUT, HEAD_TIMEOUT)
        self.idle = False             # waiting for a kept-alive connection's next request

    def begin(self, timeout: float, head_timeout: float, idle: float | None = None) -> None:
        """A new request starts: the head's deadline and byte budget, the whole request's deadline.
        idle: a kept-alive connection may wait this long for the next request's first byte; the
        head's and the request's clocks then start with it."""
        now = time.monotonic()
        self._timeouts = (timeout, head_timeout)
        self.head_left = MAX_HEAD
        self.idle = idle is not None and not self.buf
        if self.idle:
            self.deadline, self._request_deadline = now + idle, None
        else:
            self._start(now)

    def _start(self, now: float) -> None:
        timeout, head_timeout = self._timeouts
        self._request_deadline = now + timeout
        self.deadline = now + min(head_timeout, timeout)

    def end_head(self) -> None:
        """The head is in: the body may take what is left of the request's deadline."""
        self.head_left = None
        self.deadline = self._request_deadline

    @property
    def in_head(self) -> bool:
        return self.head_left is not None

    @property
    def head_started(self) -> bool:
        """Some of this request's head arrived (else: an idle connection)."""
        return bool(self.buf) or (self.head_left is not None and self.head_left < MAX_HEAD)

    def _fill(self) -> bool:
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the request did not arrive in time")
            self.sock.settimeout(left)
        chunk = self.sock.recv(1 << 16)
        if not chunk:
            return False
        if self.idle:   # the next request's first bytes: its clocks start now
            self.idle = False
            self._start(time.monotonic())
        self.buf += chunk
        return True

    def readline(self, limit: int = -1) -> bytes:
        if self.head_left is not None:
            cap = self.head_left + 1
            limit = cap if limit < 0 else min(limit, cap)
        start = 0
        while True:
            i = self.buf.find(b"\n", start)
            if i >= 0 and (limit < 0 or i < limit):
                n = i + 1
                break
            if limit >= 0 and len(self.buf) >= limit:
                n = limit
                break
            start = len(self.buf)
            if not self._fill():
                n = len(self.buf)
                break
        line = bytes(self.buf[:n])
        del self.buf[:n]
        if self.head_left is not None:
            self.head_left -= len(line)
            if self.head_left < 0:
                raise http.client.LineTooLong(f"request head over {MAX_HEAD} bytes")
        return line

    def read(self, n: int = -1) -> bytes:
        while (n < 0 or len(self.buf) < n) and self._fill():
            pass
        n = len(self.buf) if n < 0 else min(n, len(self.buf))
        data = bytes(self.buf[:n])
        del self.buf[:n]
        return data

    def close(self) -> None:
        pass  # the socket belongs to the server
