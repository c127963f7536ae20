"""Constrained harmony answers (vramd/server/harmony_grammar.py, planned by
vramd/server/tools.py) on a synthetic gpt-oss file with harmony's control tokens
and a harmony template (tests/ggufgen: GptOssSpec(harmony=True)).

The masks are checked exactly (what may follow each marker), then the real
engine (lavapipe) with random weights writes under the grammars: what it writes
must read back (vramd/server/assistant.py) as reasoning_content beside JSON
valid for the schema, or as calls of the request's tools with valid arguments.
"""

import json

import jsonschema
import numpy as np
import pytest

from tests.engine.test_grammar import _utf8, random_schema, sample_on
from tests.ggufgen.gptoss import write_gptoss
from vramd.engine import grammar as g
from vramd.engine.arch import spec_for
from vramd.engine.chat import ChatTemplate
from vramd.engine.prompt import Prompt
from vramd.engine.runner import Engine
from vramd.engine.sampler import SamplingParams
from vramd.engine.scratch import scratch_layout
from vramd.model import loader
from vramd.model.gguf_check import validate_gguf
from vramd.server import assistant, tools
from vramd.server.harmony_grammar import MARKERS
from vramd.server.openai_api import GenerationRequest
from vramd.server.structured import parse

CTX = 512
ASK = [{"role": "user", "content": "How many sacks came on Monday?"}]
SACKS = {"type": "object", "properties": {"day": {"enum": ["Monday", "Tuesday"]}, "n": {"type": "integer",
         "minimum": 0, "maximum": 99}}, "required": ["day", "n"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "weather_now", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "sacks", "parameters": SACKS}}]
SCHEMAS = {"weather": WEATHER, "weather_now": WEATHER, "sacks": SACKS}


@pytest.fixture(scope="module")
def engine(device, tmp_path_factory):
    from vramd.gpu.residency import Residency

    path = write_gptoss(tmp_path_factory.mktemp("harmony") / "h.gguf", harmony=True, seed=5)
    mf = validate_gguf(path)
    res = Residency(device)
    lm = loader.load(path, res, CTX, mf=mf, scratch=scratch_layout(spec_for(mf)))
    res.restore(["weights", "state"])
    e = Engine(lm, res, CTX)
    e.template = ChatTemplate(mf.metadata["tokenizer.chat_template"])
    yield e
    e.close()
    res.close()


def request(**body):
    return GenerationRequest(kind="chat", messages=ASK, structured=parse(body, "chat"))


def planned(engine, **body):
    req = request(**body)
    grammar, special = tools.plan(engine.tokenizer, engine.template, req)
    assert special and grammar is not None
    return req, grammar


def ids_of(tok, parts):
    out = []
    for part in parts:
        out += [tok.token_id(part)] if part in MARKERS.values() else tok.encode(
            part, add_special=False, parse_special=False, space_prefix=False)
    return out


def after(tok, grammar, parts) -> set[int]:
    """The tokens the grammar allows once `parts` (markers, text) are written; each must be allowed."""
    c = g.Constraint(tok, grammar)
    for token in ids_of(tok, parts):
        assert c.allowed()[token], (parts, tok.tokens[token])
        c.advance(token)
    return set(np.flatnonzero(c.allowed()).tolist())


def marker(tok, *names):
    return {tok.token_id(n) for n in names}


def text_tokens(tok, ok):
    return {i for i in range(tok.n_vocab) if not tok.is_control(i) and ok(tok.token_to_piece(i))}


ANALYSIS = ["<|channel|>", "analysis", "<|message|>", "The mill, then", "<|end|>", "<|start|>", "assistant"]


def test_response_format_masks_leave_the_analysis_free_then_only_the_schemas_json(engine):
    tok = engine.tokenizer
    _, gr = planned(engine, response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": SACKS}})
    assert after(tok, gr, []) == marker(tok, "<|channel|>")
    assert {tok.tokens[i] for i in after(tok, gr, ["<|channel|>"])} <= {"a", "an", "f", "fin", "final", "analysis"} \
        and after(tok, gr, ["<|channel|>"])
    # the thought: any text without "<|" (no marker spelled in text), or its end
    free = after(tok, gr, ANALYSIS[:3])
    end = marker(tok, "<|end|>")
    assert text_tokens(tok, lambda p: b"<|" not in p and _utf8(p)) | end <= free   # (and UTF-8 lead bytes)
    assert free <= text_tokens(tok, lambda p: b"<|" not in p) | end
    assert not free & text_tokens(tok, lambda p: b"<|" in p)
    assert after(tok, gr, ANALYSIS[:5]) == marker(tok, "<|start|>")
    assert after(tok, gr, ANALYSIS) == marker(tok, "<|channel|>")
    final = ANALYSIS + ["<|channel|>", "final", "<|message|>"]
    first = after(tok, gr, final)
    assert first == text_tokens(tok, lambda p: p.startswith(b"{") and json_prefix(p)) and first
    assert after(tok, gr, final + ['{"day": "Tuesday", "n": 42}']) == marker(tok, "<|return|>")
    # a value outside the schema is refused; no marker but <|end|> inside the thought
    c = g.Constraint(tok, gr)
    for token in ids_of(tok, final + ['{"day": "Sun']):
        ok = c.allowed()[token]
        if not ok:
            break
        c.advance(token)
    assert not ok
    assert not after(tok, gr, ["<|channel|>", "analysis", "<|message|>"]) >= set(ids_of(tok, ["<|channel|>"]))


def json_prefix(piece: bytes) -> bool:
    # a piece that may begin {"day"... or {"n"... (with the bounded whitespace)
    text = piece.decode("utf-8", "replace")
    for full in ('{"day": ', '{"n": ', '{"day":', '{"n":', '{ "day"', '{ "n"', '{\n'):
        if full.startswith(text) or text.startswith(full):
            return True
    return False


def names_after(tok, gr, parts) -> set[str]:
    """Every name the grammar admits after `parts`: a walk of every allowed token up to the end of
    the name (a marker, or a token starting with the space of " <|constrain|>json")."""
    out = set()

    def dfs(prefix: bytes, c):
        allowed = c.allowed()
        for t in np.flatnonzero(allowed):
            piece = tok.token_to_piece(int(t)) if not tok.is_control(int(t)) else None
            if piece is None:
                out.add(prefix.decode())   # a marker: the name is complete
                continue
            if b" " in piece and piece.index(b" ") == 0:
                out.add(prefix.decode())
                continue
            c2 = g.Constraint(tok, gr)
            for token in ids_of(tok, parts) + tok.encode(prefix.decode() + piece.decode(), add_special=False,
                                                          parse_special=False, space_prefix=False):
                c2.advance(token)
            dfs(prefix + piece, c2)

    c = g.Constraint(tok, gr)
    for token in ids_of(tok, parts):
        c.advance(token)
    dfs(b"", c)
    return out


@pytest.mark.parametrize("choice, names", [("required", {"weather", "weather_now", "sacks"}),
                                           ({"type": "function", "function": {"name": "weather_now"}},
                                            {"weather_now"})])
def test_forced_call_masks_restrict_the_name_and_the_arguments(engine, choice, names):
    tok = engine.tokenizer
    _, gr = planned(engine, tools=TOOLS, tool_choice=choice)
    # a thought, a commentary preamble or the call itself first; never the final channel
    assert after(tok, gr, []) == marker(tok, "<|channel|>") | text_tokens(tok, lambda p: " to=functions.".startswith(
        p.decode("utf-8", "replace")) and p)
    assert not any(tok.tokens[i].startswith("f") for i in after(tok, gr, ["<|channel|>"]))
    assert names_after(tok, gr, ["<|channel|>", "commentary to=functions."]) == names
    assert names_after(tok, gr, ANALYSIS + [" to=functions."]) == names      # the recipient in the role
    name = "weather_now"
    head = ["<|channel|>", "commentary to=functions." + name, " ", "<|constrain|>", "json", "<|message|>"]
    assert after(tok, gr, head + ['{"city": "Oslo"}']) == marker(tok, "<|call|>")
    assert not after(tok, gr, head + ['{"city": "Osloo']) & set(ids_of(tok, ["s"]))   # maxLength 5
    assert after(tok, gr, head[:2]) == marker(tok, "<|message|>") | set(ids_of(tok, [" "]))


def test_auto_tools_leave_text_and_channels_free_until_a_recipient(engine):
    tok = engine.tokenizer
    _, gr = planned(engine, tools=TOOLS, response_format={"type": "json_object"})
    assert len(after(tok, gr, ["Plain text, no channels"])) > 200        # plain text stays free
    assert len(after(tok, gr, ANALYSIS[:3])) > 200                        # the thought too
    assert after(tok, gr, ANALYSIS + ["<|channel|>", "commentary", "<|message|>", "Let me look", "<|end|>"]) \
        == marker(tok, "<|start|>")
    assert names_after(tok, gr, ANALYSIS + ["<|channel|>", "commentary to=functions."]) == set(SCHEMAS)
    assert names_after(tok, gr, ANALYSIS + [" to=functions."]) == set(SCHEMAS)       # the recipient in the role
    assert not after(tok, gr, ANALYSIS + ["<|channel|>", "commentary to=functions.sacks", "<|message|>"]) \
        & set(ids_of(tok, ["Plain"]))                                                   # the arguments are JSON
    # with a response_format the final channel's body is the schema's JSON (an object here)
    assert after(tok, gr, ANALYSIS + ["<|channel|>", "final", "<|message|>", "{}"]) == marker(tok, "<|return|>")


def generate(engine, req, grammar, seed, max_tokens=CTX - 64):
    text = engine.template.render(req.messages, add_generation_prompt=True, **req.template_kwargs)
    ids = engine.prompt_ids(Prompt(kind="completion", prompt=text))
    pieces = []
    # the thought is free text: a random model would write it to the length limit, so its end is
    # favoured (a request option the sampler applies after the mask: it makes nothing disallowed likely)
    bias = ((engine.tokenizer.token_id("<|end|>"), 6.0),)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed, max_tokens=max_tokens,
                            grammar=grammar, special_text=True, logit_bias=bias)
    finish = engine.generate(ids, params, lambda p: pieces.append(p) or True)
    return "".join(p.text for p in pieces), finish


@pytest.mark.parametrize("seed", range(8))
def test_random_weights_under_a_schema_write_a_thought_then_valid_json(engine, seed):
    schema = random_schema(np.random.default_rng(2000 + seed))
    req, gr = planned(engine, response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    text, finish = generate(engine, req, gr, seed)
    assert finish == "stop", text
    message = assistant.message(None, req.reasoning, text)
    jsonschema.validate(json.loads(message["content"]), schema)
    assert text.startswith("<|channel|>")
    if text.startswith("<|channel|>analysis"):
        assert message["reasoning_content"] == text.split("<|message|>", 1)[1].split("<|end|>", 1)[0]


@pytest.mark.parametrize("seed, choice, parallel", [(0, "required", True), (1, "required", False),
                                                    (2, {"type": "function", "function": {"name": "sacks"}}, True)])
def test_random_weights_under_forced_tools_call_a_tool_with_valid_arguments(engine, seed, choice, parallel):
    req, gr = planned(engine, tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel)
    text, finish = generate(engine, req, gr, seed)
    assert finish == "stop", text
    message = assistant.message(req.tool_format, req.reasoning, text)
    assert len(message.get("tool_calls", [])) == 1, (text, message)       # <|call|> ends the turn
    fn = message["tool_calls"][0]["function"]
    assert fn["name"] in (SCHEMAS if choice == "required" else {"sacks"})
    jsonschema.validate(json.loads(fn["arguments"]), SCHEMAS[fn["name"]])


def test_random_logits_under_auto_tools_write_only_known_calls(engine):
    tok = engine.tokenizer
    _, gr = planned(engine, tools=TOOLS)
    rng, calls = np.random.default_rng(7), 0
    for _ in range(20):
        c = g.Constraint(tok, gr)
        for token in ids_of(tok, ANALYSIS + ["<|channel|>", "commentary"]):   # to a header: text or a recipient
            c.advance(token)
        text = tok.decode(sample_on(c, tok, rng, limit=160), special=True)
        if text.startswith(" to=functions."):
            name = text[len(" to=functions."):].split("<|", 1)[0].split(" ", 1)[0]
            assert name in SCHEMAS, text
            calls += 1
    assert calls     # some walks took the recipient (and then only a known name)
