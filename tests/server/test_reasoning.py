"""Reasoning split from the answer (vramd/server/reasoning.py through vramd/server/assistant.py):
`reasoning_content` and `content`, whole and streamed alike, for templates that think."""

from pathlib import Path

import pytest

from tests.ggufgen.vocab import LLAMA2_TEMPLATE, QWEN3_TEMPLATE
from tests.server.test_toolcalls import accumulate, same_message, stream
from vramd.engine.chat import ChatTemplate
from vramd.errors import UsageError
from vramd.server import assistant, reasoning
from vramd.server.reasoning import Reasoning

R1_TEMPLATE = (Path(__file__).parents[1] / "ggufgen" / "templates" / "deepseek-r1-distill-qwen-32b.jinja").read_text()

CASES = [   # (text, the prompt opened the block, tool format, reasoning, content, tool names)
    ("<think>\nThe mill, then the river.\n</think>\n\nTwelve sacks.", False, None,
     "The mill, then the river.", "Twelve sacks.", []),
    ("The mill, then the river.\n</think>\n\nTwelve sacks.", True, None, "The mill, then the river.", "Twelve sacks.", []),
    ("<think>\nStill counting the sa", False, None, "Still counting the sa", "", []),      # ended inside
    ("Still counting", True, None, "Still counting", "", []),
    ("No thought at all. <think>x</think>", False, None, None, "No thought at all. <think>x</think>", []),
    ('<think>A call, then.</think>\n<tool_call>\n{"name": "sacks", "arguments": {"day": "Monday"}}\n</tool_call>',
     False, "hermes", "A call, then.", None, ["sacks"]),
    ('Look it up.</think>{"name": "sacks", "parameters": {}}', True, "llama3", "Look it up.", None, ["sacks"]),
]


@pytest.mark.parametrize("text, open_, fmt, thought, content, names", CASES)
def test_reasoning_and_content_whole_and_streamed(text, open_, fmt, thought, content, names):
    whole = assistant.message(fmt, Reasoning(open_), text)
    assert whole.get("reasoning_content") == thought
    assert whole["content"] == content
    assert [c["function"]["name"] for c in whole.get("tool_calls", [])] == names
    for step in (1, 3, 7):
        deltas = stream(fmt, text, step, Reasoning(open_))
        same_message(accumulate(deltas), whole)
        # the thought comes first, then the answer
        kinds = [k for d in deltas for k in ("reasoning_content", "content", "tool_calls") if k in d]
        assert kinds == sorted(kinds, key=("reasoning_content", "content", "tool_calls").index)
        if thought and len(thought) > 2 * step:
            assert kinds.count("reasoning_content") > 1      # streamed, not held to the end


def test_which_templates_think_and_which_open_the_block():
    qwen3 = ChatTemplate(QWEN3_TEMPLATE)
    assert reasoning.plan(qwen3, None, {}) == Reasoning(open=False)          # the model writes <think> itself
    assert reasoning.plan(qwen3, "auto", {"enable_thinking": False}) == Reasoning(open=False)
    assert reasoning.plan(qwen3, "none", {}) is None
    r1 = ChatTemplate(R1_TEMPLATE, bos_token="<｜begin▁of▁sentence｜>")
    assert reasoning.plan(r1, "auto", {}) == Reasoning(open=True)              # its prompt ends "<think>\n"
    llama2 = ChatTemplate(LLAMA2_TEMPLATE)
    assert reasoning.plan(llama2, "auto", {}) is None                          # not a thinking template
    assert reasoning.plan(llama2, "deepseek", {}) == Reasoning(open=False)


def test_a_bad_reasoning_format_is_refused_by_name():
    assert reasoning.request_format({"reasoning_format": "none"}, "chat") == "none"
    with pytest.raises(UsageError, match="reasoning_format.*auto, deepseek, none"):
        reasoning.request_format({"reasoning_format": "hidden"}, "chat")
    with pytest.raises(UsageError, match="not /v1/completions"):
        reasoning.request_format({"reasoning_format": "auto"}, "completion")
