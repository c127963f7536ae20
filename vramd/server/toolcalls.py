"""Tool calls read out of a model's text, whole (`parse`) or as it streams (`ToolStream`).

Owns the parsers of the four formats vramd/server/tools.py names (hermes,
llama3, mistral, generic) and the OpenAI shape of a call.  What is not a
well-formed call stays content, as llama.cpp's parsers leave it: a model
that writes half a <tool_call> and stops has written text.

Streaming: content is sent as it comes, except a tail that could be the
start of a call's marker (held back, as stop strings are); from the marker
on, text is kept until a call is complete, and each complete call is sent
as one `tool_calls` delta (index, id, type, name and its whole arguments),
which the openai SDK's stream accumulation reads as it reads OpenAI's.  The
llama3 format's call is the whole answer (its first character is '{') and
the generic format's answer is one JSON object: both are sent when the
generation ends.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_HERMES_OPEN = "<tool_call>"
_MISTRAL = "[TOOL_CALLS]"
_decoder = json.JSONDecoder()


@dataclass
class Call:
    name: str
    arguments: str                 # a JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def wire(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def delta(self, index: int) -> dict:
        return {"index": index, **self.wire()}


def _call(obj, args_keys=("arguments", "parameters")) -> Call | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = next((k for k in args_keys if k in obj), None)
    args = obj.get(key, {}) if key else {}
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    call = Call(obj["name"], text)
    if isinstance(obj.get("id"), str) and obj["id"]:
        call.id = obj["id"]
    return call


def _json_prefix(text: str):
    """(value, end) of the JSON value at the start of `text` (after spaces), or (None, 0)."""
    start = len(text) - len(text.lstrip())
    try:
        value, end = _decoder.raw_decode(text, start)
        return value, end
    except ValueError:
        return None, 0


def _hermes(text: str, final: bool) -> tuple[str, list[Call]]:
    calls, content, pos = [], [], 0
    for m in _HERMES_BLOCK.finditer(text):
        value, end = _json_prefix(m.group(1))
        call = _call(value) if end and not m.group(1)[end:].strip() else None
        if call is None:
            continue           # not a call: left as content
        content.append(text[pos:m.start()])
        calls.append(call)
        pos = m.end()
    rest = text[pos:]
    at = rest.find(_HERMES_OPEN)
    if final and at >= 0:      # an unclosed last call (the generation ended after its JSON)
        value, end = _json_prefix(rest[at + len(_HERMES_OPEN):])
        call = _call(value) if end else None
        if call is not None and not rest[at + len(_HERMES_OPEN) + end:].strip():
            calls.append(call)
            rest = rest[:at]
    content.append(rest)
    return "".join(content).strip(), calls


def _llama3(text: str) -> tuple[str, list[Call]]:
    value, end = _json_prefix(text)
    call = _call(value) if end and isinstance(value, dict) and ("parameters" in value or "arguments" in value) else None
    if call is None:
        return text, []
    return text[end:].strip(), [call]


def _mistral(text: str) -> tuple[str, list[Call]]:
    at = text.find(_MISTRAL)
    if at < 0:
        return text, []
    value, end = _json_prefix(text[at + len(_MISTRAL):])
    items = value if isinstance(value, list) else [value] if isinstance(value, dict) else None
    calls = [_call(v) for v in items] if items else []
    if not calls or any(c is None for c in calls):
        return text, []
    return (text[:at] + text[at + len(_MISTRAL) + end:]).strip(), calls


def _generic(text: str) -> tuple[str, list[Call]]:
    value, end = _json_prefix(text)
    if not end or not isinstance(value, dict):
        return text, []
    if isinstance(value.get("tool_calls"), list):
        calls = [_call(v) for v in value["tool_calls"]]
        if calls and all(calls):
            return "", calls
    if isinstance(value.get("tool_call"), dict):
        call = _call(value["tool_call"])
        if call:
            return "", [call]
    if "response" in value:
        r = value["response"]
        return (r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)), []
    return text, []


def parse(fmt: str, text: str, final: bool = True) -> tuple[str, list[Call]]:
    """(content, calls) of a whole answer in format `fmt`."""
    if fmt == "hermes":
        return _hermes(text, final)
    if fmt == "llama3":
        return _llama3(text)
    if fmt == "mistral":
        return _mistral(text)
    return _generic(text)


class ToolStream:
    """Turns streamed text into (content delta, newly complete calls)."""

    def __init__(self, fmt: str):
        self.fmt = fmt
        self.marker = {"hermes": _HERMES_OPEN, "mistral": _MISTRAL}.get(fmt)
        self.in_calls = fmt == "generic"   # the whole answer is the JSON object
        self.buf = ""                      # text from the marker on
        self.held = ""                     # content held back (a marker's possible start)
        self.sent = 0                      # calls sent so far

    def feed(self, text: str) -> tuple[str, list[Call]]:
        if self.in_calls:
            self.buf += text
            return "", self._complete()
        buf = self.held + text
        if self.fmt == "llama3":
            lead = buf.lstrip()
            if not lead:
                self.held = buf
                return "", []
            self.held = ""
            if lead[0] == "{":
                self.in_calls, self.buf = True, buf
                return "", []
            self.fmt = "content"           # it began with text: it is not a call
            return buf, []
        if self.marker is None:
            return buf, []
        at = buf.find(self.marker)
        if at >= 0:
            self.held, self.in_calls, self.buf = "", True, buf[at:]
            return buf[:at], self._complete()
        hold = next((n for n in range(min(len(buf), len(self.marker) - 1), 0, -1)
                     if self.marker.startswith(buf[-n:])), 0)
        self.held = buf[len(buf) - hold:]
        return buf[:len(buf) - hold], []

    def _complete(self) -> list[Call]:
        if self.fmt != "hermes":
            return []
        calls = _hermes(self.buf, final=False)[1]
        new, self.sent = calls[self.sent:], len(calls)
        return new

    def finish(self) -> tuple[str, list[Call]]:
        """What is left when the generation ends."""
        if not self.in_calls:
            held, self.held = self.held, ""
            return held, []
        content, calls = parse(self.fmt, self.buf)
        new, self.sent = calls[self.sent:], max(self.sent, len(calls))
        return content, new
