"""`vramd serve` on a gpt-oss file (issue 17), through the `openai` client.

The file is the conformance suite's "gpt-oss" case in its real-file mix
(tests/engine/conformance/cases.py "Q8_0": MXFP4 experts, Q8_0 matrices):
attention sinks, sliding even layers (the prompt crosses the window of 8),
biases, the clamped SwiGLU, YaRN.  A greedy completion of a token-id prompt
must be the numpy reference's greedy continuation (decoded by the file's own
tokenizer); a chat request goes through the file's template.  A harmony file (harmony's
control tokens, a harmony template) answers a response_format and a forced tool call in
its own channels.
"""

import json
from typing import Literal

import jsonschema
import openai
from pydantic import BaseModel, Field

from tests.engine.conformance.cases import write_case
from tests.ggufgen.gptoss import write_gptoss
from tests.integration.greedy_text import greedy_text
from vramd.engine.tokenizer import Tokenizer
from vramd.model.gguf_check import validate_gguf

PROMPT = [1, 17, 42, 99, 3, 250, 8, 64, 5, 77, 31, 2]
N = 6


def reference_text(path) -> str:
    from tests.engine.reference.gptoss import GptOssReference
    return greedy_text(GptOssReference(path), path, PROMPT, N)


def test_gpt_oss_serves_the_openai_client(arena, tmp_path, daemons):
    path = write_case("gpt-oss", "Q8_0", tmp_path / "gpt-oss.gguf")
    d = daemons(arena, path, "gptoss")
    c = openai.OpenAI(base_url=d.member().endpoint + "/v1", api_key="unused", max_retries=0, timeout=120)
    r = c.completions.create(model=d.name, prompt=PROMPT, max_tokens=N, temperature=0)
    assert r.choices[0].text == reference_text(path)
    chat = c.chat.completions.create(model=d.name, messages=[{"role": "user", "content": "the river ran"}],
                                     max_tokens=4, temperature=0)
    assert chat.choices[0].finish_reason in ("length", "stop") and chat.usage.completion_tokens >= 1


class Ledger(BaseModel):
    day: Literal["Monday", "Tuesday"]
    sacks: int = Field(ge=0, le=99)


SACKS = {"type": "object", "properties": {"day": {"enum": ["Monday", "Tuesday"]}},
         "required": ["day"], "additionalProperties": False}


def test_a_harmony_model_thinks_then_answers_the_schema_or_calls_a_tool(arena, tmp_path, daemons):
    """Issue 17/18 on gpt-oss: a response_format (the SDK's parse, a pydantic model) and a forced
    tool call are constrained in harmony's own channels, the analysis channel free before them
    (tests/engine/test_harmony_grammar.py checks the masks): the random model's answer parses
    and validates, its thought (if it wrote one) in reasoning_content, never in content."""
    path = write_gptoss(tmp_path / "harmony.gguf", harmony=True, seed=5)
    d = daemons(arena, path, "harmony", ctx=512)
    c = openai.OpenAI(base_url=d.member().endpoint + "/v1", api_key="unused", max_retries=0, timeout=300)
    end = Tokenizer.from_metadata(validate_gguf(path).metadata).token_id("<|end|>")
    # the thought is free text: favour its end, or a random model writes it to the length limit
    opts = dict(model=d.name, messages=[{"role": "user", "content": "How many sacks on Monday?"}],
                max_tokens=400, temperature=1.0, seed=3, logit_bias={str(end): 6})
    r = c.chat.completions.parse(response_format=Ledger, **opts)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and isinstance(m.parsed, Ledger), m
    thought = getattr(m, "reasoning_content", None) or (m.model_extra or {}).get("reasoning_content")
    assert thought and "<|" not in thought and "<|" not in m.content   # seed 3 writes a thought first
    assert json.loads(m.content) == m.parsed.model_dump()              # content is the JSON alone
    r = c.chat.completions.create(tools=[{"type": "function", "function": {"name": "sacks", "parameters": SACKS}}],
                                  tool_choice="required", **opts)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and len(m.tool_calls) == 1, m
    assert m.tool_calls[0].function.name == "sacks" and not m.content
    jsonschema.validate(json.loads(m.tool_calls[0].function.arguments), SACKS)
