"""The GPU forward pass against the numpy reference (tests/engine/reference.py).

Tolerance: logits agree to 2e-3 of their largest magnitude.  The GPU keeps
the KV cache in f16 and sums in a different order; the reference here keeps
its cache in f16 too (kv_dtype=np.float16), so what remains is f32
arithmetic.  Greedy generations must match token for token.
"""

import numpy as np
import pytest

from tests.engine.models import write_llama
from tests.engine.reference import ReferenceModel, top2_margin  # margins explain a failure
from vramd.engine.arch import spec_for
from vramd.engine.model import TransformerModel
from vramd.engine.scratch import scratch_layout
from vramd.model import loader
from vramd.model.gguf_check import validate_gguf

TOL = 2e-3
CTX = 96


@pytest.fixture
def build(device, tmp_path):
    from vramd.gpu.residency import Residency

    made = []

    def make(batch=64, **spec):
        path = write_llama(tmp_path / f"m{len(made)}.gguf", **spec)
        mf = validate_gguf(path)
        cfg = spec_for(mf)
        res = Residency(device)
        lm = loader.load(path, res, CTX, mf=mf, scratch=scratch_layout(cfg, batch))
        res.restore(["weights", "state"])
        model = TransformerModel(lm, res, CTX, lm.scratch, batch=batch)
        made.append((model, res))
        return model, ReferenceModel(path), res, lm

    yield make
    for model, res in made:
        model.close()
        res.close()


def rel_err(got, want):
    return float(np.abs(got - want).max() / (np.abs(want).max() + 1e-12))


@pytest.mark.parametrize("weight_type", ["F32", "F16", "BF16", "Q8_0", "Q4_0"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_logits_match_the_reference(build, weight_type, arch):
    model, ref, _res, _lm = build(arch=arch, weight_type=weight_type, n_head=4, n_head_kv=2, seed=7)
    prompt = [1, 17, 42, 99, 3, 250, 8, 64, 5]
    got = model.forward(prompt, 0, all_logits=True)
    want = ref.forward(prompt, ref.new_kv(np.float16), 0)
    assert got.shape == want.shape
    assert rel_err(got, want) < TOL
    # then incremental decoding on top of that cache
    kv = ref.new_kv(np.float16)
    ref.forward(prompt, kv, 0)
    for i, tok in enumerate([11, 12, 13]):
        step = model.forward([tok], len(prompt) + i)
        assert rel_err(step, ref.forward([tok], kv)[-1]) < TOL


@pytest.mark.parametrize("weight_type", ["F16", "Q8_0", "Q4_0"])
def test_greedy_generation_matches_token_for_token(build, weight_type):
    model, ref, _res, _lm = build(weight_type=weight_type, seed=11)
    prompt = [1, 30, 31, 32, 33]
    want, rows = ref.greedy_logits(prompt, 24, kv_dtype=np.float16)
    got, logits = [], model.forward(prompt, 0)
    for i in range(24):
        tok = int(np.argmax(logits))
        got.append(tok)
        logits = model.forward([tok], len(prompt) + i)
    # Token for token.  Where the reference's top two are within the
    # tolerance a flip would be legitimate; report the margins if it happens.
    assert got == want, (got, want, top2_margin(rows) / np.abs(rows).max())


def test_prefill_in_chunks_equals_one_shot(build):
    model, ref, _res, _lm = build(batch=4, seed=5)   # 4 tokens per chunk
    prompt = list(range(3, 14))
    got = model.forward(prompt, 0, all_logits=True)
    assert rel_err(got, ref.forward(prompt, ref.new_kv(np.float16), 0)) < TOL


def test_state_survives_release_and_restore(build):
    model, ref, res, _lm = build(seed=9)
    prompt = [1, 5, 6, 7, 8]
    model.forward(prompt, 0)
    res.release(["weights", "state", "scratch"])   # a switch: KV copied to its shadow
    res.restore(["weights", "state"])
    after = model.forward([9], len(prompt))
    kv = ref.new_kv(np.float16)
    ref.forward(prompt, kv, 0)
    assert rel_err(after, ref.forward([9], kv)[-1]) < TOL


def test_unsupported_architecture_and_type_are_load_errors(tmp_path):
    from tests.model.ggufgen import GGUFImage, write_model
    from gguf import GGUFValueType as V
    from vramd.errors import ModelError
    path = write_model(tmp_path / "x.gguf", seed=1)
    bad = GGUFImage.from_file(path).set_kv("general.architecture", V.STRING, "mamba").write(tmp_path / "m.gguf")
    with pytest.raises(ModelError, match="mamba"):
        spec_for(validate_gguf(bad))


def test_input_embeddings_stand_in_for_tokens(build):
    """An embedding given at a position (how an image enters the prompt) is used
    instead of the token table there: giving a token's own embedding row
    changes nothing, giving another row is the other token."""
    model, ref, _res, _lm = build(weight_type="F32", seed=13)
    prompt = [1, 17, 42, 99, 3]
    want = model.forward(prompt, 0, all_logits=True)
    table = ref.token_embd if hasattr(ref, "token_embd") else ref.tensors["token_embd.weight"]
    got = model.forward([1, 17, -5, 99, 3], 0, all_logits=True, embeds={2: table[42]})
    assert rel_err(got, want) < 1e-5
    other = model.forward([1, 17, 7, 99, 3], 0, all_logits=True)
    assert rel_err(model.forward(prompt, 0, all_logits=True, embeds={2: table[7]}), other) < 1e-5
