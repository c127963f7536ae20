"""The daemon's HTTP face: `/health`, `/vramd/status` (JSON), `/metrics` (Prometheus).

Bound to --host:--port (127.0.0.1 by default).  A thread per connection
(the stdlib's ThreadingHTTPServer); handlers only read the daemon's state,
GPU work goes through the daemon's loop.  The inference endpoints arrive
with the engine.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from vramd.errors import UsageError

log = logging.getLogger("vramd.http")


class _Handler(BaseHTTPRequestHandler):
    server_version = "vramd"
    routes: dict[str, Callable[[], tuple[int, str, bytes]]] = {}

    def do_GET(self):  # noqa: N802 (http.server's naming)
        route = self.routes.get(self.path.split("?", 1)[0])
        if route is None:
            self._reply(404, "application/json", json.dumps({"error": {"message": f"no route {self.path}",
                                                                        "type": "not_found"}}).encode())
            return
        try:
            status, ctype, body = route()
        except Exception as e:
            log.exception("GET %s failed", self.path)
            status, ctype, body = 500, "application/json", json.dumps({"error": {"message": str(e)}}).encode()
        self._reply(status, ctype, body)

    def _reply(self, status: int, ctype: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, fmt, *args):
        log.debug("%s " + fmt, self.address_string(), *args)


class HttpServer:
    def __init__(self, host: str, port: int, *, health: Callable[[], tuple[int, dict]],
                 status: Callable[[], dict], metrics: Callable[[], str]):
        routes = {
            "/health": lambda: _json(*health()),
            "/vramd/status": lambda: _json(200, status()),
            "/metrics": lambda: (200, "text/plain; version=0.0.4; charset=utf-8", metrics().encode()),
        }
        handler = type("Handler", (_Handler,), {"routes": routes})
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


def _json(status: int, payload: dict) -> tuple[int, str, bytes]:
    return status, "application/json", json.dumps(payload).encode()
