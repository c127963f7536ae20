"""Real models' chat templates (tests/ggufgen/templates/, sources in its README) with tools:
the tools reach the prompt as each template writes them, the tool-call format vramd
picks for each, a tool-call history (content null, tool messages) renders, and a forced
call generated under each one's grammar on the real engine (a random qwen3 model, so
the call is the grammar's doing) parses into valid arguments."""

import json
from pathlib import Path

import jsonschema
import pytest

from tests.engine.test_grammar import CTX, engine  # noqa: F401  (the engine fixture)
from vramd.engine.chat import ChatTemplate
from vramd.engine.prompt import Prompt
from vramd.engine.sampler import SamplingParams
from vramd.server import assistant, tools
from vramd.server.openai_api import GenerationRequest
from vramd.server.structured import parse

TEMPLATES = Path(__file__).parents[1] / "ggufgen" / "templates"
REAL = {   # file: (format, how the tool's parameters appear in the prompt, bos, eos)
    "qwen2.5-7b-instruct.jinja": ("hermes", '"parameters": {"type": "object", "properties": {"city"', "", "<|im_end|>"),
    "qwen3.jinja": ("hermes", '"parameters": {"type": "object", "properties": {"city"', "", "<|im_end|>"),
    "hermes-3-llama-3.1-8b-tool-use.jinja": ("hermes", '"parameters": {"type": "object", "properties": {"city"',
                                             "<|begin_of_text|>", "<|im_end|>"),
    "llama-3.1-8b-instruct.jinja": ("llama3", '"parameters": {\n            "type": "object"',
                                    "<|begin_of_text|>", "<|eot_id|>"),
    "mistral-nemo-instruct-2407.jinja": ("mistral", '"parameters": {"type": "object", "properties": {"city"',
                                         "<s>", "</s>"),
    "deepseek-r1-distill-qwen-32b.jinja": ("generic", '"name": "weather"', "<｜begin▁of▁sentence｜>", ""),
}
PARAMS = {"type": "object", "properties": {"city": {"type": "string", "description": "A city", "maxLength": 5},
                                           "days": {"type": "integer", "description": "Days", "minimum": 1,
                                                    "maximum": 9}},
          "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "The forecast", "parameters": PARAMS}},
         {"type": "function", "function": {"name": "tide", "description": "The tide", "parameters": PARAMS}}]
ASK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Rain in Oslo?"}]
# Another server's call id (not Mistral's 9 characters), arguments as the JSON text OpenAI sends.
HISTORY = ASK + [{"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_3f9a0c2b7d", "type": "function", "function": {"name": "weather",
                                                                "arguments": '{"city": "Oslo", "days": 2}'}}]},
                 {"role": "tool", "tool_call_id": "call_3f9a0c2b7d", "name": "weather", "content": "rain, 7 C"}]


def template(name):
    _, _, bos, eos = REAL[name]
    return ChatTemplate((TEMPLATES / name).read_text(), bos_token=bos, eos_token=eos)


def request(messages, choice="auto", **body):
    return GenerationRequest(kind="chat", messages=messages,
                             structured=parse({"tools": TOOLS, "tool_choice": choice, **body}, "chat"))


@pytest.mark.parametrize("name", sorted(REAL))
def test_tools_reach_the_prompt_and_the_format_is_the_templates(engine, name):  # noqa: F811
    fmt, params_text, _, _ = REAL[name]
    t = template(name)
    assert tools.detect(t) == fmt
    req = request(ASK)
    tools.plan(engine.tokenizer, t, req)
    text = t.render(req.messages, **req.template_kwargs)
    assert params_text in text and '"tide"' in text and "The forecast" in text, text


@pytest.mark.parametrize("name", sorted(REAL))
def test_a_tool_call_history_renders_the_call_and_its_answer(engine, name):  # noqa: F811
    t = template(name)
    req = request(HISTORY)
    tools.plan(engine.tokenizer, t, req)
    text = t.render(req.messages, **req.template_kwargs)    # no template raises (Mistral's wants 9-char ids)
    assert "rain, 7 C" in text and "weather" in text
    assert "Oslo" in text.split("Rain in Oslo?")[-1]       # the call's arguments, after the question
    assert '\\"city\\"' not in text                        # arguments as an object where the template wants one
    assert t.capabilities.tool_calls and t.capabilities.tool_responses
    assert '"tool_response"' not in text and '"tool_calls"' not in text   # native, not polyfilled


@pytest.mark.parametrize("name", sorted(REAL))
def test_a_forced_call_under_each_templates_grammar_parses(engine, name):  # noqa: F811
    fmt = REAL[name][0]
    t = template(name)
    for seed, choice in enumerate(("required", {"type": "function", "function": {"name": "tide"}})):
        req = request(ASK, choice, parallel_tool_calls=False)
        grammar, special = tools.plan(engine.tokenizer, t, req)
        assert req.tool_format == fmt and grammar is not None
        ids = engine.prompt_ids(Prompt(kind="completion", prompt="The river"))
        pieces = []
        params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed, max_tokens=CTX - 16,
                                grammar=grammar, special_text=special)
        assert engine.generate(ids, params, lambda p: pieces.append(p) or True) == "stop"
        text = "".join(p.text for p in pieces)
        message = assistant.message(fmt, req.reasoning, text)
        assert len(message.get("tool_calls", [])) == 1, text
        call = message["tool_calls"][0]["function"]
        assert call["name"] in (("weather", "tide") if choice == "required" else ("tide",))
        jsonschema.validate(json.loads(call["arguments"]), PARAMS)
        if req.reasoning is not None and req.reasoning.open:       # R1: the grammar closed the open block
            assert text.startswith("</think>") and not message.get("reasoning_content")
        assert not message["content"]


@pytest.mark.parametrize("name", sorted(REAL))
def test_a_call_only_turn_reaches_the_template_with_content_null(engine, name):  # noqa: F811
    """As the request body has it, null, missing or "": each template gets what it renders the call
    from (None, or "" for those that cannot take None: Qwen3's), the same prompt every way."""
    from vramd.server.openai_api import parse_request
    t = template(name)
    texts = set()
    for content in (None, "", "missing"):
        call = {k: v for k, v in HISTORY[2].items() if k != "content" or content != "missing"}
        if content != "missing":
            call["content"] = content
        body = {"model": "m", "messages": [*ASK, call, HISTORY[3]], "tools": TOOLS}
        req = parse_request("chat", json.dumps(body).encode(), {"m"})
        assert req.messages[2]["content"] is None
        tools.plan(engine.tokenizer, t, req)
        texts.add(t.render(req.messages, **req.template_kwargs))
    text = texts.pop()
    assert not texts and '"tool_calls"' not in text and "Oslo" in text.split("Rain in Oslo?")[-1]
    if name.startswith("deepseek-r1"):
        assert "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>weather" in text   # R1's own
    if name == "qwen3.jinja":
        assert not t.capabilities.null_content   # its template tests '</think>' in content: "" for it
