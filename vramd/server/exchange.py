"""One HTTP request and its reply, as a route sees them (vramd/server/http.py routes them).

Owns `Exchange` (the body, read once within the limits the handler checked;
a JSON reply, or no body for HEAD; a server-sent-event stream: chunked to an
HTTP/1.1 client, `: keep-alive` comments, an error after the headers as an
SSE error event then `[DONE]`), `Refused` (a refusal before the route's work:
status, one line, OpenAI's error code), `error_payload` and `ClientGone`.
"""

from __future__ import annotations

import json
import select
import socket
import time
from http.server import BaseHTTPRequestHandler
from typing import Callable


class Refused(Exception):
    """A request refused before its route runs: status, one-line message, OpenAI error code."""

    def __init__(self, status: int, message: str, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.code, self.headers = status, code, headers or {}


def error_payload(message: str, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}


class ClientGone(Exception):
    """The client closed the connection while we were writing to it."""


class Exchange:
    """One request and its response."""

    def __init__(self, handler: BaseHTTPRequestHandler):
        self.h = handler
        self.path = handler.path.split("?", 1)[0]
        self.rest: str | None = None      # a prefix route's: the path below its prefix, URL-decoded
        self.head_only = handler.command == "HEAD"   # headers as for GET, no body
        self.streaming = False
        self.chunked = False              # the stream goes out in HTTP/1.1 chunks (the connection stays)
        self.stream_done = False          # the stream's end was sent
        self.length: int | None = None   # the body's Content-Length, checked (POST)
        self.method = handler.command
        self.started = time.monotonic()
        self.status: int | None = None   # the reply's status, once sent
        self.error: str | None = None    # the refusal's or the error's message
        self.fields: dict = {}           # what the route adds to the request's log line

    def body(self) -> bytes:
        """The request body, read once; its length was checked against the limit before."""
        n = self.length or 0
        try:
            data = self.h.rfile.read(n) if n else b""
        except TimeoutError:
            self.h.close_connection = True
            raise Refused(408, f"the request body did not arrive within {self.h.request_timeout:g} s") from None
        finally:
            self.length = 0
            self.h.connection.settimeout(self.h.request_timeout)  # from now on: how long a reply may wait
        if len(data) < n:
            self.h.close_connection = True
            raise Refused(400, f"the request body ended after {len(data)} of {n} bytes")
        return data

    def reply(self, status: int, payload, ctype: str = "application/json", headers: dict | None = None) -> None:
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.status = status
        if status >= 400 and isinstance(payload, dict) and isinstance(payload.get("error"), dict):
            self.error = self.error or payload["error"].get("message")
        self.h.send_response(status)
        for k, v in (headers or {}).items():
            self.h.send_header(k, v)
        self.h.send_header("Content-Type", ctype)
        self.h.send_header("Content-Length", str(len(body)))
        if self.h.close_connection:
            self.h.send_header("Connection", "close")
        self.h.end_headers()
        self._write(b"" if self.head_only else body)

    def start_stream(self, content_type: str = "text/event-stream", status: int = 200,
                     headers: dict | None = None) -> None:
        """Server-sent events (or the gateway's NDJSON), the headers flushed now: chunked to an
        HTTP/1.1 client (the connection stays), else without a length, closed at the end."""
        self.streaming = True
        self.status = status
        self.chunked = self.h.request_version == "HTTP/1.1" and not self.h.close_connection
        self.h.send_response(status)
        for k, v in (headers or {}).items():
            self.h.send_header(k, v)
        self.h.send_header("Content-Type", content_type)
        self.h.send_header("Cache-Control", "no-cache")
        if self.chunked:
            self.h.send_header("Transfer-Encoding", "chunked")
        else:
            self.h.close_connection = True
            self.h.send_header("Connection", "close")
        self.h.end_headers()
        self._write(b"")

    def send(self, data: bytes) -> None:
        if self.chunked and data:
            data = b"%x\r\n%s\r\n" % (len(data), data)
        self._write(data)

    def keep_alive(self) -> None:
        """An SSE comment: clients skip it; it shows the stream is alive (and finds a client
        that hung up) while the request waits for the GPU or a long prefill."""
        self.send(b": keep-alive\n\n")

    def end_stream(self) -> None:
        """The stream's last bytes: the chunked body's end (nothing to send otherwise)."""
        if self.stream_done:
            return
        self.stream_done = True
        if self.chunked:
            self._write(b"0\r\n\r\n")

    def stream_error(self, status: int, payload: dict) -> None:
        """An error after the headers went out: the error object as an event, then the end."""
        self.error = self.error or payload.get("error", {}).get("message")
        self.fields["error_status"] = status   # the status line said 200: the log and metrics say this
        self.send(b"data: " + json.dumps(payload).encode() + b"\n\n")
        self.send(b"data: [DONE]\n\n")
        self.end_stream()

    def client_gone(self) -> bool:
        """Has the client closed its end (EOF or a reset) while we work on its reply?  Data it
        sent meanwhile (a pipelined request) is left where it is: that client still waits."""
        sock = self.h.connection
        try:
            ready, _, _ = select.select([sock], [], [], 0)
            if not ready:
                return False
            return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True

    def _write(self, data: bytes) -> None:
        try:
            if data:
                self.h.wfile.write(data)
            self.h.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, OSError) as e:
            raise ClientGone(str(e)) from None


Route = Callable[[Exchange], None]
