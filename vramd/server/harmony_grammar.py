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

MARKERS = {"START": "<|start|>", "CH": "<|channel|>", "MSG": "<|message|>", "END": "<|end|>",
           "RET": "<|return|>", "CALL": "<|call|>", "CON": "<|constrain|>"}
# text with no "<|" in it: every "<" is followed by a character other than "|" (or ends the text)
_BODY = 'BODY: /([^<]|<+[^<|])*<*/\n'
_FREE = 'free: m_ch ("analysis" | "commentary") m_msg BODY m_end m_start "assistant"\n'


def _markers(tokenizer) -> str:
    """The markers as Lark rules: the control token, or its text where the vocabulary lacks it."""
    return "".join(f"m_{k.lower()}: {g.special_token(tokenizer, t) or json.dumps(t)}\n" for k, t in MARKERS.items())


def _final_body(schema: dict | None) -> str:
    return g.json_in_lark(schema) if schema is not None else "BODY"


def response(tokenizer, schema: dict) -> str:
    return g.lark(
        '%llguidance {}\nstart: (analysis m_start "assistant")? final\n'
        'analysis: m_ch "analysis" m_msg BODY m_end\n'
        f'final: m_ch "final" (" " m_con? /[a-zA-Z0-9_-]+/)? m_msg {_final_body(schema)} m_ret\n'
        + _markers(tokenizer) + _BODY)


def _call_rules(functions: list[dict]) -> str:
    rules = ['callch: m_ch ("commentary" | "analysis")\njsonhdr: (" " m_con? "json")?\n']
    names, role_names = [], []
    for i, fn in enumerate(functions):
        name = json.dumps(fn["name"])
        rules.append(f"args{i}: {g.json_in_lark(fn['parameters'])}\n"
                     f"fn{i}: {name} jsonhdr m_msg args{i} m_call\n"
                     f"rfn{i}: {name} callch jsonhdr m_msg args{i} m_call\n")
        names.append(f"fn{i}")
        role_names.append(f"rfn{i}")
    rules.append(f'call: callch " to=functions." ({" | ".join(names)}) | role_call\n'
                 f'role_call: " to=functions." ({" | ".join(role_names)})\n')
    return "".join(rules)


def calls(tokenizer, s, functions: list[dict]) -> str:
    """The grammar of a harmony answer under tool_choice auto, required or a named function."""
    if s.tool_choice in ("required", "function"):
        start = ('start: (m_ch "analysis" m_msg BODY m_end m_start "assistant")? '
                 '(m_ch "commentary" m_msg BODY m_end m_start "assistant")? call\n')
    else:
        # plain text (no channel: content as written), or messages, the last a final answer or a call;
        # a call in the role (" to=functions." right after the prompt's <|start|>assistant) only
        # after a message, where plain text cannot be
        start = ('start: TEXT? | free* (m_ch "final" m_msg ' + _final_body(s.json_schema) + ' m_ret | channel_call)'
                 ' | free+ role_call\n' + _FREE + 'TEXT: /(.|\\n)+/\n'
                 'channel_call: callch " to=functions." (' +
                 " | ".join(f"fn{i}" for i in range(len(functions))) + ')\n')
    return g.lark("%llguidance {}\n" + start + _call_rules(functions) + _markers(tokenizer) + _BODY)
