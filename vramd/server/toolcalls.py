"""Tool calls read out of a model's text as it streams (`ToolStream`), and whole (`parse`).

Owns the readers of the four formats vramd/server/tools.py names (hermes,
llama3, mistral, generic) and the OpenAI shape of a call.  `parse` is the
stream fed the whole text at once, so a non-streamed answer and the
concatenated deltas of a streamed one are the same calls by construction.

Streaming, as OpenAI and llama.cpp's server send it: the first delta of a
call carries its index, id, type, function name and `arguments: ""`, the
next ones append the arguments' text as it is generated.  The call's JSON
goes through vramd/server/jsonscan.py, which says where the name and the
`arguments` (`parameters` for llama3) value start and end: the name is sent
once it is whole, then the argument object's raw text as it grows (an
argument given as a JSON string, or a scalar, is sent when it ends).  The
arguments are the model's own text, not re-serialized: the non-streamed
answer has the same text.

What is not a call stays content, as llama.cpp's parsers leave it: text
before a marker (<tool_call>, [TOOL_CALLS]) is sent as it comes, except a
tail that could be the start of a marker (held back, as stop strings are);
from the marker on, text is held until the call's name is whole, and if the
JSON turns out to be no call (not an object, broken, no name), the held text
is content after all.  Once a call's name has been sent it stays a call: if
its JSON then breaks, or the generation ends inside it, the call keeps the
arguments sent so far and the rest is content again (`finish_reason` says
"length" for the cut-off case, as OpenAI does).

Per format: hermes, `<tool_call>{"name", "arguments"}</tool_call>`, any
number, content between; llama3, the answer is one `{"name", "parameters"}`
object if its first character is '{'; mistral, `[TOOL_CALLS]` then an array
of `{"name", "arguments", "id"}` (the id is vramd's own, 9 letters and digits
as Mistral's template demands of history ids: one written after the
arguments would come too late for the first delta); generic, the answer is
`{"tool_call": {...}}`, `{"tool_calls": [...]}` or `{"response": ...}`, a
response string streamed as content as it is decoded.
"""

from __future__ import annotations

import json
import secrets
import string
import uuid
from dataclasses import dataclass, field

from vramd.server.jsonscan import JsonScan

MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}
_HERMES_CLOSE = "</tool_call>"
_ARGS_KEYS = ("arguments", "parameters")
_ALNUM = string.ascii_letters + string.digits


def new_id(fmt: str) -> str:
    if fmt == "mistral":
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class Call:
    name: str
    arguments: str                 # a JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: new_id(""))

    def wire(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _is_call(fmt: str, path: tuple) -> bool:
    if fmt in ("hermes", "llama3"):
        return path == ()
    if fmt == "mistral":
        return path == () or (len(path) == 1 and isinstance(path[0], int))
    return path == ("tool_call",) or (len(path) == 2 and path[0] == "tool_calls" and isinstance(path[1], int))


@dataclass
class _Open:
    """One call in the JSON being read."""
    name: str | None = None
    name_at: int | None = None
    args_at: int | None = None      # where the arguments value starts in the JSON text
    args_end: int | None = None
    sent: int = 0                   # arguments characters sent
    index: int | None = None        # set when its first delta is sent
    ended: bool = False


class _Root:
    """One JSON value of calls (a hermes block, the mistral array, the llama3 or generic answer)."""

    def __init__(self, fmt: str):
        self.fmt, self.scan, self.text = fmt, JsonScan(), ""
        self.calls: dict[tuple, _Open] = {}
        self.committed = False
        self.broken = False             # a call object that is none (not an object, a name not a string)
        self.response: list | None = None   # generic: [start, end or None, characters sent]

    def feed(self, text: str, stream: "ToolStream", out: list[str]) -> int:
        n = self.scan.feed(text)
        self.text += text[:n]
        for kind, path, at in self.scan.events:
            self._event(kind, path, at)
        self.scan.events.clear()
        if self.committed:
            self._send(stream, out)
        return n

    def _event(self, kind: str, path: tuple, at: int) -> None:
        parent, last = path[:-1], (path[-1] if path else None)
        if kind == "start":
            if _is_call(self.fmt, path) and not (path == () and self.text[at] == "[" and self.fmt == "mistral"):
                if self.text[at] != "{":
                    self.broken = True
                self.calls[path] = _Open()
            elif parent in self.calls and last == "name":
                self.calls[parent].name_at = at
            elif parent in self.calls and last in _ARGS_KEYS and self.calls[parent].args_at is None:
                self.calls[parent].args_at = at
            elif self.fmt == "generic" and path == ("response",):
                self.response, self.committed = [at, None, 0], True
            return
        if self.response is not None and path == ("response",):
            self.response[1] = at
        if path in self.calls:
            self.calls[path].ended = True
        elif parent in self.calls and last == "name" and self.calls[parent].name_at is not None:
            name = json.loads(self.text[self.calls[parent].name_at:at])
            if isinstance(name, str) and self.calls[parent].name is None:
                self.calls[parent].name = name
                self.committed = True
            elif not isinstance(name, str):
                self.broken = True
        elif parent in self.calls and last in _ARGS_KEYS and self.calls[parent].args_end is None \
                and self.calls[parent].args_at is not None:
            self.calls[parent].args_end = at

    def _send(self, stream: "ToolStream", out: list[str]) -> None:
        end = self.scan.pos
        for c in self.calls.values():
            if c.name is None:
                continue
            if c.index is None:
                c.index = stream.open_call(c.name)
            if c.args_at is not None:
                raw = self.text[c.args_at:c.args_end if c.args_end is not None else end]
                if self.text[c.args_at] in "{[":
                    stream.append_args(c.index, raw[c.sent:])
                    c.sent = len(raw)
                elif c.args_end is not None and not c.sent:   # a string or scalar: sent whole
                    value = json.loads(raw)
                    stream.append_args(c.index, value if isinstance(value, str) else raw)
                    c.sent = len(raw)
            elif c.ended and not c.sent:
                stream.append_args(c.index, "{}")
                c.sent = 2
        if self.response is not None:
            start, stop, sent = self.response
            raw = self.text[start:stop if stop is not None else end]
            if raw.startswith('"'):
                text = json.loads(raw) if stop is not None else _partial_string(raw[1:])
            else:
                text = raw
            out.append(text[sent:])
            self.response[2] = len(text)


def _partial_string(body: str) -> str:
    """The decoded text of the start of a JSON string (after its opening quote), as far as it
    can be decoded: an escape cut in the middle, or half a surrogate pair, waits."""
    for cut in range(len(body), max(len(body) - 12, -1), -1):
        try:
            text = json.loads('"' + body[:cut] + '"')
        except ValueError:
            continue
        if text and "\ud800" <= text[-1] <= "\udbff":
            continue
        return text
    return ""


class ToolStream:
    """Streamed text in, (content text, tool_calls delta entries) out."""

    def __init__(self, fmt: str):
        self.fmt = fmt
        self.marker = MARKERS.get(fmt)
        self.mode = "lead" if fmt in ("llama3", "generic") else "text"
        self.pending = ""               # text not yet judged (a marker's possible start, a closing tag)
        self.held = ""                  # the marker and JSON so far, content if they are no call
        self.root: _Root | None = None
        self.calls = 0                  # calls opened so far
        self._deltas: dict[int, dict] = {}

    def open_call(self, name: str) -> int:
        index, self.calls = self.calls, self.calls + 1
        self._deltas[index] = {"index": index, "id": new_id(self.fmt), "type": "function",
                               "function": {"name": name, "arguments": ""}}
        return index

    def append_args(self, index: int, text: str) -> None:
        if text:
            d = self._deltas.setdefault(index, {"index": index, "function": {"arguments": ""}})
            d["function"]["arguments"] += text

    def feed(self, text: str) -> tuple[str, list[dict]]:
        out: list[str] = []
        self._run(self.pending + text, out)
        return "".join(out), self._take()

    def finish(self) -> tuple[str, list[dict]]:
        """What is left when the generation ends."""
        out: list[str] = []
        rest, self.pending = self.pending, ""
        if self.mode == "json":
            self.root.scan.finish()
            self.root.feed("", self, out)
            if not self.root.committed:
                out.append(self.held)
            self.root = None
        elif self.mode in ("text", "lead", "marker", "after"):
            out.append(self.held if self.mode == "marker" else "")
        out.append(rest)
        self.mode = "text"
        return "".join(out), self._take()

    def _take(self) -> list[dict]:
        deltas, self._deltas = list(self._deltas.values()), {}
        return deltas

    def _run(self, buf: str, out: list[str]) -> None:
        self.pending = ""
        while buf:
            if self.mode == "lead":
                lead = buf.lstrip()
                if not lead:
                    self.pending = buf
                    return
                if lead[0] == "{":
                    self.mode, self.held, self.root = "json", buf[:len(buf) - len(lead)], _Root(self.fmt)
                    buf = lead
                else:
                    self.mode = "plain"
            elif self.mode == "plain":
                out.append(buf)
                return
            elif self.mode == "text":
                if self.marker is None:
                    out.append(buf)
                    return
                at = buf.find(self.marker)
                if at < 0:
                    hold = next((n for n in range(min(len(buf), len(self.marker) - 1), 0, -1)
                                 if self.marker.startswith(buf[-n:])), 0)
                    out.append(buf[:len(buf) - hold])
                    self.pending = buf[len(buf) - hold:]
                    return
                out.append(buf[:at])
                self.mode, self.held = "marker", self.marker
                buf = buf[at + len(self.marker):]
            elif self.mode == "marker":      # after the marker: spaces, then the JSON
                lead = buf.lstrip()
                self.held += buf[:len(buf) - len(lead)]
                if not lead:
                    return
                if lead[0] not in ("{[" if self.fmt == "mistral" else "{"):
                    buf = self._fail(lead, out)
                    continue
                self.mode, self.root, buf = "json", _Root(self.fmt), lead
            elif self.mode == "json":
                root = self.root
                n = root.feed(buf, self, out)
                self.held += buf[:n]
                if root.scan.error or root.broken or (root.scan.done and not root.committed):
                    if not root.committed:
                        buf = self._fail(buf[n:], out)
                        continue
                    # a call was sent and its JSON broke: the rest is content again
                    self.mode, self.root, self.held = ("text" if self.marker else "plain"), None, ""
                    buf = buf[n:]
                elif root.scan.done:
                    self.root, self.held = None, ""
                    self.mode = "after" if self.fmt == "hermes" else ("text" if self.marker else "plain")
                    buf = buf[n:]
                else:
                    return
            elif self.mode == "after":       # hermes: the closing tag, if the model writes it
                lead = buf.lstrip()
                if lead.startswith(_HERMES_CLOSE):
                    self.mode, buf = "text", lead[len(_HERMES_CLOSE):]
                elif _HERMES_CLOSE.startswith(lead):
                    self.pending = buf
                    return
                else:
                    self.mode = "text"

    def _fail(self, rest: str, out: list[str]) -> str:
        """The held text was no call: it is content; what follows the marker is read again."""
        held, self.held, self.root = self.held, "", None
        if self.marker is None:            # llama3, generic: the whole answer is text
            self.mode = "plain"
            out.append(held)
            return rest
        self.mode = "text"
        out.append(self.marker)
        return held[len(self.marker):] + rest


def parse(fmt: str, text: str) -> tuple[str, list[Call]]:
    """(content, calls) of a whole answer in format `fmt`: the stream, fed it at once."""
    stream = ToolStream(fmt)
    content, deltas = stream.feed(text)
    rest, more = stream.finish()
    calls: dict[int, Call] = {}
    for d in deltas + more:
        if "id" in d:
            calls[d["index"]] = Call(d["function"]["name"], "", d["id"])
        calls[d["index"]].arguments += d["function"]["arguments"]
    return (content + rest).strip(), [calls[i] for i in sorted(calls)]
