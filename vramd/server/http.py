"""The daemon's HTTP face: a small router over the stdlib's threading HTTP server.

Bound to --host:--port (127.0.0.1 by default), a thread per connection.
Routes are `(method, path) -> fn(exchange)` (a path ending in "/" takes
every path below it: `Exchange.rest` is the part after it, URL-decoded);
an `Exchange` (vramd/server/exchange.py) reads the body and writes a JSON
reply or a server-sent-event stream; a `RequestReader`
(vramd/server/http_reader.py) reads the request within its limits; the CORS
headers are vramd/server/cors.py's.  Handlers never touch the GPU:
generation is a job on the daemon's loop thread.

HTTP/1.1 with keep-alive: a connection carries any number of requests, one
after another.  A stream to an HTTP/1.1 client is sent chunked, so that the
connection survives it; to an HTTP/1.0 client it ends with the connection.
A stream whose route fails after the headers went out ends with an SSE
error event (OpenAI's error object) and `data: [DONE]`, never just cut.
HEAD is answered for every GET route (the GET's headers, no body).  OPTIONS
says which methods a path takes; with --cors-origin it is the CORS
preflight answer, and every reply to an allowed `Origin` carries
`Access-Control-Allow-Origin` (the origin, or `*` for `--cors-origin '*'`);
without the flag no reply carries a CORS header, so browsers on other
origins cannot read any.

What a client may not do:

- use any route but /health (and /metrics with --metrics-public) without
  `Authorization: Bearer <key>` when the daemon has an API key (401,
  compared in constant time);
- send a body without Content-Length (chunked is not supported: 411), with
  a malformed one (400), or larger than --max-request-bytes (413); the
  body is never read before these checks pass;
- send a request head (request line and headers) over MAX_HEAD bytes (431);
- keep a connection after a 401 (it is closed: a client without the key
  gets one answer per connection);
- take longer than HEAD_TIMEOUT seconds (or --request-timeout, if less) to
  send a request head, counted from when the connection is taken up or the
  previous reply was sent: the API key is checked only once the head is in,
  so this is how long a client without the key can hold a connection slot
  (once a request on the connection passed the key check, the connection may
  idle IDLE_TIMEOUT seconds for the next request, whose clocks start with its
  first byte);
- take longer than --request-timeout seconds to send a request, head and
  body (a slowloris client: the connection is closed), or leave a reply
  unread for that long;
- open more than MAX_CONNECTIONS connections at once (503, closed).

What is left: anyone who can connect can keep the MAX_CONNECTIONS slots busy
by reconnecting every HEAD_TIMEOUT seconds.  A cap per client address does not
help on loopback, where every local client has the same address; beyond
loopback, a proxy in front can limit each client (docs/operations.md).

Every request that got a head is one `request` line in the log when it ends
(method, path, status, total seconds, the error's message, and what the route
put in `Exchange.fields`: the daemon adds model, tokens, queue wait and time
to the first token); /health and /metrics, polled by probes and scrapers,
at debug level.  `on_start`/`on_finish` let the daemon count them (metrics).
"""

from __future__ import annotations

import errno
import hmac
import http.client
import ipaddress
import json
import logging
import socket
import threading
import time
import urllib.parse
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from vramd.errors import UsageError, VramdError
from vramd.server.cors import cors_headers
from vramd.server.exchange import ClientGone, Exchange, Refused, Route, error_payload  # noqa: F401 (used, and re-exported)
from vramd.server.http_reader import DEFAULT_REQUEST_TIMEOUT, HEAD_TIMEOUT, MAX_HEAD, RequestReader  # noqa: F401
from vramd.server.logs import event

log = logging.getLogger("vramd.http")

DEFAULT_MAX_REQUEST = 32 << 20    # images travel inside the JSON as base64
# A kept-alive connection waits this long for its next request, once a request on it passed the key
# check: longer than the pools of common clients keep an idle connection (httpx 5 s, aiohttp 15 s,
# undici 4 s), so that the client, not the daemon, drops it first (a request sent on a connection
# the server is closing at that moment fails).
IDLE_TIMEOUT = 20.0
MAX_CONNECTIONS = 64
OPEN_PATHS = frozenset({"/health"})   # answered without the API key (systemd, load-balancer probes)
QUIET_PATHS = frozenset({"/health", "/metrics"})   # logged at debug level: polled every few seconds


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class _Handler(BaseHTTPRequestHandler):
    server_version = "vramd"
    protocol_version = "HTTP/1.1"   # keep-alive: every reply has a length, or is chunked, or closes
    routes: dict[tuple[str, str], Route] = {}
    cors_origins: frozenset = frozenset()   # --cors-origin: origins, or "*"
    on_error: Callable[[BaseException], tuple[int, dict]] = None
    api_key: bytes | None = None
    open_paths: frozenset = OPEN_PATHS
    on_start: Callable[["Exchange"], None] | None = None
    on_finish: Callable[["Exchange", float], None] | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT

    @property
    def head_timeout(self) -> float:
        return min(HEAD_TIMEOUT, self.request_timeout)

    def setup(self) -> None:
        super().setup()
        # A reply goes out as two writes (head, then body): with Nagle's algorithm the body waits for
        # the client's ACK of the head, which a kept-alive connection's client delays (~40 ms on Linux).
        try:
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass   # not TCP: nothing to delay
        self.rfile = RequestReader(self.connection)
        self.trusted = False   # a request on this connection passed the key check (IDLE_TIMEOUT applies)

    def handle_one_request(self) -> None:
        """http.server's, with a deadline and a byte budget on the request head."""
        self.command, self.request_version, self.requestline = None, "HTTP/1.0", ""
        self.headers = None   # not the previous request's (end_headers reads its Origin)
        try:
            self.rfile.begin(self.request_timeout, self.head_timeout, IDLE_TIMEOUT if self.trusted else None)
            self.raw_requestline = self.rfile.readline()
            if not self.raw_requestline:
                self.close_connection = True
                return
            if not self.parse_request():
                return
            self.rfile.end_head()
            self.connection.settimeout(self.request_timeout)
            handler = getattr(self, "do_" + self.command, None)
            if handler is None:
                self.send_error(HTTPStatus.NOT_IMPLEMENTED, f"unsupported method {self.command!r}")
                return
            handler()
            self.wfile.flush()
        except http.client.LineTooLong as e:  # the request line itself (header lines: parse_request)
            self.send_error(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, str(e))
        except TimeoutError:
            if self.rfile.idle:
                log.debug("%s: kept-alive connection idle for %g s: closed", self.address_string(), IDLE_TIMEOUT)
            elif self.rfile.in_head:
                # Idle keep-alive connections end here too: debug, not info.
                log.log(logging.INFO if self.rfile.head_started else logging.DEBUG,
                        "%s: request head not received within %g s: connection closed",
                        self.address_string(), self.head_timeout)
            else:
                log.info("%s: request not received within %g s (or its reply not taken): connection closed",
                         self.address_string(), self.request_timeout)
            self.close_connection = True
        except (ConnectionError, OSError) as e:
            log.debug("%s: connection failed: %s", self.address_string(), e)
            self.close_connection = True

    def end_headers(self) -> None:
        """Every reply's headers end here: the CORS headers join them for an allowed Origin."""
        for k, v in self._cors_headers().items():
            self.send_header(k, v)
        super().end_headers()

    def handle_expect_100(self) -> bool:
        """`Expect: 100-continue` (curl's, for a large body): the interim reply without CORS headers."""
        self.send_response_only(HTTPStatus.CONTINUE)
        BaseHTTPRequestHandler.end_headers(self)
        return True

    def _cors_headers(self) -> dict:
        if not self.cors_origins or self.headers is None:
            return {}
        return cors_headers(self.cors_origins, self.headers, self.command)

    def send_error(self, code, message=None, explain=None) -> None:
        """http.server's own refusals (malformed request, head too large), as OpenAI-shaped JSON."""
        self.close_connection = True
        if self.request_version == "HTTP/0.9":
            # parse_request starts from 0.9 and fails before it read the version: http.server would
            # then write the body without a status line.  Nobody speaks 0.9 to this daemon.
            self.request_version = "HTTP/1.0"
        text = message or HTTPStatus(code).phrase
        if explain and explain != text:
            text = f"{text}: {explain}"
        body = json.dumps(error_payload(text)).encode()
        # Refused before a route was chosen: its request line (the path, if the line had one).
        event(log, "request", method=self.command, path=getattr(self, "path", None), status=int(code), error=text)
        try:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)
        except OSError:
            pass

    def _refuse(self, ex: "Exchange", r: Refused) -> None:
        if ex.length:
            self.close_connection = True  # its body stays unread
        body = json.dumps(error_payload(str(r), r.code)).encode()
        ex.status, ex.error = r.status, str(r)
        self.send_response(r.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for k, v in r.headers.items():
            self.send_header(k, v)
        if self.close_connection:
            self.send_header("Connection", "close")
        try:
            self.end_headers()
            ex._write(b"" if ex.head_only else body)
        except (ClientGone, OSError):
            self.close_connection = True

    def _check_key(self, path: str) -> None:
        if self.api_key is None or path in self.open_paths:
            return
        scheme, _, given = self.headers.get("Authorization", "").strip().partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            self.close_connection = True
            raise Refused(401, "missing API key: send the header 'Authorization: Bearer <key>'",
                          "invalid_api_key", {"WWW-Authenticate": 'Bearer realm="vramd"'})
        try:
            given_bytes = given.strip().encode("latin-1")
        except UnicodeEncodeError:
            given_bytes = b""
        if not hmac.compare_digest(given_bytes, self.api_key):
            self.close_connection = True
            raise Refused(401, "incorrect API key", "invalid_api_key",
                          {"WWW-Authenticate": 'Bearer realm="vramd", error="invalid_token"'})

    def _check_length(self, ex: "Exchange") -> None:
        """A POST's body: Content-Length given once, sane, within the limit; no chunked bodies."""
        if self.headers.get("Transfer-Encoding"):
            self.close_connection = True
            raise Refused(411, "chunked (Transfer-Encoding) request bodies are not supported: send Content-Length")
        values = self.headers.get_all("Content-Length") or []
        if not values:
            self.close_connection = True
            raise Refused(411, "Content-Length required")
        value = values[0].strip()
        if len(set(v.strip() for v in values)) != 1 or not value.isascii() or not value.isdigit() or len(value) > 18:
            self.close_connection = True
            raise Refused(400, f"bad Content-Length: {', '.join(values)[:40]!r}")
        n = int(value)
        if n > self.max_request_bytes:
            self.close_connection = True
            raise Refused(413, f"request body of {n} bytes: this daemon takes at most {self.max_request_bytes} "
                               "(--max-request-bytes)", "request_too_large")
        ex.length = n

    def _dispatch(self, method: str) -> None:
        ex = Exchange(self)
        if self.on_start is not None:
            self.on_start(ex)
        try:
            self._route(method, ex)
        finally:
            seconds = time.monotonic() - ex.started
            if self.on_finish is not None:
                self.on_finish(ex, seconds)
            event(log, "request", logging.DEBUG if ex.path in QUIET_PATHS else logging.INFO,
                  method=method, path=ex.path, status=ex.status, **ex.fields, total_s=round(seconds, 6),
                  error=ex.error)

    def _find(self, method: str, ex: "Exchange") -> Route | None:
        """The route for (method, path): an exact one, else the longest prefix route above it."""
        route = self.routes.get((method, ex.path))
        if route is not None:
            return route
        best = None
        for (m, path), fn in self.routes.items():
            if m == method and path.endswith("/") and ex.path.startswith(path) and len(ex.path) > len(path):
                if best is None or len(path) > len(best[0]):
                    best = (path, fn)
        if best is None:
            return None
        ex.rest = urllib.parse.unquote(ex.path[len(best[0]):])
        return best[1]

    def _methods(self, path: str) -> list[str]:
        """What a path takes (OPTIONS's Allow, a 405's)."""
        probe = Exchange.__new__(Exchange)
        probe.path = path
        got = {m for m in ("GET", "POST") if self._find(m, probe) is not None}
        if "GET" in got:
            got.add("HEAD")
        return sorted(got | {"OPTIONS"}) if got else []

    def _options(self, ex: "Exchange") -> None:
        """OPTIONS: the methods a path takes; for an allowed Origin, the CORS preflight's answer
        (end_headers adds it).  Asks for no key: a browser's preflight never carries one."""
        methods = ["GET", "HEAD", "OPTIONS", "POST"] if ex.path == "*" else self._methods(ex.path)
        if not methods:
            ex.reply(404, {"error": {"message": f"OPTIONS {ex.path}: no such route", "type": "not_found_error",
                                     "param": None, "code": None}})
            return
        ex.status = 204
        self.send_response(204)
        self.send_header("Allow", ", ".join(methods))
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _route(self, method: str, ex: "Exchange") -> None:
        if method != "POST" and (self.headers.get("Transfer-Encoding") or
                                 self.headers.get("Content-Length", "0").strip() not in ("", "0")):
            self.close_connection = True   # a body nobody reads: it must not be taken for the next request
        if method == "OPTIONS":
            self._options(ex)
            return
        lookup = "GET" if method == "HEAD" else method
        try:
            self._check_key(ex.path)
            # An open path (/health) earns a keyless client no longer idle time.
            self.trusted = self.trusted or self.api_key is None or ex.path not in self.open_paths
            if method == "POST":
                self._check_length(ex)
        except Refused as r:
            self._refuse(ex, r)
            return
        route = self._find(lookup, ex)
        if route is None:
            if ex.length:
                self.close_connection = True
            allowed = self._methods(ex.path)
            status = 405 if allowed else 404
            ex.reply(status, {"error": {"message": f"{method} {ex.path}: no such route", "type": "not_found_error",
                                        "param": None, "code": None}},
                     headers={"Allow": ", ".join(allowed)} if allowed else None)
            return
        try:
            route(ex)
            if ex.streaming:
                ex.end_stream()
        except Refused as r:
            if not ex.streaming:
                self._refuse(ex, r)
            else:
                self._late_error(ex, r.status, error_payload(str(r), r.code))
        except ClientGone:
            ex.error = "the client went away"
            self.close_connection = True
        except Exception as e:
            if not isinstance(e, UsageError) and getattr(e, "http_status", 500) == 500:
                log.exception("%s %s failed", method, ex.path)
            if ex.streaming:
                self._late_error(ex, *type(self).on_error(e))
                return
            if ex.length:
                self.close_connection = True  # the route failed before reading its body
            status, payload = type(self).on_error(e)
            ex.status, ex.error = status, ex.error or str(e)
            # A refusal that may pass (device memory others hold, OutOfDeviceMemory) says when to retry.
            retry = getattr(e, "retry_after", None)
            try:
                ex.reply(status, payload, headers={"Retry-After": str(retry)} if retry else None)
            except ClientGone:
                pass

    def _late_error(self, ex: "Exchange", status: int, payload: dict) -> None:
        """The route failed after the stream's headers went out: tell the client in the stream."""
        if ex.stream_done:
            return
        try:
            ex.stream_error(status, payload)
        except ClientGone:
            ex.error = ex.error or "the client went away"
            self.close_connection = True

    def do_GET(self):  # noqa: N802 (http.server's naming)
        self._dispatch("GET")

    def do_HEAD(self):  # noqa: N802
        self._dispatch("HEAD")

    def do_POST(self):  # noqa: N802
        self._dispatch("POST")

    def do_OPTIONS(self):  # noqa: N802
        self._dispatch("OPTIONS")

    def log_message(self, fmt, *args):
        log.debug("%s " + fmt, self.address_string(), *args)


def json_route(fn: Callable[[], tuple[int, dict]]) -> Route:
    """A GET route whose function returns (status, payload)."""
    def route(ex: Exchange) -> None:
        status, payload = fn()
        ex.reply(status, payload)
    return route


class _Server(ThreadingHTTPServer):
    """A thread per connection, at most MAX_CONNECTIONS at once."""

    daemon_threads = True
    request_queue_size = MAX_CONNECTIONS  # listen backlog: a burst is accepted, not SYN-dropped

    def __init__(self, *args, **kw):
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(*args, **kw)

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            body = json.dumps(error_payload(f"more than {MAX_CONNECTIONS} connections at once; try again")).encode()
            try:
                request.setblocking(False)
                request.send(b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def bind_hint(e: OSError) -> str:
    """What to do about a failed bind, by its cause: the port taken or privileged, or a --host that
    does not resolve (an address not on this machine is HttpServer's own exit 1: it may come up)."""
    if e.errno == errno.EADDRINUSE:
        return " (another daemon there? give each its own --port)"
    if e.errno == errno.EACCES:
        return " (ports below 1024 need privileges: choose a --port above 1023)"
    if isinstance(e, socket.gaierror):
        return " (--host is not an address or a name this machine resolves)"
    return ""


class HttpServer:
    def __init__(self, host: str, port: int, routes: dict[tuple[str, str], Route],
                 on_error: Callable[[BaseException], tuple[int, dict]], *, api_key: str | None = None,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST, request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
                 open_paths=OPEN_PATHS, on_start=None, on_finish=None, cors_origins=()):
        handler = type("Handler", (_Handler,), {
            "cors_origins": frozenset(cors_origins),
            "routes": routes, "on_error": staticmethod(on_error),
            "api_key": api_key.encode() if api_key else None, "open_paths": frozenset(open_paths),
            "on_start": staticmethod(on_start) if on_start else None,
            "on_finish": staticmethod(on_finish) if on_finish else None,
            "max_request_bytes": max_request_bytes, "request_timeout": request_timeout})
        try:
            self.server = _Server((host, port), handler)
        except OSError as e:
            if e.errno == errno.EADDRNOTAVAIL:
                # Not a bad flag: the address is not (yet) on this machine, as at boot before the
                # network is up.  Exit 1, which systemd's Restart=on-failure retries (2 is not).
                raise VramdError(f"cannot serve HTTP on {host}:{port}: {e.strerror} (the address is not on this "
                                 "machine, or not yet: under systemd, order the instance after "
                                 "network-online.target, systemd/README.md)") from None
            raise UsageError(f"cannot serve HTTP on {host}:{port}: {e.strerror}{bind_hint(e)}") from None
        self.host, self.port = self.server.server_address[:2]
        if not api_key and not _loopback(self.host):
            log.warning("HTTP on %s without --api-key: anyone who can reach port %d can use this model",
                        self.host, self.port)
        self._thread = threading.Thread(target=self.server.serve_forever, name="vramd-http", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> "HttpServer":
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread.is_alive():  # shutdown() waits for serve_forever: only if it runs
            self.server.shutdown()
        self.server.server_close()
