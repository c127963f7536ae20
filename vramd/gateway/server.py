"""The gateway process: its routes, its HTTP server (vramd/server/http.py's), its life.

    GET  /health                   open (no key): ok, and how many members it sees
    GET  /v1/models                every member once (and each alias), with its state
    GET  /v1/models/{id}           one of them (the openai SDK's models.retrieve)
    POST /v1/*                     forwarded to the member the body's "model" names
    GET  /, /api/version, /api/tags, /api/ps; POST /api/show, /api/chat, /api/generate,
         /api/embed, /api/embeddings   Ollama's API, mapped (vramd/gateway/ollama_routes.py)

The model list follows llama.cpp's router: each entry has a `status` object,
here `{"value": "warm" | "parked" | "cold" | "loading"}`, and its `aliases`.
A body without "model" goes to the only member if there is one, else 400.
The HTTP hardening (key, limits, timeouts, connection cap) and CORS
(--cors-origin: vramd/server/cors.py; preflights need no key) are the daemons'.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal

from vramd.errors import UsageError
from vramd.gateway import ollama_routes, proxy
from vramd.gateway.config import GatewayConfig
from vramd.gateway.pool import Pool
from vramd.gateway.table import Table, Target
from vramd.server.bodies import json_object
from vramd.server.http import Exchange, HttpServer, json_route

log = logging.getLogger("vramd.gateway")


def error_body(e: BaseException) -> tuple[int, dict]:
    status = getattr(e, "http_status", 500)
    kind = {400: "invalid_request_error", 404: "not_found_error", 502: "bad_gateway", 503: "service_unavailable",
            504: "gateway_timeout"}.get(status, "server_error")
    return status, {"error": {"message": str(e), "type": kind, "param": None, "code": None}}


def read_json(ex: Exchange) -> tuple[bytes, dict]:
    raw = ex.body()
    return raw, json_object(raw)


class Gateway:
    def __init__(self, cfg: GatewayConfig, members_dir):
        self.cfg = cfg
        self.table = Table(members_dir, cfg.aliases)
        self.pool = Pool()   # kept-alive connections to the members (vramd/gateway/pool.py)
        routes = {
            ("GET", "/health"): json_route(lambda: (200, {"status": "ok", "members": len(self.table.members())})),
            ("GET", "/v1/models"): json_route(lambda: (200, self.models_list())),
            # Prefix routes (a path ending in "/": vramd/server/http.py routes every path below it).
            ("GET", "/v1/models/"): self.model_route,
            ("POST", "/v1/"): self.forward_route,
            **ollama_routes.routes(self),
        }
        self.http = HttpServer(cfg.host, cfg.port, routes, on_error=error_body,
                               api_key=cfg.api_key, max_request_bytes=cfg.max_request_bytes,
                               request_timeout=cfg.request_timeout, cors_origins=cfg.cors_origins)

    # -- routing ------------------------------------------------------------------

    def target(self, model) -> Target:
        """The member a request's "model" names (the only one, if it names none)."""
        if model is None:
            members = self.table.members()
            if len(members) == 1:
                return members[0]
            raise UsageError(f"'model' is required: this gateway serves {', '.join(self.table.known()) or 'nothing yet'}")
        if not isinstance(model, str):
            raise UsageError(f"'model' must be a string, got {type(model).__name__}")
        return self.table.resolve(model)

    def forward_route(self, ex: Exchange) -> None:
        raw, body = read_json(ex)
        t = self.target(body.get("model"))
        ex.fields["member"] = t.name
        if body.get("model") not in (None, t.name, t.model, *t.aliases):
            # The gateway's alias (or name:latest): the daemon knows only its own names.
            body["model"] = t.name
            raw = json.dumps(body).encode()
        up, resp = self.upstream(ex, t, ex.h.path, raw)
        proxy.relay(ex, up, resp)

    def upstream(self, ex: Exchange, t: Target, path: str, body: bytes):
        """POST `body` to `path` of member `t`: the connection and the reply's head.  A member that
        does not answer may have died since the table was read: then that is the error (503)."""
        up = proxy.Upstream(t, self.cfg.upstream_timeout, self.pool)
        headers = {"Content-Type": "application/json", **proxy.auth_header(ex, t, self.cfg.member_keys)}
        try:
            up.send("POST", path, body, headers)
        except proxy.Unreachable:
            self.table.members(fresh=True)
            self.table.resolve(t.name)   # MemberGone if it died
            raise
        try:
            return up, up.response(ex.client_gone)
        except BaseException:
            up.close()   # whatever failed: the connection is not left open (nor pooled)
            raise

    # -- the model list -----------------------------------------------------------

    def entry(self, t: Target, alias: str | None = None) -> dict:
        out = {"id": alias or t.name, "object": "model", "created": int(t.started), "owned_by": "vramd",
               "aliases": [] if alias else self.table.aliases_of(t),
               "status": {"value": t.state},
               "vramd": {"member": t.name, "file": t.model, "pid": t.pid, "endpoint": t.endpoint,
                         "device_bytes": t.device_bytes, "since": t.since}}
        if alias:
            out["alias_of"] = t.name
        return out

    def models_list(self) -> dict:
        # Read fresh (Table.named): UIs show the list as it is now.
        return {"object": "list", "data": [self.entry(t, name if alias else None)
                                           for name, t, alias in self.table.named()]}

    def model_route(self, ex: Exchange) -> None:
        """GET /v1/models/{id}: ex.rest is the id, URL-decoded (a prefix route of vramd/server/http.py)."""
        t = self.table.resolve(ex.rest)
        name = ex.rest.removesuffix(":latest")
        alias = name if name != t.name and (name in self.table.aliases or name in t.aliases) else None
        ex.reply(200, self.entry(t, alias))

    # -- the process ----------------------------------------------------------------

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT/SIGHUP; 0."""
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        got: list[int] = []

        def on_signal(signum, _frame):
            got.append(signum)
            os.write(wake_w, b"s")
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(s, on_signal)
        signal.set_wakeup_fd(wake_w)
        self.http.start()
        members = self.table.members()
        log.info("gateway: serving %s on %s (members: %s)", self.table.registry.dir.parent, self.http.url,
                 ", ".join(t.name for t in members) or "none yet")
        from vramd.server import systemd
        systemd.ready(f"gateway on {self.http.url}")
        while not got:
            select.select([wake_r], [], [], 1.0)
        log.info("gateway: signal %d, stopping", got[0])
        self.http.close()
        self.pool.close()
        return 0

