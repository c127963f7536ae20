"""Tool calls read out of model text (vramd/server/toolcalls.py), whole and streamed, in
every format vramd/server/tools.py picks; the format picked from real templates'
markers; tool messages rendered by templates that cannot render them
(vramd/engine/chat_polyfill.py)."""

import json

import pytest

from tests.ggufgen.vocab import LLAMA2_TEMPLATE, QWEN3_TEMPLATE
from vramd.engine.chat import GEMMA_TEMPLATE, ChatTemplate
from vramd.server import assistant, toolcalls, tools

ANSWERS = {
    "hermes": ('Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo", "days": [1, 2]}}\n'
               '</tool_call>\n<tool_call>\n{"name": "sacks", "arguments": {"day": "Mon\\u00e9 \\"day\\" }"}}\n</tool_call>',
               "Let me look.", [("weather", {"city": "Oslo", "days": [1, 2]}), ("sacks", {"day": 'Moné "day" }'})]),
    "llama3": ('{"name": "weather", "parameters": {"city": "Oslo", "n": [1, {"x": "}"}]}}', None,
               [("weather", {"city": "Oslo", "n": [1, {"x": "}"}]})]),
    "mistral": ('[TOOL_CALLS][{"name": "weather", "arguments": {"city": "Oslo"}, "id": "abcDEF123"}, '
                '{"name": "sacks", "arguments": {}, "id": "abcDEF124"}]', None,
                [("weather", {"city": "Oslo"}), ("sacks", {})]),
    "generic": ('{"tool_calls": [{"name": "weather", "arguments": {"city": "Oslo"}}, '
                '{"name": "sacks", "arguments": "{\\"day\\": \\"Monday\\"}"}]}', None,
                [("weather", {"city": "Oslo"}), ("sacks", {"day": "Monday"})]),
}


def calls_of(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def stream(fmt, text, step, reasoning=None):
    """The deltas of `text` fed `step` characters at a time, as ResponseBuilder.chunk sends them."""
    a = assistant.Assistant(fmt, reasoning)
    deltas = [a.feed(text[i:i + step]) for i in range(0, len(text), step)] + [a.feed("", final=True)]
    return [d for d in deltas if d]


def accumulate(deltas) -> dict:
    """What a client's stream loop builds (the openai SDK's accumulation: strings concatenated,
    tool calls by index)."""
    msg: dict = {}
    for d in deltas:
        for key in ("content", "reasoning_content"):
            if key in d:
                msg[key] = msg.get(key, "") + d[key]
        for t in d.get("tool_calls", []):
            calls = msg.setdefault("tool_calls", {})
            if t["index"] not in calls:
                assert set(t) == {"index", "id", "type", "function"} and t["type"] == "function" and t["id"]
                assert isinstance(t["function"]["name"], str) and isinstance(t["function"]["arguments"], str)
                calls[t["index"]] = {"id": t["id"], "type": "function", "function": dict(t["function"])}
            else:
                assert set(t) == {"index", "function"} and set(t["function"]) == {"arguments"}
                calls[t["index"]]["function"]["arguments"] += t["function"]["arguments"]
    if "tool_calls" in msg:
        msg["tool_calls"] = [msg["tool_calls"][i] for i in sorted(msg["tool_calls"])]
    return msg


def same_message(streamed: dict, whole: dict) -> None:
    assert streamed.get("content") == (whole["content"] or None)
    assert streamed.get("reasoning_content") == whole.get("reasoning_content")
    strip = [(c["function"]["name"], c["function"]["arguments"]) for c in streamed.get("tool_calls", [])]
    assert strip == [(c["function"]["name"], c["function"]["arguments"]) for c in whole.get("tool_calls", [])]


@pytest.mark.parametrize("fmt", sorted(ANSWERS))
def test_each_format_streams_its_arguments_piece_by_piece_into_the_whole_answer(fmt):
    text, content, want = ANSWERS[fmt]
    got_content, calls = toolcalls.parse(fmt, text)
    assert calls_of(calls) == want and (got_content or None) == content
    whole = assistant.message(fmt, None, text)
    assert whole["content"] == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole["tool_calls"]] == want
    for step in (1, 3, 7):      # token-sized pieces of every length
        deltas = stream(fmt, text, step)
        same_message(accumulate(deltas), whole)
        for index in range(len(want)):
            pieces = [t["function"]["arguments"] for d in deltas for t in d.get("tool_calls", [])
                      if t["index"] == index and t["function"]["arguments"]]
            if want[index][1] and (fmt, index) != ("generic", 1):   # (that one's arguments are a JSON string)
                assert len(pieces) > 1, (step, index, pieces)   # not one delta once the call is whole
        # a call's first delta comes before its arguments are complete
        first = next(i for i, d in enumerate(deltas) if d.get("tool_calls"))
        assert first < len(deltas) - 2


def test_hermes_arguments_are_the_models_own_text_and_mistral_ids_have_nine_characters():
    _, calls = toolcalls.parse("hermes", '<tool_call>{"name":"f","arguments":{"a" : 1,"b":[ ]}}</tool_call>')
    assert calls[0].arguments == '{"a" : 1,"b":[ ]}' and calls[0].id.startswith("call_")
    _, calls = toolcalls.parse("mistral", ANSWERS["mistral"][0])
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls) and calls[0].id != calls[1].id


def test_text_that_is_no_call_stays_content():
    for fmt, text in (("hermes", "I have <tool_call> no json </tool_call> here"),
                      ("hermes", "<tool_ca"), ("hermes", '<tool_call>{"nam": "x"}</tool_call> and <tool_call>'),
                      ("hermes", '<tool_call>{"name": 7}</tool_call>'),
                      ("llama3", "{not json at all"), ("llama3", "The answer is {1}"), ("llama3", '{"a": [1]}'),
                      ("mistral", "[TOOL_CALLS] nothing"), ("mistral", "[TOOL_CALLS][1, 2]"),
                      ("generic", "plain words"), ("generic", '{"other": 1}')):
        content, calls = toolcalls.parse(fmt, text)
        assert calls == [] and content == text.strip(), (fmt, text)
        for step in (1, 4):
            assert accumulate(stream(fmt, text, step)) == {"content": text.strip()}, (fmt, text, step)


def test_a_generic_response_streams_as_content():
    text = '{"response": "It rained \\u00e9\\ud83d\\ude00 \\"a lot\\"."}'
    assert toolcalls.parse("generic", text) == ('It rained é😀 "a lot".', [])
    deltas = stream("generic", text, 2)
    assert accumulate(deltas) == {"content": 'It rained é😀 "a lot".'} and len(deltas) > 5


def test_a_call_cut_off_or_broken_after_its_name_keeps_what_was_sent():
    content, calls = toolcalls.parse("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1')
    assert [(c.name, c.arguments) for c in calls] == [("f", '{"a": 1')] and content == ""
    content, calls = toolcalls.parse("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1}} oops')
    assert [(c.name, c.arguments) for c in calls] == [("f", '{"a": 1}')] and content == "oops"
    content, calls = toolcalls.parse("hermes", '<tool_call>\n{"name": "f", "arguments": {}}')   # no closing tag
    assert calls_of(calls) == [("f", {})] and content == ""
    content, calls = toolcalls.parse("llama3", '{"name": "f"}')      # no parameters: an empty object
    assert calls_of(calls) == [("f", {})]


LLAMA31_MARKERS = ("{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}{{ message.content }}"
                   "{%- for m in messages %}{{ m.content }}{% endfor %}")
MISTRAL_MARKERS = "{% for m in messages %}{{ m.content }}{% endfor %}{{ '[TOOL_CALLS]' }}"


def test_the_format_is_picked_from_the_template_as_llama_cpp_does():
    assert tools.detect(ChatTemplate(QWEN3_TEMPLATE)) == "hermes"
    assert tools.detect(ChatTemplate(LLAMA31_MARKERS)) == "llama3"
    assert tools.detect(ChatTemplate(MISTRAL_MARKERS)) == "mistral"
    assert tools.detect(ChatTemplate(GEMMA_TEMPLATE)) == "generic"
    assert tools.detect(ChatTemplate(LLAMA2_TEMPLATE)) == "generic"


HISTORY = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sacks on Monday?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_7", "type": "function", "function": {"name": "sacks", "arguments": '{"day": "Monday"}'}}]},
           {"role": "tool", "tool_call_id": "call_7", "name": "sacks", "content": "twelve sacks"},
           {"role": "tool", "tool_call_id": "call_8", "name": "sacks", "content": "and four more"}]
TOOL = [{"type": "function", "function": {"name": "sacks", "parameters": {"type": "object"}}}]


def test_gemmas_template_renders_tool_history_through_the_polyfills():
    t = ChatTemplate(GEMMA_TEMPLATE, bos_token="<bos>")
    caps = t.capabilities
    assert not caps.tools and not caps.tool_calls and not caps.tool_responses
    text = t.render(HISTORY, tools=TOOL)
    # the tools in the system text, the call as the assistant's JSON, both answers as one user turn
    assert '"name": "sacks"' in text and '"tool_calls"' in text and "twelve sacks" in text
    assert "and four more" in text and text.count("<start_of_turn>user") == 2
    assert text.endswith("<start_of_turn>model\n")


def test_qwen3s_template_renders_tool_history_natively():
    t = ChatTemplate(QWEN3_TEMPLATE)
    assert t.capabilities.tools and t.capabilities.tool_calls and t.capabilities.tool_responses
    text = t.render(HISTORY, tools=TOOL)
    assert '<tool_call>\n{"name": "sacks", "arguments": {"day": "Monday"}}\n</tool_call>' in text
    assert "<tool_response>\ntwelve sacks\n</tool_response>" in text
