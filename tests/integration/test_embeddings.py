"""/v1/embeddings and /v1/completions with `suffix` on real daemons, driven by the `openai` SDK.

The vectors are the numpy reference's (tests/engine/reference/embed.py) for the same
token ids, whichever way they are asked for: the SDK's default (base64, decoded by
the SDK), encoding_format="float", token ids (as LangChain sends them), several
inputs at once.  Bad inputs are 400s naming the problem.  `suffix` builds the
fill-in-the-middle prompt (vramd/engine/fim.py; llama.cpp holds it to its /infill
in tests/engine/test_embed_conformance.py): the completion is the greedy
continuation of exactly that prompt, and a model without FIM tokens is a 400.
"""

import json
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest

from tests.engine.reference.embed import reference_embedding
from tests.ggufgen.llama import write_llama

from .conftest import DaemonProc


def client(d: DaemonProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.member().endpoint + "/v1", api_key="unused", max_retries=0, timeout=120)


def post(d: DaemonProc, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(d.member().endpoint + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def cos(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_embeddings_through_the_sdk(arena, tmp_path, daemons):
    path = write_llama(tmp_path / "e.gguf", seed=5, n_vocab=384, vocab="spm", weight_type="F32", pooling_type=1)
    d = daemons(arena, path, "e", "--ctx", "64")
    c = client(d)
    texts = ["The river ran past the old mill.", "the miller's daughter", "12 sacks on Monday"]
    default = c.embeddings.create(model="e", input=texts)          # the SDK asks for base64 and decodes it
    floats = c.embeddings.create(model="e", input=texts, encoding_format="float")
    assert [x.index for x in default.data] == [0, 1, 2] and len(default.data[0].embedding) == 128
    for a, b in zip(default.data, floats.data):
        assert a.embedding == b.embedding                          # float32 both ways, bit for bit
    assert abs(np.linalg.norm(default.data[0].embedding) - 1) < 1e-5
    # Token ids (LangChain's way): the tokens of the first text, as the daemon's own tokenizer makes them.
    from vramd.engine.tokenizer import Tokenizer
    from vramd.model.gguf_check import validate_gguf
    tok = Tokenizer.from_metadata(validate_gguf(path).metadata)
    ids = tok.encode(texts[0], add_special=True, parse_special=True)
    by_ids = c.embeddings.create(model="e", input=[ids, ids[:5]])
    assert by_ids.data[0].embedding == default.data[0].embedding
    assert default.usage.prompt_tokens == sum(len(tok.encode(t, add_special=True, parse_special=True)) for t in texts)
    assert by_ids.usage.prompt_tokens == len(ids) + 5
    ref = reference_embedding(path, ids, "mean")
    assert 1 - cos(default.data[0].embedding, ref) < 1e-5
    assert 1 - cos(by_ids.data[1].embedding, ref) > 1e-3              # another input, another vector
    single = c.embeddings.create(model="e", input=ids[:5], encoding_format="float")   # one list of ids
    assert len(single.data) == 1 and single.data[0].embedding == by_ids.data[1].embedding
    assert c.embeddings.create(model="e", input="x", dimensions=128).data[0].embedding
    # Generation after embeddings: the cache held the embeddings' inputs, the answer is a fresh one's.
    r1 = c.completions.create(model="e", prompt=texts[1], max_tokens=6, temperature=0).choices[0].text
    c.embeddings.create(model="e", input=texts[2])
    assert c.completions.create(model="e", prompt=texts[1], max_tokens=6, temperature=0).choices[0].text == r1
    metrics = urllib.request.urlopen(d.member().endpoint + "/metrics", timeout=10).read().decode()
    assert 'vramd_request_seconds_count{name="e"}' in metrics
    assert "path=/v1/embeddings" in d.output and "inputs=3" in d.output


@pytest.mark.parametrize("body,message", [
    ({"input": []}, "'input' must be a string, a list of strings"),
    ({"input": ""}, "input[0] is empty"),
    ({"input": ["a", 3]}, "'input' must be"),
    ({"input": [[1, 2], [True]]}, "'input' must be"),
    ({"input": [1, 99999]}, "input[0]: token id 99999 is outside the vocabulary"),
    ({"input": [list(range(1, 70))]}, "input[0] has 69 tokens: the context holds 64"),
    ({"input": "a", "encoding_format": "int8"}, "'encoding_format' must be 'float' or 'base64'"),
    ({"input": "a", "dimensions": 64}, "'dimensions' 64: this model's embeddings have 128"),
    ({"input": "a", "truncate": True}, "'truncate' is not supported by /v1/embeddings"),
    ({"input": ["a"] * 2049}, "'input' has 2049 entries: at most 2048"),
])
def test_bad_embedding_requests(arena, tmp_path, daemons, body, message):
    d = _shared(arena, tmp_path, daemons)
    status, reply = post(d, "/v1/embeddings", {"model": "p", **body})
    assert status == 400, reply
    assert message in reply["error"]["message"]


_DAEMON: dict = {}


def _shared(arena, tmp_path, daemons):
    """One daemon for the bad-request cases (each is refused before the GPU)."""
    d = _DAEMON.get("d")
    if d is None or d.proc.poll() is not None:
        path = write_llama(tmp_path / "p.gguf", seed=6, n_vocab=384, vocab="spm", pooling_type=3)
        d = _DAEMON["d"] = DaemonProc(arena, path, "p", "--ctx", "64")
    return d


@pytest.fixture(scope="module", autouse=True)
def _stop_shared():
    yield
    d = _DAEMON.pop("d", None)
    if d is not None:
        d.stop()


def test_a_model_without_pooling(arena, tmp_path, daemons):
    """No <arch>.pooling_type: llama.cpp's none, a 400 naming --pooling; --pooling mean serves it."""
    path = write_llama(tmp_path / "g.gguf", seed=7, n_vocab=384, vocab="spm")
    d = daemons(arena, path, "g", "--ctx", "64")
    with pytest.raises(openai.BadRequestError, match="pooling type is none.*--pooling mean"):
        client(d).embeddings.create(model="g", input="hello")
    d.stop()
    d = daemons(arena, path, "g", "--ctx", "64", "--pooling", "mean")
    assert len(client(d).embeddings.create(model="g", input="hello").data[0].embedding) == 128


def test_suffix_fill_in_the_middle(arena, tmp_path, daemons):
    path = write_llama(tmp_path / "f.gguf", seed=8, arch="qwen2", fim="keys")
    d = daemons(arena, path, "f", "--ctx", "128")
    c = client(d)
    r = c.completions.create(model="f", prompt="def area(r):\n    return ", suffix="\n\nprint(area(2))\n",
                             max_tokens=8, temperature=0, logprobs=1)
    # The same continuation as the FIM prompt's ids sent as the prompt: that is the prompt it continued.
    from vramd.engine.fim import FimTokens
    from vramd.engine.tokenizer import Tokenizer
    from vramd.model.gguf_check import validate_gguf
    md = validate_gguf(path).metadata
    tok = Tokenizer.from_metadata(md)
    ids = FimTokens.find(md, tok).prompt(tok, "def area(r):\n    return ", "\n\nprint(area(2))\n")
    assert ids[0] == md["tokenizer.ggml.fim_pre_token_id"] and ids[-1] == md["tokenizer.ggml.fim_mid_token_id"]
    plain = c.completions.create(model="f", prompt=ids, max_tokens=8, temperature=0, logprobs=1)
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].text == plain.choices[0].text
    # (the second reuses the first's cached prompt, recomputing its last token alone: rounding)
    assert np.allclose(r.choices[0].logprobs.token_logprobs, plain.choices[0].logprobs.token_logprobs, atol=1e-4)
    without = c.completions.create(model="f", prompt="def area(r):\n    return ", max_tokens=8, temperature=0,
                                   logprobs=1)
    assert not np.allclose(without.choices[0].logprobs.token_logprobs, r.choices[0].logprobs.token_logprobs,
                           atol=1e-2)   # the suffix is not ignored
    with pytest.raises(openai.BadRequestError, match="'suffix' must be a string"):
        c.completions.create(model="f", prompt="a", extra_body={"suffix": 3})
    # Token ids before a suffix are checked as any prompt's: a 400 before the GPU, never a wrong answer.
    for bad in (99999999, -7, 10 ** 20):
        with pytest.raises(openai.BadRequestError, match=f"prompt: token id {bad} is outside the vocabulary"):
            c.completions.create(model="f", prompt=[1, 2, bad], suffix="x", max_tokens=4)
    d.stop()
    plain_model = write_llama(tmp_path / "n.gguf", seed=8, arch="qwen2")
    d = daemons(arena, plain_model, "n", "--ctx", "128")
    with pytest.raises(openai.BadRequestError, match=r"no fill-in-the-middle token for the prefix \(FIM_PRE\), "
                                                     r"suffix \(FIM_SUF\), middle \(FIM_MID\)"):
        client(d).completions.create(model="n", prompt="def f():", suffix="\n", max_tokens=4)
