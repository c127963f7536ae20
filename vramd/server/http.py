"""The daemon's HTTP face: a small router over the stdlib's threading HTTP server.

Bound to --host:--port (127.0.0.1 by default), a thread per connection.
Routes are `(method, path) -> fn(exchange)`; an `Exchange` reads the body
(capped) and writes a JSON reply or a server-sent-event stream.  Handlers
never touch the GPU: generation is a job on the daemon's loop thread.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from vramd.errors import UsageError

log = logging.getLogger("vramd.http")

MAX_BODY = 8 << 20


class ClientGone(Exception):
    """The client closed the connection while we were writing to it."""


class Exchange:
    """One request and its response."""

    def __init__(self, handler: BaseHTTPRequestHandler):
        self.h = handler
        self.path = handler.path.split("?", 1)[0]
        self.streaming = False

    def body(self) -> bytes:
        try:
            n = int(self.h.headers.get("Content-Length", "0"))
        except ValueError:
            raise UsageError("bad Content-Length") from None
        if n < 0 or n > MAX_BODY:
            raise UsageError(f"request body of {n} bytes: at most {MAX_BODY}")
        return self.h.rfile.read(n) if n else b""

    def reply(self, status: int, payload, ctype: str = "application/json") -> None:
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.h.send_response(status)
        self.h.send_header("Content-Type", ctype)
        self.h.send_header("Content-Length", str(len(body)))
        self.h.end_headers()
        self._write(body)

    def start_stream(self) -> None:
        """Server-sent events: no length, the connection closes at the end."""
        self.streaming = True
        self.h.close_connection = True
        self.h.send_response(200)
        self.h.send_header("Content-Type", "text/event-stream")
        self.h.send_header("Cache-Control", "no-cache")
        self.h.send_header("Connection", "close")
        self.h.end_headers()
        self._write(b"")

    def send(self, data: bytes) -> None:
        self._write(data)

    def _write(self, data: bytes) -> None:
        try:
            if data:
                self.h.wfile.write(data)
            self.h.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, OSError) as e:
            raise ClientGone(str(e)) from None


Route = Callable[[Exchange], None]


class _Handler(BaseHTTPRequestHandler):
    server_version = "vramd"
    routes: dict[tuple[str, str], Route] = {}
    on_error: Callable[[BaseException], tuple[int, dict]] = None

    def _dispatch(self, method: str) -> None:
        ex = Exchange(self)
        route = self.routes.get((method, ex.path))
        if route is None:
            known = any(path == ex.path for _m, path in self.routes)
            status = 405 if known else 404
            ex.reply(status, {"error": {"message": f"{method} {ex.path}: no such route", "type": "not_found_error",
                                        "param": None, "code": None}})
            return
        try:
            route(ex)
        except ClientGone:
            log.info("%s %s: client went away", method, ex.path)
        except Exception as e:
            if not isinstance(e, UsageError) and getattr(e, "http_status", 500) == 500:
                log.exception("%s %s failed", method, ex.path)
            if ex.streaming:
                return  # headers are gone; the stream just ends
            status, payload = type(self).on_error(e)
            try:
                ex.reply(status, payload)
            except ClientGone:
                pass

    def do_GET(self):  # noqa: N802 (http.server's naming)
        self._dispatch("GET")

    def do_POST(self):  # noqa: N802
        self._dispatch("POST")

    def log_message(self, fmt, *args):
        log.debug("%s " + fmt, self.address_string(), *args)


def json_route(fn: Callable[[], tuple[int, dict]]) -> Route:
    """A GET route whose function returns (status, payload)."""
    def route(ex: Exchange) -> None:
        status, payload = fn()
        ex.reply(status, payload)
    return route


class HttpServer:
    def __init__(self, host: str, port: int, routes: dict[tuple[str, str], Route],
                 on_error: Callable[[BaseException], tuple[int, dict]]):
        handler = type("Handler", (_Handler,), {"routes": routes, "on_error": staticmethod(on_error)})
        try:
            self.server = ThreadingHTTPServer((host, port), handler)
        except OSError as e:
            raise UsageError(f"cannot serve HTTP on {host}:{port}: {e.strerror} "
                             "(another daemon there? give each its own --port)") from None
        self.server.daemon_threads = True
        self.host, self.port = self.server.server_address[:2]
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
