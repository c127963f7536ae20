"""What a chat request with tools or a response_format gets: the template's variables,
the messages, the grammar its tokens must follow, and how its output is read.

Owns `detect` (the tool-call format of a chat template, chosen from the
template's source as llama.cpp's common/chat.cpp does) and `plan` (run by
vramd/server/prompts.py before the request is queued: a bad schema or a
feature llguidance cannot enforce is a 400 then, costing the GPU nothing).

Formats (llama.cpp's names in brackets):
    hermes   [Hermes 2 Pro]  the template mentions <tool_call> (Qwen 2.5, Qwen3,
             Hermes): <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>
    llama3   [Llama 3.x]     it has the ipython header (Llama 3.1-3.3): the answer
             is a JSON object {"name": ..., "parameters": {...}}; the template gets
             date_string and tools_in_user_message=false as llama.cpp passes them
    mistral  [Mistral Nemo]  it mentions [TOOL_CALLS]: [TOOL_CALLS][{"name",
             "arguments", "id"}] (the marker is a control token: decoded as text)
    generic  [Generic]       anything else, Gemma's templates included (llama.cpp
             has no Gemma format and uses this one): a system line asks for JSON,
             {"tool_call": {"name", "arguments"}} or {"response": "..."}, and the
             whole answer is constrained to that, with tool_choice auto too, as
             llama.cpp does.  A request with both tools and a json response_format
             uses it as llama.cpp does (the "response" must follow the schema).
tool_choice: auto in a native format is llama.cpp's lazy grammar (`_lazy`): the
text is free until the format's trigger (<tool_call>, [TOOL_CALLS], an answer
starting {"name"), then a call of one of the request's tools, valid for its
`parameters`, and with parallel_tool_calls false exactly one call, then only the
end of generation; required and a named function constrain the whole answer to
calls; none shows the tools and parses nothing.
    harmony  [GPT-OSS]       the template writes channels (gpt-oss): calls and a
             response_format's JSON in the model's own channels, the analysis
             channel free first (vramd/server/harmony_grammar.py).
`plan` also sets the request's reasoning split (vramd/server/reasoning.py):
under a <think> block the template's prompt opened, a grammar starts with
"</think>" so that the constrained JSON is the answer, not the thought.
"""

from __future__ import annotations

import json
import time

from vramd.engine import grammar as g
from vramd.engine.chat_polyfill import add_system
from vramd.errors import UsageError
from vramd.server import harmony_grammar, reasoning
from vramd.server.harmony import is_harmony

GENERIC_PROMPT = ("Respond in JSON format, either with `tool_call` (a request to call tools) or with "
                  "`response` reply to the user's request")


def detect(template) -> str:
    src = template.source if template is not None else ""
    if is_harmony(template):
        return "harmony"
    if "<tool_call>" in src:
        return "hermes"
    if "<|start_header_id|>ipython<|end_header_id|>" in src:
        return "llama3"
    if "[TOOL_CALLS]" in src:
        return "mistral"
    return "generic"


def plan(tokenizer, template, req) -> tuple[str | None, bool]:
    """Set req's messages, template variables and tool_format for its tools; return
    (the llguidance grammar or None, whether control tokens are decoded as text)."""
    s = req.structured
    grammar, special = None, False
    if s.tools:
        req.template_kwargs = {**req.template_kwargs, "tools": s.tools}
    # A thinking template (vramd/server/reasoning.py); under a block the prompt opened, a
    # constrained answer first closes it (an empty thought, as Qwen's enable_thinking=false writes).
    req.reasoning = reasoning.plan(template, req.reasoning_format, req.template_kwargs) if req.kind == "chat" else None
    close = json.dumps(reasoning.CLOSE) + " " if req.reasoning is not None and req.reasoning.open else ""
    harmony = req.reasoning is not None and req.reasoning.harmony
    special = harmony   # harmony's markers are control tokens
    if s.tools:
        fmt = detect(template)
        if fmt == "llama3":
            req.template_kwargs.update(date_string=time.strftime("%d %b %Y"), tools_in_user_message=False)
        if fmt == "harmony" and s.calls_tools:
            # calls in the model's own channels (harmony_grammar.py), read back by harmony.py
            if tokenizer is None:
                raise UsageError("this model has no vocabulary in its file: tool calls need one")
            grammar = harmony_grammar.calls(tokenizer, s, _functions(s))
            req.tool_format, special = fmt, True
        elif s.calls_tools:
            if s.json_schema is not None:
                fmt = "generic"
            if fmt == "generic":
                req.messages = add_system(req.messages, GENERIC_PROMPT)
            grammar = _call_grammar(fmt, tokenizer, s, close)
            special = special or fmt == "mistral"
            req.tool_format = fmt
    if grammar is None and s.json_schema is not None and not s.calls_tools and harmony and tokenizer is not None:
        grammar = harmony_grammar.response(tokenizer, s.json_schema)   # thought first, then the JSON
    elif grammar is None and s.json_schema is not None and not s.calls_tools:
        grammar = g.lark(f"start: {close}{g.json_in_lark(s.json_schema)}\n") if close else g.json_schema(s.json_schema)
    if grammar is not None:
        if tokenizer is None:
            raise UsageError("this model has no vocabulary in its file: constrained output needs one")
        g.check(grammar, tokenizer, "tools" if s.calls_tools else "response_format")
    return grammar, special


def _functions(s) -> list[dict]:
    return [t["function"] for t in s.tools if s.function is None or t["function"]["name"] == s.function]


def _call_schema(functions: list[dict], args_key: str, extra: dict | None = None) -> dict:
    schemas = []
    for fn in functions:
        props = {"name": {"const": fn["name"]}, args_key: fn["parameters"], **(extra or {})}
        schemas.append({"type": "object", "properties": props, "required": list(props),
                        "additionalProperties": False})
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def _call_grammar(fmt: str, tokenizer, s, close: str = "") -> str:
    """The grammar of a call in format `fmt`; `close`: a Lark string the answer starts with
    (the end of an open <think> block), or ""."""
    if tokenizer is None:
        raise UsageError("this model has no vocabulary in its file: tool calls need one")
    forced = s.tool_choice in ("required", "function")
    functions = _functions(s)
    if fmt == "generic":
        call = _call_schema(functions, "arguments")
        one = ({"type": "object", "properties": {"tool_calls": {"type": "array", "items": call, "minItems": 1}},
                "required": ["tool_calls"], "additionalProperties": False} if s.parallel else
               {"type": "object", "properties": {"tool_call": call}, "required": ["tool_call"],
                "additionalProperties": False})
        if not forced:
            response = s.json_schema if s.json_schema is not None else {"type": "string"}
            one = {"anyOf": [one, {"type": "object", "properties": {"response": response},
                                   "required": ["response"], "additionalProperties": False}]}
        return g.lark(f"start: {close}{g.json_in_lark(one)}\n") if close else g.json_schema(one)
    if not forced:
        return _lazy(fmt, tokenizer, s, functions, bool(close))
    if fmt == "hermes":
        call = _hermes_call(functions)
        return g.lark(f'start: {close}call ("\\n" call)*\ncall: {call}\n' if s.parallel else
                      f"start: {close}{call}\n")
    if fmt == "llama3":
        call = _call_schema(functions, "parameters")
        return g.lark(f"start: {close}{g.json_in_lark(call)}\n") if close else g.json_schema(call)
    marker = g.special_token(tokenizer, "[TOOL_CALLS]") or json.dumps("[TOOL_CALLS]")
    return g.lark(f"start: {close}{marker} {_mistral_array(functions, s.parallel)}\n")


def _hermes_call(functions: list[dict], trigger: str = "<tool_call>") -> str:
    return f'"{trigger}\\n" {g.json_in_lark(_call_schema(functions, "arguments"))} "\\n</tool_call>"'


def _mistral_array(functions: list[dict], parallel: bool) -> str:
    # an id of 9 letters and digits, as Mistral's template expects.
    item = _call_schema(functions, "arguments", {"id": {"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}})
    return g.json_in_lark({"type": "array", "items": item, "minItems": 1, **({} if parallel else {"maxItems": 1})})


# tool_choice auto in a native format: llama.cpp's lazy grammar, by llguidance's own
# mechanism (a `[lazy]` lexeme: text up to the first occurrence of the trigger, as its
# StructTag builds them).  The text is free until the model writes the format's trigger;
# from there on what follows is a call of one of the request's tools, its arguments
# valid for that tool's schema; with parallel_tool_calls false exactly one call, after
# which only the end of generation is allowed.  Under a <think> block the prompt opened,
# the trigger counts only after "</think>" (llama.cpp's thinking_forced_open); a block the
# model opens itself is not special, as in llama.cpp (a trigger there starts a call too).
_TEXT = 'TEXT: /(.|\\n)*/\n'


def _lazy(fmt: str, tokenizer, s, functions: list[dict], think_open: bool) -> str:
    ws = f"/{g.JSON_WHITESPACE}/"
    if fmt == "hermes":
        rules = f'trig[lazy]: TEXT "<tool_call>"\ncall: {_hermes_call(functions, "")}\n'
    elif fmt == "mistral":
        marker = g.special_token(tokenizer, "[TOOL_CALLS]")
        trig = f"trig: TEXT {marker}\n" if marker else 'trig[lazy]: TEXT "[TOOL_CALLS]"\n'
        rules = f"{trig}call: {_mistral_array(functions, s.parallel)}\n"
    else:
        # llama3: the answer is a call when it starts with {"name" (llama.cpp's trigger
        # pattern); the object is spelled out here so the trigger can be its first half.
        names = " | ".join(f"fn{i}" for i in range(len(functions)))
        rules = (f'trig[lazy]: /[ \\t\\n]*\\{{[ \\t\\n]*"name"/\ncall: {ws} ":" {ws} ({names}) {ws} "}}"\n'
                 + "".join(f'fn{i}: {json.dumps(json.dumps(fn["name"]))} {ws} "," {ws} "\\"parameters\\"" {ws} ":" '
                           f'{ws} {g.json_in_lark(fn["parameters"])}\n' for i, fn in enumerate(functions)))
        return g.lark(_lazy_start("calls: TEXT | trig call\n", think_open) + rules + _TEXT)
    calls = "calls: (trig call)* TEXT\n" if s.parallel else "calls: TEXT | trig call\n"
    return g.lark(_lazy_start(calls, think_open) + rules + _TEXT)


def _lazy_start(calls: str, think_open: bool) -> str:
    start = (f"start: TEXT | think calls\nthink[lazy]: TEXT {json.dumps(reasoning.END)}\n" if think_open
             else "start: calls\n")
    return "%llguidance {}\n" + start + calls
