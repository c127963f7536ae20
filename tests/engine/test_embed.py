"""Embeddings from the engine (Engine.embed) against the numpy reference, and the KV cache after one.

The engine's vector of a prompt is the numpy reference's (tests/engine/
reference/embed.py: final-normed rows, pooled, L2-normalised; no code shared
with vramd) within cosine 1 - 1e-5 for F32 and F16 weights: both dequantize
the same weights exactly and keep f32/f64 activations with an f16 cache, so
what is left is summation order (measured: 1 - cos below 1e-6 here).  A
vector of another pooling, or of the prompt shifted by one token, is far
from it (checked: the comparison can fail).  And an embedding reuses the KV
cache's rows: the generation after one must not take a stale prefix.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.engine.conformance.engine import EngineOn
from tests.engine.reference.embed import reference_embedding
from tests.ggufgen.gemma3 import write_gemma3
from tests.ggufgen.llama import write_llama

pytestmark = pytest.mark.gpu

PROMPT = [1, 17, 42, 99, 3, 250, 8, 64, 5, 77, 31, 2, 140, 7]
CTX = 64
COS_REF = 1e-5


@pytest.fixture
def loaded(device):
    made = []

    def make(*a, **kw):
        made.append(EngineOn(device, *a, **kw))
        return made[-1]

    yield make
    for m in made:
        m.close()


def cos(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.mark.parametrize("arch,weight_type", [("llama", "F32"), ("qwen3", "F16"), ("gemma3", "F32")])
@pytest.mark.parametrize("pooling", ["mean", "last", "cls"])
def test_embedding_is_the_references(tmp_path, loaded, arch, weight_type, pooling):
    code = {"mean": 1, "cls": 2, "last": 3}[pooling]
    if arch == "gemma3":
        path = write_gemma3(tmp_path / "m.gguf", weight_type=weight_type, pooling_type=code, seed=4)
    else:
        path = write_llama(tmp_path / "m.gguf", arch=arch, weight_type=weight_type, pooling_type=code,
                           **({"tied_output": True, "key_length": 64} if arch == "qwen3" else {}))
    m = loaded(path)
    assert m.engine.pooling == pooling
    v = m.engine.embed(PROMPT)
    assert v.dtype == np.float32 and v.shape == (m.engine.spec.n_embd,)
    assert abs(np.linalg.norm(v) - 1) < 1e-5
    ref = reference_embedding(path, PROMPT, pooling)
    assert 1 - cos(v, ref) < COS_REF, f"{arch} {weight_type} {pooling}: cosine {cos(v, ref)}"
    # Not vacuous: another pooling, or the prompt shifted by one token, is far from it.
    other = reference_embedding(path, PROMPT, "cls" if pooling != "cls" else "mean")
    shifted = reference_embedding(path, PROMPT[1:] + [9], pooling)
    assert 1 - cos(v, other) > 100 * COS_REF and 1 - cos(v, shifted) > 100 * COS_REF


def test_chunked_prompt_and_override(tmp_path, loaded):
    """A prompt longer than a chunk (rows from several chunks), and --pooling over the file's."""
    path = write_llama(tmp_path / "m.gguf", weight_type="F32", pooling_type=3)
    m = loaded(path, pooling="mean", batch=4)
    assert m.engine.pooling == "mean"
    ids = PROMPT * 3
    assert 1 - cos(m.engine.embed(ids), reference_embedding(path, ids, "mean")) < COS_REF


def test_no_pooling_and_too_long(tmp_path, loaded):
    from vramd.errors import UsageError
    path = write_llama(tmp_path / "m.gguf", weight_type="F32")   # no pooling_type: llama.cpp's none
    m = loaded(path)
    assert m.engine.pooling == "none"
    with pytest.raises(UsageError, match="--pooling mean"):
        m.engine.embed(PROMPT)
    m2 = loaded(write_llama(tmp_path / "p.gguf", weight_type="F32", pooling_type=1))
    with pytest.raises(UsageError, match=f"65 tokens: the context holds {CTX}"):
        m2.engine.embed(list(range(1, 66)))
    assert len(m2.engine.embed(list(range(1, 65)))) == 128   # the whole context is fine


def test_generation_after_an_embedding_takes_no_stale_prefix(tmp_path, loaded):
    """generate(A); embed(B); generate(A) gives the first generation's tokens, reusing only
    what A shares with B; and a prompt that starts with B reuses B."""
    from vramd.engine.sampler import SamplingParams
    m = loaded(write_llama(tmp_path / "m.gguf", weight_type="F32", pooling_type=1))
    e = m.engine
    a, b = [1, 40, 41, 42, 43, 44, 45, 46], [1, 40, 90, 91, 92, 93, 94, 95, 96, 97]
    params = SamplingParams(temperature=0.0, max_tokens=8)

    def gen(ids):
        out = []
        before = e.stats["reused_tokens"]
        e.generate(ids, params, lambda p: out.append(p.token) or True)
        return out, e.stats["reused_tokens"] - before

    first, _ = gen(a)
    e.embed(b)
    again, reused = gen(a)
    assert again == first
    assert reused == 2   # [1, 40]: the rows the embedding wrote for the same tokens
    fresh = loaded(write_llama(tmp_path / "m2.gguf", weight_type="F32", pooling_type=1)).engine
    e.embed(b)
    tail, reused = gen(b + [5, 6])
    want = []
    fresh.generate(b + [5, 6], params, lambda p: want.append(p.token) or True)
    assert reused == len(b) and tail == want


def test_fim_tokens_as_llama_cpp_finds_them(tmp_path):
    """The current keys, the older ones (which win where both are set, as in llama.cpp),
    the token texts; a vocabulary without them is a 400 naming what is missing."""
    from vramd.engine.fim import FimTokens
    from vramd.engine.runner import Engine
    from vramd.errors import UsageError
    from vramd.model.gguf_check import validate_gguf
    for fim in ("keys", "legacy", "text"):
        mf = validate_gguf(write_llama(tmp_path / f"{fim}.gguf", arch="qwen2", fim=fim))
        tok, _ = Engine.text_front(mf)
        f = FimTokens.find(mf.metadata, tok)
        assert (f.pre, f.suf, f.mid) == (509, 510, 511) and not f.missing(), fim
        ids = f.prompt(tok, "ab", "cd")
        assert ids[0] == 509 and ids[-1] == 511 and 510 in ids   # no BOS: this vocabulary adds none
    md = dict(mf.metadata) | {"tokenizer.ggml.fim_pre_token_id": 5, "tokenizer.ggml.prefix_token_id": 7,
                              "tokenizer.ggml.fim_suf_token_id": 100000}   # out of range: ignored
    f = FimTokens.find(md, tok)
    assert f.pre == 7 and f.suf == 510
    mf = validate_gguf(write_llama(tmp_path / "none.gguf", arch="qwen2"))
    tok, _ = Engine.text_front(mf)
    f = FimTokens.find(mf.metadata, tok)
    assert f.missing() == ["prefix (FIM_PRE)", "suffix (FIM_SUF)", "middle (FIM_MID)"]
    with pytest.raises(UsageError, match=r"no fill-in-the-middle token for the prefix \(FIM_PRE\), suffix"):
        f.prompt(tok, "a", "b")


@pytest.mark.parametrize("arch", ["qwen3moe", "mixtral"])
def test_moe_embedding_is_the_references(tmp_path, loaded, arch):
    """Mixture-of-experts layers leave h = output_norm(x) too (--pooling: the MoE writer has no key)."""
    from tests.ggufgen.moe import write_moe
    path = write_moe(tmp_path / "m.gguf", arch=arch, weight_type="F32")
    for pooling in ("mean", "last"):
        m = loaded(path, pooling=pooling)
        v = m.engine.embed(PROMPT)
        assert 1 - cos(v, reference_embedding(path, PROMPT, pooling)) < COS_REF, f"{arch} {pooling}"
