"""Tool calls read out of model text (vramd/server/toolcalls.py), whole and streamed, in
every format vramd/server/tools.py picks; the format picked from real templates'
markers; tool messages rendered by templates that cannot render them
(vramd/engine/chat_polyfill.py)."""

import json

import pytest

from tests.ggufgen.vocab import LLAMA2_TEMPLATE, QWEN3_TEMPLATE
from vramd.engine.chat import GEMMA_TEMPLATE, ChatTemplate
from vramd.server import toolcalls, tools

ANSWERS = {
    "hermes": ('Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "sacks", "arguments": {"day": "Monday"}}\n</tool_call>',
               "Let me look.", [("weather", {"city": "Oslo"}), ("sacks", {"day": "Monday"})]),
    "llama3": ('{"name": "weather", "parameters": {"city": "Oslo"}}', "", [("weather", {"city": "Oslo"})]),
    "mistral": ('[TOOL_CALLS][{"name": "weather", "arguments": {"city": "Oslo"}, "id": "abcDEF123"}]', "",
                [("weather", {"city": "Oslo"})]),
    "generic": ('{"tool_calls": [{"name": "weather", "arguments": {"city": "Oslo"}}]}', "",
                [("weather", {"city": "Oslo"})]),
}


def calls_of(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("fmt", sorted(ANSWERS))
def test_each_format_parses_whole_and_streamed_alike(fmt):
    text, content, want = ANSWERS[fmt]
    got_content, calls = toolcalls.parse(fmt, text)
    assert got_content == content and calls_of(calls) == want
    for step in (1, 3, 7):      # token-sized pieces of every length
        stream, streamed, out = toolcalls.ToolStream(fmt), [], []
        for i in range(0, len(text), step):
            c, new = stream.feed(text[i:i + step])
            out.append(c)
            streamed += new
        c, new = stream.finish()
        out.append(c)
        streamed += new
        assert calls_of(streamed) == want
        assert "".join(out).strip() == content
    if fmt == "mistral":
        assert calls[0].id == "abcDEF123"


def test_text_that_is_no_call_stays_content():
    for fmt, text in (("hermes", "I have <tool_call> no json </tool_call> here"),
                      ("hermes", "<tool_ca"), ("llama3", "{not json at all"), ("llama3", "The answer is {1}"),
                      ("mistral", "[TOOL_CALLS] nothing"), ("generic", "plain words")):
        content, calls = toolcalls.parse(fmt, text)
        assert calls == [] and content.strip() == text.strip()
        stream = toolcalls.ToolStream(fmt)
        streamed = "".join(stream.feed(ch)[0] for ch in text) + stream.finish()[0]
        assert streamed.strip() == text.strip()


def test_a_generic_response_is_the_content():
    assert toolcalls.parse("generic", '{"response": "It rained."}') == ("It rained.", [])


def test_an_unclosed_last_hermes_call_still_counts():
    content, calls = toolcalls.parse("hermes", '<tool_call>\n{"name": "f", "arguments": {}}')
    assert calls_of(calls) == [("f", {})] and content == ""


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
