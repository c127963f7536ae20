"""A daemon's server-sent events as Ollama's NDJSON stream (/api/chat, /api/generate on the gateway).

One JSON object a line as each event arrives: text pieces (`message.content`
or `response`) with their logprobs, thinking pieces (the daemon's
`reasoning_content`: `message.thinking`, or `thinking` beside an empty
`response`, as Ollama streams them), the tool calls gathered from the
streamed deltas as one line once the stream ends (Ollama's shape: arguments
as objects), and last the `"done": true` line with the finish reason, the
token counts and the durations (`prompt_eval_duration`: until the first
piece).  A stream the daemon breaks off, or an event the gateway cannot
read, is an UpstreamError (502): its line `{"error": ...}` ends the stream.
So does the daemon's own late error: its headers went out at once, so a
failure after them (the GPU not free within --wake-timeout, any error on
its loop) comes as an event `{"error": {...}}` before `[DONE]`, and is
Ollama's mid-stream error line (what Ollama's own server sends; the
`ollama` client raises ResponseError with its message), never a "done".
"""

from __future__ import annotations

import json
import time

from vramd.errors import VramdError
from vramd.gateway import ollama
from vramd.server.http import Exchange


class UpstreamError(VramdError):
    """A member's own error (its status and message), or a reply the gateway cannot use."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.http_status = status


# The status a daemon's late error would have had (vramd/server/openai_api.py's error_body, by its
# "type"): the stream's status line said 200, the gateway's log says this.
STATUS_OF_TYPE = {"invalid_request_error": 400, "not_found_error": 404, "service_unavailable": 503}


def late_error(err, name: str) -> UpstreamError:
    """A daemon's error event (OpenAI's shape, or a bare string) as the UpstreamError it stands for."""
    if isinstance(err, dict):
        msg, status = err.get("message"), STATUS_OF_TYPE.get(err.get("type"), 500)
    else:
        msg, status = err, 500
    return UpstreamError(str(msg or f"model '{name}' failed while it streamed"), status)


class Stream:
    """A daemon's SSE stream, line by line, as Ollama's NDJSON stream."""

    def __init__(self, ex: Exchange, name: str, field: str, completion: bool):
        self.ex, self.name, self.field, self.completion = ex, name, field, completion
        self.calls: dict[int, dict] = {}
        self.finish, self.usage = None, None
        self.first: float | None = None

    def line(self, obj: dict) -> None:
        self.ex.send((json.dumps(obj) + "\n").encode())

    def piece(self, text: str, extra: dict | None = None, thinking: str = "") -> dict:
        out = {"model": self.name, "created_at": ollama.now_iso()}
        if self.field == "message":
            out["message"] = {"role": "assistant", "content": text, **({"thinking": thinking} if thinking else {})}
        else:
            out["response"] = text
            if thinking:
                out["thinking"] = thinking
        out.update(extra or {})
        return out

    def chunk(self, c: dict) -> None:
        if c.get("error"):
            raise late_error(c["error"], self.name)
        if c.get("usage"):
            self.usage = c["usage"]
        for ch in c.get("choices") or []:
            self.finish = ch.get("finish_reason") or self.finish
            thinking = ""
            if self.completion:
                text = ch.get("text") or ""
            else:
                delta = ch.get("delta") or {}
                text = delta.get("content") or ""
                thinking = delta.get("reasoning_content") or ""
                for tc in delta.get("tool_calls") or []:
                    acc = self.calls.setdefault(tc.get("index", 0), {"function": {"name": "", "arguments": ""}})
                    fn = tc.get("function") or {}
                    acc["function"]["name"] += fn.get("name") or ""
                    acc["function"]["arguments"] += fn.get("arguments") or ""
            lp = ollama.logprobs(ch.get("logprobs"))
            if text or thinking or lp:
                if self.first is None:
                    self.first = time.monotonic()
                self.line(self.piece(text, {"done": False, **({"logprobs": lp} if lp else {})}, thinking))

    def run(self, resp, member: str, up) -> None:
        """`up`: the proxy.Upstream, released once the member's stream was read to its end."""
        self.ex.start_stream("application/x-ndjson", 200, {"X-Vramd-Member": member})
        done = False
        while True:
            raw = resp.readline()
            if not raw:
                break
            raw = raw.strip()
            if not raw.startswith(b"data:"):
                continue   # blank separators and keep-alive comments
            data = raw[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            try:
                self.chunk(json.loads(data))
            except (ValueError, TypeError, AttributeError) as e:
                raise UpstreamError(f"member '{member}' sent an event the gateway cannot read: {e}", 502) from None
        if not done:
            raise UpstreamError(f"member '{member}' ended its stream before the end", 502)
        resp.read()    # the stream's last chunk, right behind [DONE]: then the connection can be reused
        up.release()
        calls = ollama.tool_calls([self.calls[i] for i in sorted(self.calls)])
        if calls:
            self.line({"model": self.name, "created_at": ollama.now_iso(),
                       "message": {"role": "assistant", "content": "", "tool_calls": calls}, "done": False})
        end = time.monotonic()
        first = self.first or end
        durations = {"total_duration": int((end - self.ex.started) * 1e9),
                     "prompt_eval_duration": int((first - self.ex.started) * 1e9),
                     "eval_duration": int((end - first) * 1e9)}
        self.line(self.piece("", ollama.final_fields(self.finish, self.usage, durations)))

