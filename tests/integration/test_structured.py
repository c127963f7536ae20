"""Structured output and tool calls end to end: `vramd serve` on a synthetic qwen3 file
(Qwen3's own chat template, which renders tools and writes <tool_call> blocks),
driven by the official `openai` SDK.

The model's weights are random: whatever it writes under a schema or a forced
tool call is the grammar's doing, so the answers must parse and validate.
"""

import json
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.ggufgen.llama import write_llama

from .conftest import DaemonProc

CHAT = [{"role": "user", "content": "How many sacks came on Monday?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
SACKS = {"type": "object", "properties": {"day": {"enum": ["Monday", "Tuesday"]}},
         "required": ["day"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "The forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "sacks", "description": "Count sacks", "parameters": SACKS}}]
SCHEMAS = {"weather": WEATHER, "sacks": SACKS}


class Ledger(BaseModel):
    day: Literal["Monday", "Tuesday", "Sunday"]
    sacks: int = Field(ge=0, le=99)
    closed: bool
    note: str = Field(max_length=6)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    d = tmp_path_factory.mktemp("structured")
    daemon = DaemonProc(d / "arena", write_llama(d / "qwen3.gguf", arch="qwen3", n_embd=64, n_ff=128, n_layer=1,
                                                 seed=11), "qwen", ctx=1024, wait_ready=False)
    try:
        daemon.wait_ready(120)
        yield daemon
    finally:
        daemon.stop()


@pytest.fixture
def c(qwen):
    return openai.OpenAI(base_url=qwen.member().endpoint + "/v1", api_key="unused", max_retries=0, timeout=120)


def check_calls(message, names):
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_parse_with_a_pydantic_model_gives_a_valid_object(c, seed):
    r = c.chat.completions.parse(model="qwen", messages=CHAT, response_format=Ledger, max_tokens=300,
                                 temperature=1.0, seed=seed)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(r.choices[0].message.parsed, Ledger)


def test_json_object_is_a_json_object(c):
    r = c.chat.completions.create(model="qwen", messages=CHAT, response_format={"type": "json_object"},
                                  max_tokens=400, temperature=0)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    text = c.chat.completions.create(model="qwen", messages=CHAT, response_format={"type": "text"},
                                     max_tokens=8, temperature=0)
    plain = c.chat.completions.create(model="qwen", messages=CHAT, max_tokens=8, temperature=0)
    assert text.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize("seed", [4, 5])
def test_required_tool_calls_parse_and_validate_streamed_or_not(c, seed):
    # One call (parallel_tool_calls false): with parallel calls a random-weight model may go on
    # calling past max_tokens ("length"), and whether it does can turn on the prefix cache's
    # rounding (it did once in a combined run); several calls streamed: tests/server/test_toolcalls.py.
    args = dict(model="qwen", messages=CHAT, tools=TOOLS, tool_choice="required", max_tokens=300,
                temperature=0.8, seed=seed, parallel_tool_calls=False)
    r = c.chat.completions.create(**args)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    check_calls(choice.message, {"weather", "sacks"})
    # The SDK's stream accumulation rebuilds the same calls from the tool_calls deltas.
    with c.chat.completions.stream(**args) as stream:
        final = stream.get_final_completion()
    got = final.choices[0]
    assert got.finish_reason == "tool_calls"
    assert [(t.function.name, t.function.arguments) for t in got.message.tool_calls] == \
        [(t.function.name, t.function.arguments) for t in choice.message.tool_calls]


def test_a_named_function_is_the_one_called(c):
    r = c.chat.completions.create(model="qwen", messages=CHAT, tools=TOOLS, max_tokens=300, temperature=1.0,
                                  seed=7, tool_choice={"type": "function", "function": {"name": "sacks"}},
                                  parallel_tool_calls=False)
    check_calls(r.choices[0].message, {"sacks"})
    assert len(r.choices[0].message.tool_calls) == 1


def test_tool_choice_none_shows_the_tools_and_calls_nothing(c):
    bare = c.chat.completions.create(model="qwen", messages=CHAT, max_tokens=4, temperature=0)
    r = c.chat.completions.create(model="qwen", messages=CHAT, tools=TOOLS, tool_choice="none", max_tokens=4,
                                  temperature=0)
    assert r.usage.prompt_tokens > bare.usage.prompt_tokens + 50   # the template described the tools
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason in ("stop", "length")


def test_a_tool_message_history_and_the_developer_role(c):
    history = [{"role": "developer", "content": "Be brief."}, *CHAT,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "sacks", "arguments": '{"day": "Monday"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "12 sacks"}]
    r = c.chat.completions.create(model="qwen", messages=history, tools=TOOLS, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    shorter = c.chat.completions.create(model="qwen", messages=history[:2], tools=TOOLS, max_tokens=1)
    assert r.usage.prompt_tokens > shorter.usage.prompt_tokens + 10   # the call and its answer were rendered
    as_system = [{"role": "system", "content": "Be brief."}, *CHAT]
    dev = c.chat.completions.create(model="qwen", messages=history[:2], max_tokens=4, temperature=0)
    sys_ = c.chat.completions.create(model="qwen", messages=as_system, max_tokens=4, temperature=0)
    assert dev.usage.prompt_tokens == sys_.usage.prompt_tokens
    assert dev.choices[0].message.content == sys_.choices[0].message.content


@pytest.mark.parametrize("extra, words", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "uniqueItems"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "json_schema.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools\\[0\\]"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
    ({"tool_choice": "required"}, "no 'tools'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "array", "contains": {"type": "integer"}}}}}}],
      "tool_choice": "required"}, "contains"),
    ({"messages": [*CHAT, {"role": "tool", "content": "x"}]}, "tool_call_id"),
])
def test_bad_or_unsupported_structured_fields_are_a_400_naming_them(c, extra, words):
    args = {"model": "qwen", "messages": CHAT, "max_tokens": 1, **extra}
    with pytest.raises(openai.BadRequestError, match=words):
        c.chat.completions.create(**args)


def test_streamed_tool_call_arguments_arrive_token_by_token(c):
    """A plain stream=True loop, as agent frameworks write it: the first delta of a call has
    its id and name, the arguments come in many deltas and add up to the non-streamed call."""
    args = dict(model="qwen", messages=CHAT, tools=TOOLS, tool_choice="required", max_tokens=300,
                temperature=0.8, seed=4)
    whole = c.chat.completions.create(**args).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    pieces: dict[int, int] = {}
    finish = None
    for chunk in c.chat.completions.create(stream=True, **args):
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for t in choice.delta.tool_calls or []:
            if t.index not in calls:
                assert t.id and t.type == "function" and t.function.name
                calls[t.index] = {"id": t.id, "name": t.function.name, "arguments": t.function.arguments or ""}
            else:
                assert t.id is None and t.function.name is None
                calls[t.index]["arguments"] += t.function.arguments
                pieces[t.index] = pieces.get(t.index, 0) + 1
    assert finish == "tool_calls"
    assert [(v["name"], v["arguments"]) for _, v in sorted(calls.items())] == \
        [(t.function.name, t.function.arguments) for t in whole]
    assert all(pieces[i] > 1 for i in calls)


def test_a_bad_reasoning_format_is_a_400(c):
    with pytest.raises(openai.BadRequestError, match="reasoning_format"):
        c.chat.completions.create(model="qwen", messages=CHAT, max_tokens=1, extra_body={"reasoning_format": "raw"})


@pytest.fixture(scope="module")
def r1(tmp_path_factory):
    """DeepSeek-R1-Distill's template, whose generation prompt opens <think>: the model's
    answer starts inside the block."""
    from tests.engine.test_tool_templates import TEMPLATES
    d = tmp_path_factory.mktemp("r1")
    model = write_llama(d / "r1.gguf", arch="qwen3", n_embd=64, n_ff=128, n_layer=1, seed=12,
                        chat_template=(TEMPLATES / "deepseek-r1-distill-qwen-32b.jinja").read_text())
    daemon = DaemonProc(d / "arena", model, "r1", "--reasoning-format", "deepseek", ctx=2048, wait_ready=False)
    try:
        daemon.wait_ready(120)
        yield openai.OpenAI(base_url=daemon.member().endpoint + "/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        daemon.stop()


def test_reasoning_content_beside_content_streamed_or_not(r1):
    args = dict(model="r1", messages=CHAT, max_tokens=12, temperature=0)
    raw = r1.chat.completions.create(extra_body={"reasoning_format": "none"}, **args).choices[0].message
    r = r1.chat.completions.create(**args).choices[0]
    # A random model never closes the block the prompt opened: all of it is reasoning.
    assert r.message.reasoning_content == raw.content.strip() and r.message.content == ""
    with r1.chat.completions.stream(**args) as stream:
        final = stream.get_final_completion().choices[0].message
    assert final.reasoning_content == r.message.reasoning_content and not final.content
    # Under a schema the grammar first closes the block: the content is the JSON.
    j = r1.chat.completions.parse(model="r1", messages=CHAT, response_format=Ledger, max_tokens=300,
                                  temperature=1.0, seed=1).choices[0]
    assert j.finish_reason == "stop" and isinstance(j.message.parsed, Ledger)
    assert not getattr(j.message, "reasoning_content", None)
    t = r1.chat.completions.create(model="r1", messages=CHAT, tools=TOOLS, tool_choice="required", max_tokens=300,
                                   temperature=0.8, seed=3).choices[0]
    check_calls(t.message, {"weather", "sacks"})


@pytest.fixture(scope="module")
def qwen_tools(tmp_path_factory):
    """Qwen3 with <tool_call> one token of its vocabulary, as Qwen's is: a logit_bias on it makes
    a random model write the trigger, and what follows is the lazy grammar's doing."""
    d = tmp_path_factory.mktemp("lazy")
    daemon = DaemonProc(d / "arena", write_llama(d / "qwen3.gguf", arch="qwen3", n_embd=64, n_ff=128, n_layer=1,
                                                 seed=5, tool_tokens=True), "qwen", ctx=1024)
    try:
        yield daemon
    finally:
        daemon.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_calls_are_of_the_requests_tools_and_one_without_parallel_calls(qwen_tools, stream):
    c = openai.OpenAI(base_url=qwen_tools.member().endpoint + "/v1", api_key="unused", max_retries=0, timeout=120)
    trigger = 512 - 2     # tests/ggufgen/vocab.py puts <tool_call> there
    for parallel in (False, True):
        kw = dict(model="qwen", messages=CHAT, tools=TOOLS, parallel_tool_calls=parallel, max_tokens=160,
                  temperature=1.0, seed=3, logit_bias={str(trigger): 100})
        if not stream:
            r = c.chat.completions.create(**kw)
            message, finish = r.choices[0].message, r.choices[0].finish_reason
            calls = message.tool_calls or []
        else:
            parts, finish = {}, None
            for chunk in c.chat.completions.create(stream=True, **kw):
                for d in chunk.choices[0].delta.tool_calls or []:
                    p = parts.setdefault(d.index, {"name": "", "arguments": ""})
                    p["name"] += (d.function.name or "") if d.function else ""
                    p["arguments"] += (d.function.arguments or "") if d.function else ""
                finish = chunk.choices[0].finish_reason or finish
            calls = [type("Call", (), {"function": type("F", (), p)}) for _, p in sorted(parts.items())]
        for call in calls:    # never an invented name: the name comes from the tools' enum
            assert call.function.name in SCHEMAS
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        if parallel:          # the bias writes the trigger again after every call, up to max_tokens
            assert len(calls) >= 2 and finish == "length", (calls, finish)
        else:                 # one call, then only the end of generation
            assert len(calls) == 1 and finish == "tool_calls", (calls, finish)
