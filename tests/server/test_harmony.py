"""gpt-oss's harmony channels (vramd/server/harmony.py through vramd/server/assistant.py):
the analysis channel as `reasoning_content`, final (and commentary) as `content`, whole
and streamed alike; a harmony template is planned as such and decodes control tokens."""

import pytest

from tests.server.test_toolcalls import accumulate, same_message, stream
from vramd.engine.chat import ChatTemplate
from vramd.server import assistant, reasoning
from vramd.server.harmony import is_harmony
from vramd.server.reasoning import Reasoning

H = Reasoning(harmony=True)
# A cut-down harmony template: what matters is its markers and its generation prompt.
HARMONY_TEMPLATE = ("{%- for m in messages -%}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endfor -%}"
                    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
                    "{# <|channel|>final #}")

CASES = [   # (text, reasoning, content)
    ("<|channel|>analysis<|message|>The mill, then the river.<|end|><|start|>assistant<|channel|>final"
     "<|message|>Twelve sacks.<|return|>", "The mill, then the river.", "Twelve sacks."),
    ("<|channel|>analysis<|message|>Count them.<|end|><|start|>assistant<|channel|>final<|message|>Twelve.",
     "Count them.", "Twelve."),                                        # the end token not rendered
    ("<|channel|>analysis<|message|>Still counting the sa", "Still counting the sa", ""),   # ended inside
    ("<|channel|>final<|message|>Just the answer.<|return|>", None, "Just the answer."),
    ("<|channel|>commentary<|message|>Let me look.<|end|><|start|>assistant<|channel|>final<|message|>Done.",
     None, "Let me look.Done."),
    ("No channels at all, a <|channel|> later.", None, "No channels at all, a <|channel|> later."),
    (" to=functions.nothing, just text", None, "to=functions.nothing, just text"),   # not a header after all
    ("<|channel|>final<|message|>a < b and 2<|3 stays<|return|>ignored", None, "a < b and 2<|3 stays"),
]


@pytest.mark.parametrize("text, thought, content", CASES)
def test_channels_whole_and_streamed(text, thought, content):
    whole = assistant.message(None, H, text)
    assert whole.get("reasoning_content") == thought
    assert whole["content"] == content
    for step in (1, 2, 5, 11):
        same_message(accumulate(stream(None, text, step, H)), whole)


def test_a_harmony_template_plans_channels_and_control_text():
    t = ChatTemplate(HARMONY_TEMPLATE)
    assert is_harmony(t)
    assert reasoning.plan(t, None, {}) == H
    # "none": the channels are still read (tool calls, the final answer), the analysis kept in content
    assert reasoning.plan(t, "none", {}) == Reasoning(harmony=True, inline=True)
    assert not is_harmony(ChatTemplate("{{ messages[0].content }}"))


CALLS = [   # (text, reasoning, content, [(name, arguments)])
    ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
     'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>',
     "Need the weather.", None, [("get_weather", '{"city": "Paris"}')]),
    ('<|start|>assistant to=functions.sacks<|channel|>commentary json<|message|>{"day": 1}',   # recipient first,
     None, None, [("sacks", '{"day": 1}')]),                                                # ended by EOG
    (' to=functions.sacks<|channel|>analysis<|message|>{"day": 1}', None, None,   # the recipient right after
     [("sacks", '{"day": 1}')]),                                                 # the prompt's <|start|>assistant
    (" to=functions.nothing, just text", None, "to=functions.nothing, just text", []),   # no header follows
    ("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary "
     'to=functions.a<|message|>{}<|call|>', None, "Checking.", [("a", "{}")]),
]


@pytest.mark.parametrize("text, thought, content, calls", CALLS)
def test_harmony_tool_calls_whole_and_streamed(text, thought, content, calls):
    whole = assistant.message("harmony", H, text)
    assert whole.get("reasoning_content") == thought
    assert whole["content"] == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole.get("tool_calls", [])] == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in whole.get("tool_calls", []))
    for step in (1, 4, 9):
        same_message(accumulate(stream("harmony", text, step, H)), whole)


def test_a_harmony_template_detects_harmony_calls():
    from vramd.server.tools import detect
    assert detect(ChatTemplate(HARMONY_TEMPLATE)) == "harmony"


def _plan(body):
    from vramd.server import tools
    from vramd.server.openai_api import GenerationRequest
    from vramd.server.structured import parse
    req = GenerationRequest(kind="chat", messages=[{"role": "user", "content": "Rain?"}], structured=parse(body, "chat"))
    return req, tools.plan(None, ChatTemplate(HARMONY_TEMPLATE), req)


FNS = [{"type": "function", "function": {"name": "tide", "parameters": {"type": "object"}}}]


def test_harmony_plans_control_text_and_its_constraints_need_a_vocabulary():
    """Calls and a response_format are grammars in harmony's channels (tests/engine/test_harmony_grammar.py
    checks them on a file's vocabulary); without a vocabulary they are refused, not left free."""
    from vramd.errors import UsageError
    req, (grammar, special) = _plan({})
    assert req.tool_format is None and grammar is None and special and req.reasoning == H  # markers as text
    for body in ({"tools": FNS}, {"tools": FNS, "tool_choice": "required"},
                 {"response_format": {"type": "json_object"}}):
        with pytest.raises(UsageError, match="vocabulary"):
            _plan(body)


def test_reasoning_format_none_keeps_the_analysis_in_content_and_still_reads_calls():
    """llama.cpp's gpt-oss parser under reasoning_format none: no reasoning_content, the analysis
    text stays in content, and a requested tool call is still a call (before: the channel markers
    came out as nothing and the call was lost)."""
    inline = Reasoning(harmony=True, inline=True)
    text, thought, content = CASES[0]
    whole = assistant.message(None, inline, text)
    assert "reasoning_content" not in whole and whole["content"] == thought + content
    for step in (1, 3, 7):
        same_message(accumulate(stream(None, text, step, inline)), whole)
    text, thought, _content, calls = CALLS[0]
    whole = assistant.message("harmony", inline, text)
    assert whole["content"] == thought and "reasoning_content" not in whole
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]] == calls


def test_a_call_no_tools_asked_for_is_content_not_a_tool_call():
    """Without tools in the request (tool_format is not harmony) a message to a function is not
    turned into tool_calls (llama.cpp drops such unsolicited calls); its text is kept as content."""
    text, thought, _content, _calls = CALLS[0]
    whole = assistant.message(None, H, text)
    assert "tool_calls" not in whole and whole["reasoning_content"] == thought
    assert whole["content"] == '{"city": "Paris"}'
