"""Ollama's /api/* routes on the gateway: each request mapped (ollama.py) onto a daemon's OpenAI API.

    GET  /                 "Ollama is running" (what Ollama clients probe)
    GET  /api/version      the Ollama API level this subset follows
    GET  /api/tags         every member (and alias), as Ollama lists installed models
    GET  /api/ps           the members whose buffers are on the device (warm or parked)
    POST /api/show         one model's details (details.py)
    POST /api/chat         -> /v1/chat/completions
    POST /api/generate     -> /v1/chat/completions, or /v1/completions with raw or suffix
    POST /api/embed        -> /v1/embeddings
    POST /api/embeddings   -> /v1/embeddings (Ollama's older route: one prompt, one vector)

A request with keep_alive 0, and a load request (no prompt, messages or
input), ask the member to unload or load over its control socket
(residency.py).

Streams are NDJSON (one JSON object a line, `"done": true` last), made
from the daemon's server-sent events as each arrives; `"stream": false`
gives one object.  Errors are Ollama's shape, `{"error": "..."}`, with the
status the daemon or the gateway gave.
"""

from __future__ import annotations

import json
import time

from vramd.errors import UsageError, VramdError
from vramd.gateway import ollama
from vramd.gateway.details import Details
from vramd.gateway.ollama_stream import Stream, UpstreamError
from vramd.gateway.residency import Residency, unload_asked
from vramd.gateway.table import Target
from vramd.server.http import Exchange

API_VERSION = "0.12.0"   # clients compare it with the least version they need: the API level mirrored here


def routes(gw) -> dict:
    r = OllamaRoutes(gw)
    return {("GET", "/"): root,
            ("GET", "/api/version"): lambda ex: ex.reply(200, {"version": API_VERSION}),
            ("GET", "/api/tags"): lambda ex: ex.reply(200, r.tags(ex)),
            ("GET", "/api/ps"): lambda ex: ex.reply(200, r.ps(ex)),
            ("POST", "/api/show"): r.wrap(r.show),
            ("POST", "/api/chat"): r.wrap(lambda ex, body: r.generation(ex, body, "/api/chat", "message")),
            ("POST", "/api/generate"): r.wrap(lambda ex, body: r.generation(ex, body, "/api/generate", "response")),
            ("POST", "/api/embed"): r.wrap(lambda ex, body: r.embed(ex, body, legacy=False)),
            ("POST", "/api/embeddings"): r.wrap(lambda ex, body: r.embed(ex, body, legacy=True))}


class NoRoute(VramdError):
    http_status = 404


def root(ex: Exchange) -> None:
    """GET /: what Ollama clients probe.  A path ending in "/" is a prefix route in vramd/server/http.py:
    any other GET path not routed lands here, and is the 404 it would be without this route."""
    if ex.rest:
        raise NoRoute(f"GET {ex.path}: no such route")
    ex.reply(200, b"Ollama is running", "text/plain; charset=utf-8")


class OllamaRoutes:
    def __init__(self, gw):
        self.gw = gw
        self.details = Details(gw.cfg.member_keys)
        self.residency = Residency(gw.cfg.upstream_timeout)

    def wrap(self, fn):
        """A POST route: the JSON body in, any vramd error out as Ollama's {"error": "..."}."""
        from vramd.gateway.server import read_json

        def route(ex: Exchange) -> None:
            try:
                _raw, body = read_json(ex)
                fn(ex, body)
            except VramdError as e:
                if ex.streaming:   # the status line said 200: the error is the stream's last line
                    ex.error = str(e)
                    ex.fields["error_status"] = getattr(e, "http_status", 500)
                    ex.send((json.dumps({"error": str(e)}) + "\n").encode())
                    return
                ex.reply(getattr(e, "http_status", 500), {"error": str(e)})
        return route

    # -- the model list -------------------------------------------------------------

    def _model(self, ex: Exchange, t: Target, name: str) -> dict:
        d = self.details.of(t, ex.h.headers.get("Authorization"))
        return {"name": name, "model": name,
                "modified_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t.started)),
                "size": d.get("size") or t.weights_bytes, "digest": d.get("digest", ""),
                "details": {"parent_model": "", "format": "gguf", "family": d.get("architecture", ""),
                            "families": [d["architecture"]] if d.get("architecture") else None,
                            "parameter_size": d.get("parameter_size", ""),
                            "quantization_level": d.get("quantization", "")}}

    def tags(self, ex: Exchange) -> dict:
        return {"models": [self._model(ex, t, name) for name, t, _alias in self.gw.table.named()]}

    def ps(self, ex: Exchange) -> dict:
        out = []
        for name, t, _alias in self.gw.table.named():
            if t.device_bytes > 0:
                m = self._model(ex, t, name)
                d = self.details.of(t, None)
                m.update({"size_vram": t.device_bytes, "context_length": d.get("context_length"),
                          "vramd_state": t.state})
                out.append(m)
        return {"models": out}

    def show(self, ex: Exchange, body: dict) -> None:
        name = body.get("model") or body.get("name")
        if not isinstance(name, str) or not name:
            raise UsageError("'model' is required")
        t = self.gw.table.resolve(name)
        d = self.details.of(t, ex.h.headers.get("Authorization"))
        m = self._model(ex, t, name)
        info = dict(d.get("model_info") or {})
        if d.get("context_length"):
            info[f"{d.get('architecture', 'model')}.context_length"] = d["context_length"]
        ex.reply(200, {"modelfile": f"# served by vramd member {t.name}\nFROM {d.get('path') or t.model}\n",
                       "parameters": "", "template": d.get("template", ""), "details": m["details"],
                       "model_info": info, "capabilities": ["completion"], "modified_at": m["modified_at"]})

    # -- generation -----------------------------------------------------------------

    def _call(self, ex: Exchange, t: Target, path: str, payload: dict):
        up, resp = self.gw.upstream(ex, t, path, json.dumps(payload).encode())
        if resp.status != 200:
            data = resp.read()
            up.release()
            try:
                err = json.loads(data)["error"]
                msg = err.get("message") if isinstance(err, dict) else str(err)
            except (ValueError, KeyError, TypeError, AttributeError):
                msg = data.decode("utf-8", "replace")[:500]
            if resp.status == 404 and "no such route" in (msg or ""):
                raise UpstreamError(f"member '{t.name}' does not serve {path} (its vramd is older)", 501)
            raise UpstreamError(msg or f"member '{t.name}' answered {resp.status}", resp.status)
        return up, resp

    def _target(self, ex: Exchange, body: dict) -> tuple[Target, str]:
        """The member the request names, and the name to answer with (the client's)."""
        t = self.gw.target(body.get("model"))
        ex.fields["member"] = t.name
        return t, body.get("model") or t.name

    def _load(self, ex: Exchange, t: Target, unload: bool, reply: dict) -> None:
        """A load request: the member woken, or (keep_alive 0) made cold with its memory freed; then `reply`."""
        if unload:
            self.residency.unload(t)
        else:
            self.residency.load(t)
        ex.fields["residency"] = "unload" if unload else "load"
        ex.reply(200, reply)

    def generation(self, ex: Exchange, body: dict, route: str, field: str) -> None:
        unload = unload_asked(body)
        load = ollama.load_request(body, route)
        path, payload = (None, None) if load else \
            (ollama.chat_request if route == "/api/chat" else ollama.generate_request)(body)
        t, name = self._target(ex, body)
        if load:
            done = {"message": {"role": "assistant", "content": ""}} if field == "message" else {"response": ""}
            self._load(ex, t, unload, {"model": name, "created_at": ollama.now_iso(), **done, "done": True,
                                       "done_reason": "unload" if unload else "load"})
            return
        payload["model"] = t.name
        with self.residency.unload_after(ex, t, unload):
            up, resp = self._call(ex, t, path, payload)
            try:
                if payload["stream"]:
                    Stream(ex, name, field, path == "/v1/completions").run(resp, t.name, up)
                else:
                    r = json.loads(resp.read())
                    up.release()
                    self._whole(ex, name, field, r)
            finally:
                up.close()

    def _whole(self, ex: Exchange, name: str, field: str, r: dict) -> None:
        choice = r["choices"][0]
        out = {"model": name, "created_at": ollama.now_iso()}
        if "message" in choice:
            text = choice["message"].get("content") or ""
            calls = ollama.tool_calls(choice["message"].get("tool_calls"))
            thinking = choice["message"].get("reasoning_content")   # vramd/server/reasoning.py's split
        else:
            text, calls, thinking = choice.get("text") or "", None, None
        if field == "message":
            out["message"] = {"role": "assistant", "content": text, **({"thinking": thinking} if thinking else {}),
                              **({"tool_calls": calls} if calls else {})}
        else:
            out["response"] = text
            if thinking:
                out["thinking"] = thinking
        lp = ollama.logprobs(choice.get("logprobs"))
        if lp is not None:
            out["logprobs"] = lp
        dur = {"total_duration": int((time.monotonic() - ex.started) * 1e9)}
        out.update(ollama.final_fields(choice.get("finish_reason"), r.get("usage"), dur))
        ex.reply(200, out)

    def embed(self, ex: Exchange, body: dict, legacy: bool) -> None:
        unload = unload_asked(body)
        payload = (ollama.embeddings_request if legacy else ollama.embed_request)(body)
        t, name = self._target(ex, body)
        if payload is None:   # no input: Ollama's load request
            self._load(ex, t, unload, {"embedding": []} if legacy else {"model": name, "embeddings": []})
            return
        payload["model"] = t.name
        with self.residency.unload_after(ex, t, unload):
            try:
                up, resp = self._call(ex, t, "/v1/embeddings", payload)
            except UpstreamError as e:
                if e.http_status == 400 and "(--ctx)" in str(e) and not legacy and body.get("truncate") is not False:
                    raise UpstreamError(f"{e}; 'truncate' (Ollama's default: true) cannot be done: vramd never "
                                        "cuts an embedding input (send shorter inputs)", 400) from None
                raise
            try:
                r = json.loads(resp.read())
                up.release()
            finally:
                up.close()
            vectors = [d["embedding"] for d in sorted(r.get("data") or [], key=lambda d: d.get("index", 0))]
            if legacy:
                ex.reply(200, {"embedding": vectors[0]})
            else:
                ex.reply(200, {"model": name, "embeddings": vectors,
                               "total_duration": int((time.monotonic() - ex.started) * 1e9),
                               "prompt_eval_count": (r.get("usage") or {}).get("prompt_tokens")})
