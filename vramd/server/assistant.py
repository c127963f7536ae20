"""What a chat answer's text becomes: the OpenAI message's `content`, `reasoning_content`
and `tool_calls`, whole (`message`) or as stream deltas (`Assistant`).

Owns the pipeline text -> reasoning split (vramd/server/reasoning.py) -> tool
calls (vramd/server/toolcalls.py) -> content, and the trimming of the two
texts: leading spaces dropped, trailing spaces held back until more text
follows (and dropped at the end), so that the deltas of a stream add up to
exactly the non-streamed message (which `message` builds by feeding the same
pipeline the whole text).  Requests with neither tools nor a reasoning split
never come here: their text is sent as generated.

Does not own the chunk and response envelopes (vramd/server/openai_api.py).
"""

from __future__ import annotations

from vramd.server.harmony import HarmonySplit
from vramd.server.reasoning import Reasoning, ReasoningSplit
from vramd.server.toolcalls import ToolStream


class _Trim:
    def __init__(self):
        self.started, self.spaces = False, ""

    def feed(self, text: str, final: bool) -> str:
        if not self.started:
            text = text.lstrip()
            if not text:
                return ""
            self.started = True
        text = self.spaces + text
        body = text.rstrip()
        self.spaces = "" if final else text[len(body):]
        return body


class Assistant:
    """Streamed text in, delta fields out (content, reasoning_content, tool_calls)."""

    def __init__(self, tool_format: str | None, reasoning: Reasoning | None):
        self.split = (None if reasoning is None else
                      HarmonySplit(inline=reasoning.inline, calls=tool_format == "harmony") if reasoning.harmony
                      else ReasoningSplit(reasoning.open))
        # harmony's calls are messages of their own: HarmonySplit reads them (vramd/server/harmony.py)
        self.tools = ToolStream(tool_format) if tool_format and tool_format != "harmony" else None
        self.content, self.thought = _Trim(), _Trim()

    @property
    def calls(self) -> int:
        """Tool calls opened so far."""
        if isinstance(self.split, HarmonySplit):
            return self.split.n_calls
        return self.tools.calls if self.tools is not None else 0

    def feed(self, text: str, final: bool = False) -> dict:
        thought, rest = self.split.feed(text) if self.split is not None else ("", text)
        if final and self.split is not None:
            more_thought, more_rest = self.split.finish()
            thought, rest = thought + more_thought, rest + more_rest
        deltas: list[dict] = []
        if self.tools is not None:
            rest, deltas = self.tools.feed(rest)
            if final:
                tail, more = self.tools.finish()
                rest, deltas = rest + tail, _merge(deltas + more)
        if isinstance(self.split, HarmonySplit):
            deltas = self.split.take_calls()
        out: dict = {}
        thought, rest = self.thought.feed(thought, final), self.content.feed(rest, final)
        if thought:
            out["reasoning_content"] = thought
        if rest:
            out["content"] = rest
        if deltas:
            out["tool_calls"] = deltas
        return out


def _merge(deltas: list[dict]) -> list[dict]:
    """Deltas of one chunk, one entry per call index (arguments joined)."""
    out: dict[int, dict] = {}
    for d in deltas:
        if d["index"] in out:
            out[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
        else:
            out[d["index"]] = {**d, "function": dict(d["function"])}
    return list(out.values())


def message(tool_format: str | None, reasoning: Reasoning | None, text: str) -> dict:
    """The message fields of the whole answer `text` (content None when there are calls and
    no text, as OpenAI sends it)."""
    fields = Assistant(tool_format, reasoning).feed(text, final=True)
    calls = [{"id": d["id"], "type": "function", "function": d["function"]} for d in fields.get("tool_calls", [])]
    out: dict = {"content": fields.get("content", "") or (None if calls else "")}
    if reasoning is not None and "reasoning_content" in fields:
        out["reasoning_content"] = fields["reasoning_content"]
    if calls:
        out["tool_calls"] = calls
    return out
