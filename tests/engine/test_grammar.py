"""Constrained sampling (vramd/engine/grammar.py) through the real engine on lavapipe.

A synthetic qwen3 model with random weights has no idea what JSON is, so
whatever it writes under a schema is the grammar's doing: every answer must
validate against its schema (jsonschema), over many random schemas and
seeds.  The schemas are bounded (strings with maxLength, integers with a
range, arrays with maxItems), so that a random model finishes them in a
few dozen tokens; the test asserts it did (finish "stop"), not a cut-off.
"""

import json

import jsonschema
import numpy as np
import pytest

from tests.ggufgen.llama import write_llama
from vramd.engine import grammar as g
from vramd.engine.arch import spec_for
from vramd.engine.prompt import Prompt
from vramd.engine.runner import Engine
from vramd.engine.sampler import Sampler, SamplingParams
from vramd.engine.scratch import scratch_layout
from vramd.errors import UsageError
from vramd.model import loader
from vramd.model.gguf_check import validate_gguf

CTX = 256


@pytest.fixture(scope="module")
def engine(device, tmp_path_factory):
    from vramd.gpu.residency import Residency

    path = write_llama(tmp_path_factory.mktemp("grammar") / "q.gguf", arch="qwen3", n_embd=64, n_ff=128,
                       n_layer=1, seed=3)
    mf = validate_gguf(path)
    res = Residency(device)
    lm = loader.load(path, res, CTX, mf=mf, scratch=scratch_layout(spec_for(mf)))
    res.restore(["weights", "state"])
    e = Engine(lm, res, CTX)
    yield e
    e.close()
    res.close()


def generate(engine, grammar, seed=0, temperature=1.0, max_tokens=200, prompt="The river ran"):
    ids = engine.prompt_ids(Prompt(kind="completion", prompt=prompt))
    pieces = []
    params = SamplingParams(temperature=temperature, top_k=0, top_p=1.0, min_p=0.0, seed=seed,
                            max_tokens=max_tokens, grammar=grammar)
    finish = engine.generate(ids, params, lambda p: pieces.append(p) or True)
    return "".join(p.text for p in pieces), finish, [p.token for p in pieces if p.token >= 0]


def test_the_mask_allows_exactly_the_tokens_that_continue_the_grammar(engine):
    tok = engine.tokenizer
    c = g.Constraint(tok, g.json_schema({"enum": ["river", "rain", "road"]}))
    pieces = {i: tok.token_to_piece(i).decode("utf-8", "replace") for i in range(tok.n_vocab)
              if not tok.is_control(i)}

    def continuing(targets):
        return {i for i, p in pieces.items() if p and any(t.startswith(p) for t in targets)}

    assert set(np.flatnonzero(c.allowed()).tolist()) == continuing(['"river"', '"rain"', '"road"'])
    c.advance(tok.encode('"', add_special=False)[0])
    want = continuing(['river"', 'rain"', 'road"'])
    assert set(np.flatnonzero(c.allowed()).tolist()) == want and len(want) >= 2
    # Once the value is complete only an end of generation is left.
    for t in tok.encode('road"', add_special=False):
        c.advance(t)
    assert c.done and set(np.flatnonzero(c.allowed()).tolist()) <= set(tok.eog_ids)


def test_a_greedy_constrained_step_takes_the_best_allowed_token(engine):
    rng = np.random.default_rng(5)
    c = g.Constraint(engine.tokenizer, g.json_schema({"type": "integer"}))
    logits = rng.normal(size=engine.tokenizer.n_vocab).astype(np.float32)
    allowed = c.allowed()
    best = int(np.flatnonzero(allowed)[np.argmax(logits[allowed])])
    assert Sampler(SamplingParams(temperature=0.0)).sample(c.masked(logits)) == best
    assert int(np.argmax(logits)) != best or allowed[int(np.argmax(logits))]


def test_the_mask_computed_ahead_on_the_worker_equals_the_one_computed_in_place(engine):
    # The generation loop asks for the next mask right after advancing (Constraint.prefetch),
    # while the GPU runs the step; the logits it then masks must be masked exactly as in place.
    tok, rng = engine.tokenizer, np.random.default_rng(11)
    grammar = g.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    ahead, here = g.Constraint(tok, grammar), g.Constraint(tok, grammar)
    for _ in range(12):
        logits = rng.normal(size=tok.n_vocab + 3).astype(np.float32)   # rows past the vocabulary too
        ahead.prefetch()
        a, b = ahead.masked(logits), here.masked(logits)
        assert np.array_equal(a, b) and np.isinf(a[tok.n_vocab:]).all()
        token = int(np.argmax(b))
        if tok.is_eog(token):
            break
        ahead.prefetch()          # a mask of a state about to be left: dropped by advance
        ahead.advance(token)
        here.advance(token)
    assert np.isfinite(a).sum() >= 1


def test_generation_ends_when_the_grammar_is_complete(engine):
    text, finish, tokens = generate(engine, g.json_schema({"const": {"done": True}}), max_tokens=100)
    assert json.loads(text) == {"done": True}
    assert finish == "stop" and len(tokens) < 100
    free, _, _ = generate(engine, None, max_tokens=12)
    assert free != text   # the same prompt unconstrained writes something else


def random_schema(rng, depth=0) -> dict:
    kinds = ["integer", "boolean", "string", "enum", "null", "pattern", "number"]
    if depth < 2:
        kinds += ["object", "object", "array", "anyOf"]
    kind = kinds[rng.integers(len(kinds))]
    if kind == "integer":
        lo = int(rng.integers(-50, 50))
        return {"type": "integer", "minimum": lo, "maximum": lo + int(rng.integers(0, 1000))}
    if kind == "number":
        return {"type": "number", "minimum": -1, "maximum": 1}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "string":
        return {"type": "string", "minLength": int(rng.integers(0, 3)), "maxLength": int(rng.integers(3, 8))}
    if kind == "enum":
        return {"enum": ["mill", "river", 7, None][:int(rng.integers(1, 5))]}
    if kind == "null":
        return {"type": "null"}
    if kind == "pattern":
        return {"type": "string", "pattern": "^[a-c]{1,4}-[0-9]{2}$"}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": 1,
                "maxItems": int(rng.integers(1, 4))}
    if kind == "anyOf":
        return {"anyOf": [random_schema(rng, depth + 1), random_schema(rng, depth + 1)]}
    names = ["name", "count", "tags", "ok", "where"]
    n = int(rng.integers(1, 4))
    props = {names[k]: random_schema(rng, depth + 1) for k in rng.choice(len(names), n, replace=False)}
    required = [k for k in props if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


@pytest.mark.parametrize("seed", range(40))
def test_every_answer_under_a_schema_validates(engine, seed):
    rng = np.random.default_rng(1000 + seed)
    schema = random_schema(rng)
    grammar = g.json_schema(schema)
    g.check(grammar, engine.tokenizer, "response_format")
    text, finish, _ = generate(engine, grammar, seed=seed, temperature=[0.0, 0.7, 1.0, 1.5][seed % 4],
                               max_tokens=CTX - 16)
    assert finish == "stop", (schema, text)
    jsonschema.validate(json.loads(text), schema)


def test_a_schema_feature_llguidance_cannot_enforce_is_refused_by_name(engine):
    for schema, word in (({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
                         ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "if")):
        with pytest.raises(UsageError, match=word):
            g.check(g.json_schema(schema), engine.tokenizer, "response_format")
    g.check(g.json_schema({"type": "object", "properties": {"a": {"type": "string", "format": "email"}}}),
            engine.tokenizer, "response_format")


def test_a_sentencepiece_vocabulary_walks_the_grammar_too():
    """SentencePiece adds a leading space when it tokenizes text: the ids llguidance asks for
    a forced piece of the grammar must spell it exactly (a '[' came back as ' ', '[' once)."""
    from tests.ggufgen.vocab import make_vocab
    from vramd.engine.tokenizer import Tokenizer

    v = make_vocab("spm", 600)
    tok = Tokenizer.from_metadata({"tokenizer.ggml.model": v.model, "tokenizer.ggml.tokens": v.tokens,
                                   "tokenizer.ggml.scores": v.scores, "tokenizer.ggml.token_type": v.types})
    want = [{"mill": 12, "day": "Monday"}]
    c = g.Constraint(tok, g.json_schema({"const": want}))
    rng, out = np.random.default_rng(2), []
    while not c.done:
        token = int(np.argmax(c.masked(rng.normal(size=tok.n_vocab).astype(np.float32))))
        if tok.is_eog(token):
            break
        c.advance(token)
        out.append(token)
    assert json.loads(tok.decode(out)) == want


def test_the_llguidance_tokenizer_is_built_once_per_vocabulary(engine):
    assert g.ll_tokenizer(engine.tokenizer) is g.ll_tokenizer(engine.tokenizer)


PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "days"], "additionalProperties": False}
TEMPLATES = {   # the markers tools.detect looks for, as real templates hold them
    "hermes": "{{ '<tool_call>' }}{% for m in messages %}{{ m.content }}{% endfor %}",
    "llama3": "{{ '<|start_header_id|>ipython<|end_header_id|>' }}{% for m in messages %}{{ m.content }}{% endfor %}",
    "mistral": "{{ '[TOOL_CALLS]' }}{% for m in messages %}{{ m.content }}{% endfor %}",
    "generic": "{% for m in messages %}{{ m.content }}{% endfor %}",
}


@pytest.mark.parametrize("fmt", sorted(TEMPLATES))
@pytest.mark.parametrize("choice", ["required", "function"])
def test_a_forced_tool_call_parses_and_validates_in_every_format(engine, fmt, choice):
    from vramd.engine.chat import ChatTemplate
    from vramd.server import toolcalls, tools
    from vramd.server.openai_api import GenerationRequest
    from vramd.server.structured import parse

    fns = [{"type": "function", "function": {"name": n, "parameters": PARAMS}} for n in ("weather", "tide")]
    body = {"tools": fns, "tool_choice": "required" if choice == "required" else
            {"type": "function", "function": {"name": "tide"}}, "parallel_tool_calls": fmt != "llama3"}
    req = GenerationRequest(kind="chat", messages=[{"role": "user", "content": "Rain?"}],
                            structured=parse(body, "chat"))
    grammar, special = tools.plan(engine.tokenizer, ChatTemplate(TEMPLATES[fmt]), req)
    assert req.tool_format == fmt and grammar is not None
    for seed in range(2):
        ids = engine.prompt_ids(Prompt(kind="completion", prompt="The river"))
        pieces = []
        params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed, max_tokens=CTX - 16,
                                grammar=grammar, special_text=special)
        assert engine.generate(ids, params, lambda p: pieces.append(p) or True) == "stop"
        content, calls = toolcalls.parse(fmt, "".join(p.text for p in pieces))
        assert calls, "".join(p.text for p in pieces)
        for call in calls:
            assert call.name in (("weather", "tide") if choice == "required" else ("tide",))
            jsonschema.validate(json.loads(call.arguments), PARAMS)


LAZY = {   # tool_choice auto: (the trigger, a call of "tide" after it, text that only looks like one)
    "hermes": ("<tool_call>", '\n{"name": "tide", "arguments": {"city": "Ely", "days": 2}}\n</tool_call>',
               "I will use <tool_"),
    "llama3": ('{"name"', ': "tide", "parameters": {"city": "Ely", "days": 2}}', '{"answer": 1} or {"name"'),
    "mistral": ("[TOOL_CALLS]", '[{"name": "tide", "arguments": {"city": "Ely", "days": 2}, "id": "abcdefghi"}]',
                "a [TOOL_CALL"),
}


def auto_grammar(tok, fmt, parallel, reasoning_open=False):
    from vramd.engine.chat import ChatTemplate
    from vramd.server import tools
    from vramd.server.openai_api import GenerationRequest
    from vramd.server.structured import parse

    fns = [{"type": "function", "function": {"name": n, "parameters": PARAMS}} for n in ("weather", "tide")]
    req = GenerationRequest(kind="chat", messages=[{"role": "user", "content": "Rain?"}],
                            structured=parse({"tools": fns, "parallel_tool_calls": parallel}, "chat"))
    src = TEMPLATES[fmt] + ("{{ '<think>' }}" if reasoning_open else "")
    if reasoning_open:
        src += "{% if add_generation_prompt %}{{ '<think>\n' }}{% endif %}"
    grammar, _ = tools.plan(tok, ChatTemplate(src), req)
    assert req.tool_format == fmt and grammar is not None
    return grammar


def _utf8(piece: bytes) -> bool:
    try:
        piece.decode("utf-8")
    except UnicodeDecodeError:
        return False     # a byte that is no character's start: the text regex wants UTF-8
    return True


def walk(c, tok, text) -> str | None:
    """Feed `text` through constraint `c`; None when every token was allowed, else the text refused."""
    ids = tok.encode(text, add_special=False, parse_special=False, space_prefix=False)
    for k, token in enumerate(ids):
        if not c.masked(np.zeros(tok.n_vocab, np.float32))[token] > -np.inf:
            return tok.decode(ids[k:])
        c.advance(token)
        c.prefetch()
    return None


def sample_on(c, tok, rng, limit=200) -> list[int]:
    """Random logits under the mask until an end of generation (or the grammar is done)."""
    out = []
    while len(out) < limit and not c.done:
        token = int(np.argmax(c.masked(rng.normal(size=tok.n_vocab).astype(np.float32))))
        if tok.is_eog(token):
            break
        c.advance(token)
        c.prefetch()
        out.append(token)
    return out


@pytest.mark.parametrize("fmt", sorted(LAZY))
@pytest.mark.parametrize("parallel", [False, True])
def test_auto_tools_leave_text_free_until_the_trigger_then_only_a_known_call(engine, fmt, parallel):
    """llama.cpp's lazy grammar: the mask allows every text token until the format's trigger;
    after it, only a call of a request's tool with valid arguments; without parallel calls,
    after one call only the end of generation."""
    from vramd.server import toolcalls

    tok = engine.tokenizer
    grammar = auto_grammar(tok, fmt, parallel)
    trigger, call, lookalike = LAZY[fmt]
    text_tokens = np.array([not tok.is_control(i) and _utf8(tok.token_to_piece(i)) for i in range(tok.n_vocab)])
    c = g.Constraint(tok, grammar)
    assert walk(c, tok, "The river ran" if fmt == "llama3" else "The river ran " + lookalike) is None
    free = np.isfinite(c.masked(np.zeros(tok.n_vocab, np.float32)))
    assert free[text_tokens].all()
    assert c.accepting                 # free text may end here
    if fmt == "llama3":                # a JSON answer that is no call stays free, and {"name" only counts first
        c = g.Constraint(tok, grammar)
        assert walk(c, tok, lookalike) is None and c.accepting
    c = g.Constraint(tok, grammar)
    assert walk(c, tok, "Let me see. " * (fmt != "llama3") + trigger + call.replace("tide", "flood")) is not None
    c = g.Constraint(tok, grammar)
    assert walk(c, tok, trigger + call.replace('"Ely"', '"Elysium"')) is not None   # maxLength 5
    c = g.Constraint(tok, grammar)
    assert walk(c, tok, trigger + call) is None
    assert c.done == (not parallel or fmt == "llama3")
    if not c.done:                     # parallel: text and more calls may follow
        assert walk(c, tok, " then " + trigger + call) is None
    for seed in range(3):              # whatever random logits pick after the trigger is a valid call
        rng = np.random.default_rng(seed)
        c = g.Constraint(tok, grammar)
        assert walk(c, tok, trigger) is None
        ids = tok.encode(trigger, add_special=False, parse_special=False, space_prefix=False) + sample_on(c, tok, rng)
        text = tok.decode(ids)
        _, calls = toolcalls.parse(fmt, text)
        assert calls, text
        assert len(calls) == 1 or parallel, text
        for one in calls:
            assert one.name in ("weather", "tide")
            jsonschema.validate(json.loads(one.arguments), PARAMS)


def test_under_an_open_think_block_the_trigger_counts_only_after_it(engine):
    tok = engine.tokenizer
    grammar = auto_grammar(tok, "hermes", False, reasoning_open=True)
    trigger, call, _ = LAZY["hermes"]
    c = g.Constraint(tok, grammar)
    assert walk(c, tok, "maybe " + trigger + call.replace("tide", "flood") + " no") is None   # a thought
    c = g.Constraint(tok, grammar)
    assert walk(c, tok, "maybe</think>\n\nso " + trigger + call.replace("tide", "flood")) is not None
    c = g.Constraint(tok, grammar)
    assert walk(c, tok, "maybe</think>\n\nso " + trigger + call) is None and c.done


def test_the_matchers_state_is_read_while_the_next_mask_is_computed(engine):
    """`done` (read by the generation loop right after `prefetch`) does not touch the matcher the
    worker is filling a mask from: llguidance raised "Already mutably borrowed" (seen 2 runs in 3
    on tests/engine/test_harmony_grammar.py's random walks before the state was kept)."""
    tok = engine.tokenizer
    c = g.Constraint(tok, g.lark('start: /[a-z ]*/ "."\n'))
    rng = np.random.default_rng(0)
    for _ in range(400):
        token = int(np.argmax(c.masked(rng.normal(size=tok.n_vocab).astype(np.float32))))
        if tok.is_eog(token):
            break
        c.advance(token)
        c.prefetch()
        if c.done:
            break
        assert not c.accepting
