"""What a chat template can render, and tool messages rewritten for one that cannot.

Owns `Capabilities` (found once per template by rendering probe messages,
as llama.cpp's minja does: does the template use `tools`, render an
assistant's `tool_calls`, a `tool` message; does it
want tool-call arguments as objects; does it refuse call ids that are not 9
characters, as Mistral's do; does it take a tool-call turn's content null, as
OpenAI sends it, or only "" (Qwen3's tests `'</think>' in message.content`,
where DeepSeek-R1's renders the calls only for null: minja's
requires_non_null_content) and `adapt(messages, extra, caps)`, minja's
polyfills for what it lacks:

- a null content becomes "" for a template that cannot take null;

- tools a template does not describe go into the system message, as JSON;
- an assistant's tool calls a template does not render become its content,
  `{"tool_calls": [{"name", "arguments", "id"}]}`;
- a tool message a template does not render becomes a user message,
  `{"tool_response": {"tool", "content", "tool_call_id"}}` (and consecutive
  user messages are joined, for templates that insist on alternation,
  Gemma's among them);
- for a template that takes only 9-character call ids (Mistral's raise
  "Tool call IDs should be alphanumeric strings with length 9!"), every
  other id in the history (another server's `call_...`) becomes 9 letters
  and digits derived from it, the same in the call and in its answer.
A template's refusal of anything else (a system message, roles out of
order) stays its refusal, a 400: these polyfills are for tool messages only.

Templates that render them natively (Qwen3's, Llama 3.1's, Mistral's tool
templates) get the messages untouched.  Does not own the template itself
(vramd/engine/chat.py) nor the request's wire format (vramd/server).
"""

from __future__ import annotations

import hashlib
import json
import re
import string
from dataclasses import dataclass

_TOOL = {"type": "function", "function": {"name": "vramd_probe_tool", "description": "probe",
                                          "parameters": {"type": "object", "properties": {"vramd_arg": {"type": "string"}}}}}
_ARGS = {"vramd_arg": "vramd_value"}
_ALNUM = string.ascii_letters + string.digits


_PROBE_ID = "vramdcall"     # 9 letters: Mistral's templates refuse any other length


def _call(args, id_: str = _PROBE_ID) -> dict:
    return {"id": id_, "type": "function", "function": {"name": "vramd_probe_call", "arguments": args}}


@dataclass(frozen=True)
class Capabilities:
    tools: bool = True
    tool_calls: bool = True
    tool_responses: bool = True
    object_arguments: bool = False
    nine_char_ids: bool = False
    null_content: bool = True     # renders an assistant turn of calls only with content None

    @classmethod
    def probe(cls, render, source: str = "") -> "Capabilities":
        """`render(messages, **extra) -> str` of one template (`source`: its text); a probe
        that fails counts as the capability missing."""
        def out(messages, **extra) -> str:
            try:
                return render(messages, **extra)
            except Exception:   # the template's own refusal, whatever its kind: not supported
                return ""
        user = {"role": "user", "content": "vramd_user"}
        # A template that reads `tools` at all is left to do with them what it does.
        tools = "vramd_probe_tool" in out([user], tools=[_TOOL]) or re.search(r"\btools\b", source) is not None

        def calls(content):
            return (out([user, {"role": "assistant", "content": content, "tool_calls": [_call(json.dumps(_ARGS))]}]),
                    out([user, {"role": "assistant", "content": content, "tool_calls": [_call(_ARGS)]}]))
        text_args, obj_args = calls(None)
        null_content = "vramd_probe_call" in text_args or "vramd_probe_call" in obj_args
        content = None if null_content else ""
        if not null_content:
            text_args, obj_args = calls("")
        tool_calls = "vramd_probe_call" in text_args or "vramd_probe_call" in obj_args
        # Arguments rendered with their quotes escaped ("{\"vramd_arg\"...") mean the template
        # dumps what it gets: it wants an object (Llama 3.1's `| tojson`).
        object_arguments = tool_calls and '"vramd_arg"' not in text_args and '"vramd_arg"' in obj_args
        history = [user, {"role": "assistant", "content": content,
                          "tool_calls": [_call(_ARGS if object_arguments else json.dumps(_ARGS))]}] \
            if tool_calls else [user, {"role": "assistant", "content": "vramd_answer"}]
        tool_responses = "vramd_tool_said" in out(
            history + [{"role": "tool", "tool_call_id": _PROBE_ID, "name": "vramd_probe_call",
                        "content": "vramd_tool_said"}])
        longer = [user, {"role": "assistant", "content": content,
                         "tool_calls": [_call(_ARGS if object_arguments else json.dumps(_ARGS), "call_" + _PROBE_ID)]}]
        nine = tool_calls and "vramd_probe_call" not in out(longer)
        return cls(tools, tool_calls, tool_responses, object_arguments, nine, null_content or not tool_calls)


def needs_adapting(messages: list[dict], extra: dict) -> bool:
    return bool(extra.get("tools")) or any(
        m.get("tool_calls") or m["role"] == "tool" for m in messages)


def adapt(messages: list[dict], extra: dict, caps: Capabilities) -> list[dict]:
    """The messages as this template can render them (copies; the input is not changed)."""
    out = [dict(m) for m in messages]
    tools = extra.get("tools")
    if tools and not caps.tools:
        text = ("You can call any of the following tools to satisfy the user's requests: "
                + json.dumps(tools, indent=2, ensure_ascii=False))
        out = _add_system(out, text)
    if caps.nine_char_ids:
        out = [_nine_char_ids(m) for m in out]
    for m in out:
        if m.get("content") is None and not caps.null_content:
            m["content"] = ""
        if m.get("tool_calls"):
            if not caps.tool_calls:
                calls = [{"name": c["function"]["name"], "arguments": _as_object(c["function"]["arguments"]),
                          **({"id": c["id"]} if c.get("id") else {})} for c in m.pop("tool_calls")]
                body = json.dumps({"tool_calls": calls}, indent=2, ensure_ascii=False)
                m["content"] = (m["content"] + "\n\n" + body) if m.get("content") else body
            elif caps.object_arguments:
                m["tool_calls"] = [{**c, "function": {**c["function"],
                                                      "arguments": _as_object(c["function"]["arguments"])}}
                                   for c in m["tool_calls"]]
        if m["role"] == "tool" and not caps.tool_responses:
            response = {"tool": m.pop("name", None) or "", "content": m.get("content") or "",
                        "tool_call_id": m.pop("tool_call_id", None) or ""}
            m.update(role="user", content=json.dumps({"tool_response": response}, indent=2, ensure_ascii=False))
    if not caps.tool_responses:
        out = _join_users(out)
    return out


def _nine(id_: str) -> str:
    if len(id_) == 9 and id_.isalnum() and id_.isascii():
        return id_
    digest = hashlib.sha256(id_.encode()).digest()
    return "".join(_ALNUM[b % len(_ALNUM)] for b in digest[:9])


def _nine_char_ids(m: dict) -> dict:
    if m.get("tool_calls"):
        m = {**m, "tool_calls": [{**c, "id": _nine(c.get("id") or "")} for c in m["tool_calls"]]}
    if m["role"] == "tool" and m.get("tool_call_id") is not None:
        m = {**m, "tool_call_id": _nine(m["tool_call_id"])}
    return m


def _add_system(messages: list[dict], text: str) -> list[dict]:
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0])
        first["content"] = (first.get("content") or "") + "\n\n" + text
        return [first] + messages[1:]
    return [{"role": "system", "content": text}] + messages


def add_system(messages: list[dict], text: str) -> list[dict]:
    """`text` added to the system message (one is made first when there is none)."""
    return _add_system([dict(m) for m in messages], text)


def _join_users(messages: list[dict]) -> list[dict]:
    out: list[dict] = []
    for m in messages:
        if out and m["role"] == "user" == out[-1]["role"] and isinstance(m.get("content"), str) \
                and isinstance(out[-1].get("content"), str):
            out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + m["content"]}
        else:
            out.append(m)
    return out


def _as_object(arguments):
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments
