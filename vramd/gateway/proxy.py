"""One request forwarded to a member's HTTP endpoint, and its reply streamed back unbuffered.

HTTP/1.1 to the daemons, over kept-alive connections from vramd/gateway/pool.py
(a connection goes back to the pool once its reply was read whole; when and
why a pooled one is reused: that module's header).  The body is forwarded as
it came, with the member's own API key (configured per member) or else the
client's `Authorization` header.  While the daemon is silent (waiting for the
GPU, a long prefill) the gateway watches the client: a client that hangs up
closes the upstream connection (never pooled then), so the daemon sees its
client gone as it would without the gateway.

A reply with a Content-Length is relayed as one; one without (server-sent
events, chunked from an HTTP/1.1 daemon) is relayed chunk by chunk as each
arrives (`read1`: whatever the socket has, never waiting for more), chunked
again to an HTTP/1.1 client (vramd/server/exchange.py), whose connection
stays open for its next request.

Failures of the member itself are the gateway's own errors: 502 when nothing
listens at its endpoint or it hung up without a reply, 504 when it stayed
silent longer than --upstream-timeout.  A request path http.client cannot
send (a control character, a space, a character past ASCII: no route of a
daemon has one) is a 404 naming it before any connection is made; and any
exception while a request is sent closes its connection (never pooled).
"""

from __future__ import annotations

import http.client
import re
import select
import socket
import time
from urllib.parse import urlsplit

from vramd.errors import VramdError
from vramd.gateway.pool import Pool
from vramd.gateway.table import Target
from vramd.server.http import ClientGone, Exchange

# Headers of a member's reply a client may need; hop-by-hop ones (Connection,
# Transfer-Encoding, Keep-Alive) belong to each connection and are not relayed.
RELAYED = ("content-type", "retry-after", "www-authenticate", "cache-control", "x-vramd-context-dropped")
WATCH_S = 0.25       # how often a silent member's client is checked for having gone


class Unreachable(VramdError):
    http_status = 502


class BadPath(VramdError):
    http_status = 404


# What http.client refuses in a request target (its _contains_disallowed_url_pchar_re): controls, space, DEL.
UNSENDABLE = re.compile(r"[\x00-\x20\x7f]")


def check_path(method: str, path: str) -> None:
    """A path the daemons could route: printable ASCII (others percent-encoded), else 404 naming it."""
    if not path.isascii() or UNSENDABLE.search(path):
        raise BadPath(f"{method} {path!r}: no such route (a path is printable ASCII without spaces; "
                      "percent-encode other characters)")


class UpstreamTimeout(VramdError):
    http_status = 504


def address(endpoint: str) -> tuple[str, int]:
    u = urlsplit(endpoint)
    if u.scheme != "http" or not u.hostname or not u.port:
        raise Unreachable(f"the member's endpoint {endpoint!r} is not an http://host:port address")
    return u.hostname, u.port


class Upstream:
    """One request to one member; `response()` waits for its head, watching the client meanwhile;
    `release()` once the reply was read whole (the connection back to the pool), `close()` always."""

    def __init__(self, target: Target, timeout: float, pool: Pool | None = None):
        self.target, self.timeout, self.pool = target, timeout, pool
        self.key = (target.name, target.pid, target.endpoint)
        self.conn: http.client.HTTPConnection | None = None
        self.resp: http.client.HTTPResponse | None = None

    def _fail(self, e: OSError) -> Unreachable:
        why = "nothing listens there (stopping, or restarted on another port?)" \
            if isinstance(e, ConnectionRefusedError) else (e.strerror or str(e) or type(e).__name__)
        return Unreachable(f"member '{self.target.name}' (pid {self.target.pid}) did not answer at "
                           f"{self.target.endpoint}: {why}")

    def send(self, method: str, path: str, body: bytes | None, headers: dict) -> None:
        check_path(method, path)
        host, port = address(self.target.endpoint)
        pooled = self.pool.get(self.key) if self.pool is not None else None
        if pooled is not None:
            try:
                pooled.timeout = self.timeout
                pooled.sock.settimeout(self.timeout)
                pooled.request(method, path, body=body, headers=headers)
                self.conn = pooled
                return
            except (OSError, http.client.HTTPException):
                # The member closed it before any of the request reached it (the write itself
                # failed): nothing of it was acted on, so it goes once more on a fresh connection.
                pooled.close()
            except BaseException:
                pooled.close()
                raise
        self.conn = http.client.HTTPConnection(host, port, timeout=self.timeout)
        try:
            self.conn.connect()
            # Small writes (a request, one SSE event) go out at once, not held for an ACK (Nagle).
            self.conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.conn.request(method, path, body=body, headers=headers)
        except OSError as e:
            self.close()
            raise self._fail(e) from None
        except BaseException:
            self.close()
            raise

    def response(self, client_gone=None) -> http.client.HTTPResponse:
        """The reply's head; while none came, every WATCH_S ask `client_gone` (then: ClientGone)."""
        sock = self.conn.sock
        deadline = time.monotonic() + self.timeout
        try:
            while client_gone is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise UpstreamTimeout(f"member '{self.target.name}' sent no reply within {self.timeout:g} s "
                                          "(--upstream-timeout)")
                if select.select([sock], [], [], min(WATCH_S, left))[0]:
                    break
                if client_gone():
                    raise ClientGone("the client went away while the member worked")
            self.resp = self.conn.getresponse()
            return self.resp
        except (ClientGone, UpstreamTimeout):
            self.close()
            raise
        except socket.timeout:
            self.close()
            raise UpstreamTimeout(f"member '{self.target.name}' sent no reply within {self.timeout:g} s "
                                  "(--upstream-timeout)") from None
        except (http.client.HTTPException, OSError) as e:
            self.close()
            if isinstance(e, http.client.RemoteDisconnected):
                raise Unreachable(f"member '{self.target.name}' (pid {self.target.pid}) closed the connection "
                                  "without a reply (it may have died: see its log)") from None
            raise self._fail(e if isinstance(e, OSError) else OSError(str(e))) from None

    def release(self) -> None:
        """The reply was read whole: the connection back to the pool, unless the member closes it."""
        conn, resp, self.conn = self.conn, self.resp, None
        if conn is None:
            return
        if self.pool is not None and resp is not None and resp.isclosed() and not resp.will_close \
                and conn.sock is not None:
            self.pool.put(self.key, conn)
        else:
            conn.close()

    def close(self) -> None:
        """Done with it whatever happened: a connection not released is closed (the member sees
        its client gone, as a reply broken off or not taken must be)."""
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def auth_header(ex: Exchange, target: Target, member_keys: dict[str, str]) -> dict:
    key = member_keys.get(target.name)
    if key:
        return {"Authorization": f"Bearer {key}"}
    given = ex.h.headers.get("Authorization")
    return {"Authorization": given} if given else {}


def relay(ex: Exchange, up: Upstream, resp: http.client.HTTPResponse) -> None:
    """The member's reply to the client: whole if it has a length, else chunk by chunk."""
    headers = {k: v for k, v in resp.getheaders() if k.lower() in RELAYED}
    headers["X-Vramd-Member"] = up.target.name
    ctype = headers.pop("Content-Type", None) or headers.pop("content-type", "application/json")
    try:
        if resp.getheader("Content-Length") is not None:
            data = resp.read()
            up.release()
            ex.reply(resp.status, data, ctype, headers)
            return
        headers = {k: v for k, v in headers.items() if k.lower() != "cache-control"}   # the stream sets its own
        ex.start_stream(ctype, resp.status, headers)
        while True:
            chunk = resp.read1(1 << 16)
            if not chunk:
                up.release()
                return
            ex.send(chunk)
    except (http.client.HTTPException, OSError) as e:
        if not ex.streaming:
            raise Unreachable(f"member '{up.target.name}' broke off its reply: {e}") from None
        ex.error = f"member '{up.target.name}' broke off its reply: {e}"   # headers are gone: the stream ends
    finally:
        up.close()

