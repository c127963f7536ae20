"""The grammars of a constrained harmony (gpt-oss) answer: a response_format's JSON
and tool calls, written in the model's own channels (vramd/server/harmony.py
reads them back).

Owns `response(tokenizer, schema)` and `calls(tokenizer, s, functions)`, the
llguidance Lark grammars vramd/server/tools.py gives a harmony request.  They
follow llama.cpp's gpt-oss handler (common/chat.cpp,
common_chat_params_init_gpt_oss); the markers are control tokens, named here
by id (`<[id]>`), so no text the model writes can stand in for them.

response_format (llama.cpp's json_schema grammar, not lazy):
    ( <|channel|>analysis<|message|> THOUGHT <|end|> <|start|>assistant )?
    <|channel|>final ( " " <|constrain|>? NAME )? <|message|> JSON <|return|>
  the analysis channel free, the final channel's body JSON valid for the schema.
tool_choice required / a named function (llama.cpp's grammar, not lazy):
    ( analysis <|start|>assistant )? ( commentary <|start|>assistant )? CALL
tool_choice auto: the answer is messages in harmony's framing (or plain text
  with no channel at all, as the split reads it: content), each free but one
  whose header names a recipient ` to=functions.`: from there on it is a call
  (llama.cpp's lazy trigger `<|channel|>(commentary|analysis) to`); with a
  response_format the final channel's body is the schema's JSON.
CALL, in the channel (as the template renders a call) or in the role:
    <|channel|>(commentary|analysis) to=functions.NAME ( " " <|constrain|>? "json" )? <|message|> ARGS <|call|>
     to=functions.NAME <|channel|>(commentary|analysis) ( " " <|constrain|>? "json" )? <|message|> ARGS <|call|>
  NAME one of the request's tools (the named one only), ARGS valid for its
  `parameters`.  <|call|> ends generation (an end-of-generation token, as in
  llama.cpp): a harmony turn has one call, whatever parallel_tool_calls says
  (true admits one per turn, the model calls again after the result; false
  exactly one).
A THOUGHT or message body is text without "<|" (so that no marker is spelled
in plain text where the split would read one; llama.cpp excludes "<|end|>").
"""

from __future__ import annotations

import json

from vramd.engine import grammar as g

MARKERS = {"m_start": "<|start|>", "m_ch": "<|channel|>", "m_msg": "<|message|>", "m_end": "<|end|>",
           "m_ret": "<|return|>", "m_call": "<|call|>", "m_con": "<|constrain|>"}
# A message body: text with no "<|" in it (every "<" followed by a character other than "|", or last).
# A thought (analysis) and a preamble (commentary) are whole messages, the next one's <|start|>assistant
# included.
_MESSAGES = ('BODY: /([^<]|<+[^<|])*<*/\n'
             'thought: m_ch "analysis" m_msg BODY m_end m_start "assistant"\n'
             'preamble: m_ch "commentary" m_msg BODY m_end m_start "assistant"\n')


def _grammar(start: str, tokenizer) -> str:
    """A Lark grammar from its start rules, with the messages and the markers (each the control
    token by id, or its text where the vocabulary lacks it)."""
    markers = "".join(f"{k}: {g.special_token(tokenizer, t) or json.dumps(t)}\n" for k, t in MARKERS.items())
    return g.lark("%llguidance {}\n" + start + _MESSAGES + markers)


def _final(schema: dict | None) -> str:
    """The final channel: its body the schema's JSON (free text without one), then <|return|>."""
    body = g.json_in_lark(schema) if schema is not None else "BODY"
    return f'final: m_ch "final" (" " m_con? /[a-zA-Z0-9_-]+/)? m_msg {body} m_ret\n'


def response(tokenizer, schema: dict) -> str:
    return _grammar("start: thought? final\n" + _final(schema), tokenizer)


def _call_rules(functions: list[dict]) -> str:
    """channel_call and role_call: a call of one of `functions`, the recipient in the channel's
    header or in the role's."""
    rules = ['callch: m_ch ("commentary" | "analysis")\njsonhdr: (" " m_con? "json")?\n']
    for i, fn in enumerate(functions):
        name = json.dumps(fn["name"])
        rules.append(f"args{i}: {g.json_in_lark(fn['parameters'])}\n"
                     f"fn{i}: {name} jsonhdr m_msg args{i} m_call\n"
                     f"rfn{i}: {name} callch jsonhdr m_msg args{i} m_call\n")
    n = range(len(functions))
    rules.append(f'channel_call: callch " to=functions." ({" | ".join(f"fn{i}" for i in n)})\n'
                 f'role_call: " to=functions." ({" | ".join(f"rfn{i}" for i in n)})\n')
    return "".join(rules)


def calls(tokenizer, s, functions: list[dict]) -> str:
    """The grammar of a harmony answer under tool_choice auto, required or a named function."""
    if s.tool_choice in ("required", "function"):
        start = "start: thought? preamble? (channel_call | role_call)\n"
    else:
        # plain text (no channel: content as written), or messages, the last a final answer or a
        # call; a call in the role (" to=functions." right after the prompt's <|start|>assistant)
        # only after a message, where plain text cannot be
        start = ("start: TEXT? | (thought | preamble)* (final | channel_call) | (thought | preamble)+ role_call\n"
                 "TEXT: /(.|\\n)+/\n" + _final(s.json_schema))
    return _grammar(start + _call_rules(functions), tokenizer)
