"""Kept-alive connections from the gateway to its members: a small pool per member process.

The daemons speak HTTP/1.1 with keep-alive (vramd/server/http.py), so a
connection that carried one whole reply can carry the next request: no
TCP handshake, no new thread in the daemon, per request.  Owns `Pool`:
per member process (its name, pid and endpoint: a member restarted is
another process and gets fresh connections), at most MAX_IDLE idle
connections, each dropped after IDLE_S unused, on any error, and when the
member's reply said `Connection: close` (an older daemon's HTTP/1.0, or a
refusal after which it closes).

When is a pooled connection safe to reuse?  The requests the gateway sends
are POSTs that generate (not idempotent: sent twice, a request may be
generated twice), so it must not resend a request after the member may
have read it.  HTTP's usual answer, retrying an idempotent request once on
a fresh connection when a reused one turns out closed, does not apply to
them; instead a connection is reused only when it is known good at that
moment, and a failure after that is the member's failure, not the pool's:

- idle at most IDLE_S, well below the IDLE_TIMEOUT after which a daemon
  closes a kept-alive connection (20 s): the daemon never closes one the
  gateway may still pick;
- checked just before reuse (`usable`): a socket that is readable while no
  request is outstanding has either been closed by the member (EOF) or
  holds bytes nobody asked for; either way it is dropped, not used.

What is left: the member closing the connection between that check and its
read of the request, which it does only when it stops (and then a fresh
connection would not be answered either: the gateway's Unreachable path,
vramd/gateway/server.py, re-reads the table and says the member is gone).
One case is retried (proxy.Upstream.send): the send itself failing on a
reused connection (EPIPE, ECONNRESET): the member closed it before any of
the request could reach it, so nothing of it was acted on.
"""

from __future__ import annotations

import http.client
import select
import threading
import time

MAX_IDLE = 8          # idle connections kept per member (a daemon serves 64 at most, all clients together)
IDLE_S = 5.0          # an idle connection older than this is closed (the daemons close theirs after 20 s)

Key = tuple[str, int, str]   # (member name, pid, endpoint)


def usable(conn: http.client.HTTPConnection) -> bool:
    """Is this idle connection still open, with nothing unread on it?"""
    sock = conn.sock
    if sock is None:
        return False
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return False
    return not readable


class Pool:
    def __init__(self, max_idle: int = MAX_IDLE, idle_s: float = IDLE_S):
        self.max_idle, self.idle_s = max_idle, idle_s
        self._idle: dict[Key, list[tuple[float, http.client.HTTPConnection]]] = {}
        self._lock = threading.Lock()
        self.reused = 0       # connections taken from the pool (tests, the benchmark)

    def get(self, key: Key) -> http.client.HTTPConnection | None:
        """An idle connection to the member, known good now; None if there is none."""
        while True:
            with self._lock:
                stale = self._sweep(time.monotonic())
                conns = self._idle.get(key)
                conn = conns.pop()[1] if conns else None   # the most recently used: the least likely closed
            for c in stale:
                c.close()
            if conn is None:
                return None
            if usable(conn):
                with self._lock:
                    self.reused += 1
                return conn
            conn.close()

    def put(self, key: Key, conn: http.client.HTTPConnection) -> None:
        """A connection whose reply was read whole and that the member keeps open."""
        with self._lock:
            conns = self._idle.setdefault(key, [])
            extra = conns[: max(0, len(conns) + 1 - self.max_idle)]
            del conns[: len(extra)]
            conns.append((time.monotonic(), conn))
            stale = self._sweep(time.monotonic())
        for _, c in extra:
            c.close()
        for c in stale:
            c.close()

    def _sweep(self, now: float) -> list[http.client.HTTPConnection]:
        """Take out every connection idle longer than idle_s (of every member: one that stopped
        leaves its connections here until the next request of any); the caller closes them."""
        out = []
        for key in list(self._idle):
            keep = [(t, c) for t, c in self._idle[key] if now - t <= self.idle_s]
            out += [c for t, c in self._idle[key] if now - t > self.idle_s]
            if keep:
                self._idle[key] = keep
            else:
                del self._idle[key]
        return out

    def idle(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._idle.values())

    def close(self) -> None:
        with self._lock:
            conns = [c for v in self._idle.values() for _, c in v]
            self._idle.clear()
        for c in conns:
            c.close()
