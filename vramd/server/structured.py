"""The structured-output and tool fields of a request: `response_format`, `tools`,
`tool_choice`, `parallel_tool_calls`, and the tool fields of messages.

Owns the wire validation of those fields (a bad one is a UsageError, a 400,
naming the field) into a `Structured` value, and `message_fields`: what a
message keeps beside role and content (an assistant's `tool_calls`, a tool
message's `tool_call_id` and `name`).  What a request then gets — the
template's variables, the grammar, how the output is parsed — is
vramd/server/tools.py's; the grammar machinery is vramd/engine/grammar.py's.

response_format:
    {"type": "text"}                      nothing constrained (the default)
    {"type": "json_object"}               any JSON object
    {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}
                                          JSON valid for `schema`, enforced token by token
                                          whatever `strict` says (vramd has no looser mode)
tool_choice: "auto" (the default with tools), "none", "required", or
{"type": "function", "function": {"name": ...}}.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from vramd.errors import UsageError

MAX_TOOLS = 128
MAX_SCHEMA_CHARS = 1 << 20
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")   # OpenAI's rule for function and schema names


@dataclass
class Structured:
    json_schema: dict | None = None       # what the answer must be (json_object: {"type": "object"})
    tools: list[dict] = field(default_factory=list)   # [{"type": "function", "function": {...}}]
    tool_choice: str = "none"             # auto | none | required | function
    function: str | None = None           # the named function of tool_choice
    parallel: bool = True

    @property
    def calls_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


def parse(body: dict, kind: str) -> Structured:
    out = Structured()
    out.json_schema = _response_format(body.get("response_format"))
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if kind != "chat":
        for key in ("tools", "tool_choice", "parallel_tool_calls"):
            if body.get(key) is not None:
                raise UsageError(f"'{key}' is for /v1/chat/completions, not /v1/completions")
        return out
    out.tools = _tools(tools)
    out.tool_choice, out.function = _tool_choice(choice, out.tools)
    if parallel is not None and not isinstance(parallel, bool):
        raise UsageError(f"'parallel_tool_calls' must be true or false, got {parallel!r}")
    out.parallel = True if parallel is None else parallel
    return out


def _response_format(rf) -> dict | None:
    if rf is None:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise UsageError("'response_format' must be an object with a 'type' (text, json_object or json_schema)")
    kind = rf["type"]
    extra = set(rf) - {"type", "json_schema"}
    if extra:
        raise UsageError(f"'response_format' has unknown fields: {', '.join(sorted(extra))}")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise UsageError(f"'response_format.type' {kind!r} is not supported: text, json_object or json_schema")
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise UsageError("'response_format.json_schema' must be an object with 'name' and 'schema'")
    unknown = set(spec) - {"name", "schema", "strict", "description"}
    if unknown:
        raise UsageError(f"'response_format.json_schema' has unknown fields: {', '.join(sorted(unknown))}")
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise UsageError("'response_format.json_schema.name' must be 1-64 letters, digits, '_', '-' or '.'")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise UsageError("'response_format.json_schema.strict' must be true or false")
    return _schema(spec.get("schema", {}), "response_format.json_schema.schema")


def _schema(schema, where: str) -> dict:
    if schema is True:
        return {}
    if not isinstance(schema, dict):
        raise UsageError(f"'{where}' must be a JSON schema object")
    if len(json.dumps(schema)) > MAX_SCHEMA_CHARS:
        raise UsageError(f"'{where}' is longer than {MAX_SCHEMA_CHARS} characters")
    return schema


def _tools(tools) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise UsageError(f"'tools' must be a list of at most {MAX_TOOLS} tools")
    out, names = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise UsageError(f"{where}: only tools of type 'function' are supported")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise UsageError(f"{where}.function must be an object")
        unknown = set(fn) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise UsageError(f"{where}.function has unknown fields: {', '.join(sorted(unknown))}")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise UsageError(f"{where}.function.name must be 1-64 letters, digits, '_', '-' or '.'")
        if name in names:
            raise UsageError(f"{where}: two tools are named {name!r}")
        names.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise UsageError(f"{where}.function.description must be a string")
        params = _schema(fn.get("parameters", {"type": "object", "properties": {}}), f"{where}.function.parameters")
        clean = {"name": name, "parameters": params}
        if fn.get("description"):
            clean["description"] = fn["description"]
        out.append({"type": "function", "function": clean})
    return out


def _tool_choice(choice, tools: list[dict]) -> tuple[str, str | None]:
    if choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise UsageError(f"'tool_choice' {choice!r}: auto, none, required or "
                             "{\"type\": \"function\", \"function\": {\"name\": ...}}")
        if choice == "required" and not tools:
            raise UsageError("'tool_choice' is 'required' but the request has no 'tools'")
        return choice, None
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise UsageError("'tool_choice' must name a function as {\"type\": \"function\", \"function\": {\"name\": ...}}")
    if name not in {t["function"]["name"] for t in tools}:
        raise UsageError(f"'tool_choice' names the function {name!r}, which is not among 'tools'")
    return "function", name


def message_fields(msg: dict, i: int) -> dict:
    """The tool fields of messages[i] the chat template gets, checked."""
    out: dict = {}
    calls = msg.get("tool_calls")
    if calls is not None:
        if msg["role"] != "assistant" or not isinstance(calls, list):
            raise UsageError(f"messages[{i}].tool_calls must be a list, on an assistant message")
        out["tool_calls"] = [_history_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(calls)]
    for key in ("tool_call_id", "name"):
        v = msg.get(key)
        if v is not None:
            if not isinstance(v, str):
                raise UsageError(f"messages[{i}].{key} must be a string")
            out[key] = v
    if msg["role"] == "tool" and "tool_call_id" not in out:
        raise UsageError(f"messages[{i}]: a tool message needs the 'tool_call_id' it answers")
    return out


def _history_call(call, where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise UsageError(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}")
    args = fn.get("arguments", "{}")
    if isinstance(args, dict):
        args = json.dumps(args, ensure_ascii=False)
    if not isinstance(args, str):
        raise UsageError(f"{where}.function.arguments must be a JSON string")
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out
