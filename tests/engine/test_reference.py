"""Tests of the numpy reference forward pass and of the synthetic model generator.

Owns: the evidence that tests/engine/reference.py is self-consistent (prefill
vs incremental decoding, prefix reuse, GQA vs repeated heads, tied vs untied
output, biases, the two RoPE orderings one permutation apart, dequantization
equal to gguf's) and that tests/engine/models.py writes valid, deterministic,
well-conditioned models with complete tokenizer metadata.
"""

from __future__ import annotations

import itertools

import gguf
import numpy as np
import pytest

from vramd.model.gguf_check import validate_gguf

from tests.engine.models import (BYTE, CONTROL, ENGINE_WEIGHT_TYPES, LLAMA_CPP_TOKENIZATIONS, NORMAL,
                                 WEIGHT_TYPES, LlamaSpec, gpt2_byte_chars, make_vocab, make_weights,
                                 write_llama, write_weights)
from tests.engine.reference import ReferenceModel, rope, rope_angles, top2_margin

ARCHS = ("llama", "mistral", "qwen2")
PROMPT = [17, 4, 300, 88, 123, 9, 250, 61, 402, 77, 5, 199]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """One default model per style (F16), written once for the tests that only read."""
    d = tmp_path_factory.mktemp("models")
    out = {a: ReferenceModel(write_llama(d / f"{a}.gguf", arch=a)) for a in ARCHS}
    out.update({f"{a}-tied": ReferenceModel(write_llama(d / f"{a}-tied.gguf", arch=a, tied_output=True))
                for a in ARCHS})
    return out


# --- the generator ------------------------------------------------------------------

# K-quants come in blocks of 256 values: they need wider rows than the defaults.
_SIZES = {t: (dict(n_embd=256, n_ff=512) if t.endswith("_K") else {}) for t in WEIGHT_TYPES}


@pytest.mark.parametrize("arch,weight_type", list(itertools.product(ARCHS, ENGINE_WEIGHT_TYPES))
                         + [("llama", t) for t in WEIGHT_TYPES if t not in ENGINE_WEIGHT_TYPES])
def test_validate_accepts_every_generated_model(tmp_path, arch, weight_type):
    for tied, vocab in ((False, None), (True, "spm"), (True, "bpe")):
        path = write_llama(tmp_path / f"m-{tied}-{vocab}.gguf", arch=arch, weight_type=weight_type,
                           tied_output=tied, vocab=vocab, **_SIZES[weight_type])
        mf = validate_gguf(path)
        assert mf.warnings == ()
        spec = LlamaSpec(arch=arch, weight_type=weight_type, tied_output=tied, vocab=vocab,
                         **_SIZES[weight_type]).resolve()
        assert mf.architecture == spec.gguf_arch
        names = {t.name for t in mf.tensors}
        assert ("output.weight" in names) == (not tied)
        assert ("blk.0.attn_q.bias" in names) == spec.with_bias
        for t in mf.tensors:
            want = WEIGHT_TYPES[weight_type] if len(t.shape) == 2 else gguf.GGMLQuantizationType.F32
            assert t.type == want, t.name


def test_same_arguments_same_bytes(tmp_path):
    a = write_llama(tmp_path / "a.gguf", arch="qwen2", weight_type="Q4_0", seed=3)
    b = write_llama(tmp_path / "b.gguf", arch="qwen2", weight_type="Q4_0", seed=3)
    c = write_llama(tmp_path / "c.gguf", arch="qwen2", weight_type="Q4_0", seed=4)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()


def test_spm_vocabulary(tmp_path):
    mf = validate_gguf(write_llama(tmp_path / "spm.gguf", arch="llama", n_vocab=400))
    md = mf.metadata
    tokens, types, scores = (md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"],
                             md["tokenizer.ggml.scores"])
    assert md["tokenizer.ggml.model"] == "llama"
    assert len(tokens) == len(types) == len(scores) == 400 == md["llama.vocab_size"]
    assert len(set(tokens)) == 400
    assert (tokens[0], types[0]) == ("<unk>", 2)
    assert tokens[md["tokenizer.ggml.bos_token_id"]] == "<s>"
    assert tokens[md["tokenizer.ggml.eos_token_id"]] == "</s>"
    assert types[1] == types[2] == CONTROL
    assert tokens[3:259] == [f"<0x{b:02X}>" for b in range(256)]
    assert set(types[3:259]) == {BYTE}
    assert md["tokenizer.ggml.add_bos_token"] is True
    assert md["tokenizer.ggml.add_space_prefix"] is True
    assert "[INST]" in md["tokenizer.chat_template"]
    # SentencePiece merges adjacent pieces into a known piece: every normal piece
    # longer than one character must be reachable as a pair of known pieces.
    normal = {t for t, ty in zip(tokens, types) if ty == NORMAL}
    for piece in normal:
        if len(piece) > 1:
            assert any(piece[:i] in normal and piece[i:] in normal for i in range(1, len(piece))), piece
    normal_scores = [s for s, ty in zip(scores, types) if ty == NORMAL]
    assert normal_scores == sorted(normal_scores, reverse=True)
    assert "\u2581the" in normal


def test_bpe_vocabulary(tmp_path):
    mf = validate_gguf(write_llama(tmp_path / "bpe.gguf", arch="qwen2", n_vocab=384))
    md = mf.metadata
    tokens, types, merges = (md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"],
                             md["tokenizer.ggml.merges"])
    assert md["tokenizer.ggml.model"] == "gpt2" and md["tokenizer.ggml.pre"] == "gpt-2"
    assert len(tokens) == len(types) == 384 and len(set(tokens)) == 384
    assert tokens[:256] == gpt2_byte_chars() and len(set(tokens[:256])) == 256
    assert tokens[-3:] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert types[-3:] == [CONTROL] * 3 and set(types[:-3]) == {NORMAL}
    assert tokens[md["tokenizer.ggml.bos_token_id"]] == "<|endoftext|>"
    assert tokens[md["tokenizer.ggml.eos_token_id"]] == "<|im_end|>"
    assert md["tokenizer.ggml.add_bos_token"] is False
    assert "<|im_start|>" in md["tokenizer.chat_template"]
    vocab = set(tokens)
    made = set()
    for m in merges:
        a, b = m.split(" ")
        assert a in vocab and b in vocab and a + b in vocab, m
        made.add(a + b)
    assert made == set(tokens[256:-3])       # every learned token comes from a merge
    assert "\u0120the" in vocab              # "Ġthe": GPT-2's space-prefixed word


def test_llama_cpp_goldens_spell_their_texts():
    """The recorded llama.cpp tokenizations still fit the vocabularies the generator
    makes (a change to CORPUS or to the trainer would break them here first)."""
    spm = make_vocab("spm", 512)
    for text, _, ids in LLAMA_CPP_TOKENIZATIONS["spm"]:
        out = b""
        for i in ids:
            piece = spm.tokens[i]
            if spm.types[i] == BYTE:
                out += bytes([int(piece[3:5], 16)])      # <0xXX>
            else:
                out += piece.replace("\u2581", " ").encode()
        assert out == (" " + text).encode()        # the space prefix SentencePiece adds
    bpe = make_vocab("bpe", 512)
    byte_of = {c: b for b, c in enumerate(gpt2_byte_chars())}
    for text, special, ids in LLAMA_CPP_TOKENIZATIONS["bpe"]:
        out = b""
        for i in ids:
            piece = bpe.tokens[i]
            out += piece.encode() if bpe.types[i] == CONTROL else bytes(byte_of[c] for c in piece)
        assert out == text.encode()
        assert any(bpe.types[i] == CONTROL for i in ids) == special


def test_vocab_sizes_are_exact_and_bounded():
    for kind, n in (("spm", 330), ("spm", 512), ("bpe", 259), ("bpe", 300), ("bpe", 512)):
        v = make_vocab(kind, n)
        assert len(v.tokens) == len(v.types) == n
    with pytest.raises(ValueError):
        make_vocab("spm", 256)


def test_dequantized_tensors_match_gguf(tmp_path):
    """Each weight type: the reference's arrays are gguf.quants.dequantize of the
    bytes gguf's own reader finds, and those are the generator's values as the
    type represents them."""
    for weight_type, qtype in WEIGHT_TYPES.items():
        sizes = _SIZES[weight_type] or dict(n_embd=64, n_ff=96)
        spec = LlamaSpec(arch="qwen2", weight_type=weight_type, n_vocab=300, n_layer=1, **sizes)
        values = make_weights(spec)
        path = write_weights(tmp_path / f"{weight_type}.gguf", spec, values)
        ref = ReferenceModel(path)
        reader = gguf.GGUFReader(str(path))
        assert {t.name for t in reader.tensors} == set(ref.tensors) == set(values)
        for t in reader.tensors:
            raw = np.asarray(t.data)
            expected = gguf.quants.dequantize(raw, t.tensor_type).reshape(values[t.name].shape)
            got = ref.tensors[t.name]
            assert got.dtype == np.float32 and got.shape == values[t.name].shape
            np.testing.assert_array_equal(got, expected, err_msg=f"{weight_type} {t.name}")
            if values[t.name].ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
                np.testing.assert_array_equal(got, values[t.name])
            elif qtype == gguf.GGMLQuantizationType.F16:
                np.testing.assert_array_equal(got, values[t.name].astype(np.float16).astype(np.float32))
            elif weight_type in ("BF16", "Q8_0", "Q4_0"):
                # BF16 keeps 8 bits of mantissa; Q8_0 and Q4_0 a 1/127 and 1/7 step of each
                # 32-block's absolute maximum.
                step = {"BF16": 2.0 ** -8, "Q8_0": 1 / 127, "Q4_0": 1 / 7}[weight_type]
                blocks = values[t.name].reshape(-1, 32)
                err = np.abs(got.reshape(-1, 32) - blocks)
                assert (err <= step * np.abs(blocks).max(axis=1, keepdims=True) + 1e-7).all()
            else:
                # the other types: their usual error relative to the values' rms (4-bit
                # types ~8 %, 5-bit ~4 %, Q6_K ~2 %); a mis-packed block would be ~100 %
                bound = {"Q4_1": 0.1, "Q5_0": 0.06, "Q5_1": 0.06, "Q4_K": 0.1, "Q5_K": 0.06, "Q6_K": 0.03}
                v = values[t.name]
                rel = np.sqrt(np.mean((got - v) ** 2) / np.mean(v ** 2))
                assert rel < bound[weight_type], (weight_type, t.name, rel)
        del reader


# --- self-consistency of the reference ------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16])
def test_prefill_equals_incremental(models, arch, kv_dtype):
    m = models[arch]
    full = m.forward(PROMPT, m.new_kv(kv_dtype))
    kv = m.new_kv(kv_dtype)
    steps = [m.forward(PROMPT[:4], kv)] + [m.forward([t], kv) for t in PROMPT[4:9]]
    steps.append(m.forward(PROMPT[9:], kv))          # a second chunk after single steps
    assert len(kv) == len(PROMPT)
    np.testing.assert_allclose(np.concatenate(steps), full, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_reuse_equals_fresh_prefill(models, arch):
    m = models[arch]
    kv = m.new_kv()
    m.forward(PROMPT, kv)
    other = PROMPT[:7] + [1, 2, 3]
    reused = m.forward(other[7:], kv, pos0=7)        # drops positions 7.. then appends
    fresh = m.forward(other)
    np.testing.assert_allclose(reused, fresh[7:], rtol=0, atol=1e-5)
    with pytest.raises(ValueError):
        m.forward([5], kv, pos0=len(kv) + 1)


def test_f16_cache_is_a_small_difference(models):
    """The f16 K/V rounding the engine will have: visible, and small against the
    logits' spread (what an engine tolerance has to cover)."""
    m = models["mistral"]
    a = m.forward(PROMPT, m.new_kv(np.float32))
    b = m.forward(PROMPT, m.new_kv(np.float16))
    diff = np.abs(a - b).max()
    assert 0 < diff < 1e-2 * a.std()


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_gqa_equals_repeated_kv_heads(tmp_path, arch):
    spec = LlamaSpec(arch=arch, weight_type="F32", n_embd=128, n_head=8, n_head_kv=2).resolve()
    w = make_weights(spec)
    group, hd = spec.n_head // spec.n_head_kv, spec.head_dim
    expanded = dict(w)
    for name, value in w.items():
        if any(k in name for k in ("attn_k.", "attn_v.")):
            heads = value.reshape(spec.n_head_kv, hd, *value.shape[1:])
            # query head j reads kv head j // group: kv head g serves heads g*group .. g*group+group-1
            expanded[name] = np.repeat(heads, group, axis=0).reshape(spec.n_head * hd, *value.shape[1:])
    gqa = ReferenceModel(write_weights(tmp_path / "gqa.gguf", spec, w))
    mha = ReferenceModel(write_weights(tmp_path / "mha.gguf",
                                       LlamaSpec(**{**spec.__dict__, "n_head_kv": spec.n_head}), expanded))
    assert (gqa.n_head_kv, mha.n_head_kv) == (2, 8)
    np.testing.assert_allclose(gqa.forward(PROMPT), mha.forward(PROMPT), rtol=0, atol=1e-9)


def test_tied_output_is_token_embd(tmp_path):
    tied_spec = LlamaSpec(arch="llama", weight_type="Q8_0", tied_output=True)
    w = make_weights(tied_spec)
    assert "output.weight" not in w
    tied = ReferenceModel(write_weights(tmp_path / "tied.gguf", tied_spec, w))
    untied_spec = LlamaSpec(**{**tied_spec.__dict__, "tied_output": False})
    same = ReferenceModel(write_weights(tmp_path / "same.gguf", untied_spec,
                                        {**w, "output.weight": w["token_embd.weight"]}))
    own = ReferenceModel(write_weights(tmp_path / "own.gguf", untied_spec,
                                       {**w, "output.weight": make_weights(untied_spec)["output.weight"]}))
    assert tied.tied_output and not same.tied_output
    logits = tied.forward(PROMPT)
    np.testing.assert_array_equal(logits, same.forward(PROMPT))
    assert np.abs(logits - own.forward(PROMPT)).max() > 1.0


def test_qwen2_biases_are_applied(tmp_path):
    spec = LlamaSpec(arch="qwen2", weight_type="F16").resolve()
    w = make_weights(spec)
    assert {"blk.0.attn_q.bias", "blk.0.attn_k.bias", "blk.0.attn_v.bias"} <= set(w)
    no_bias = {k: v for k, v in w.items() if not k.endswith(".bias")}
    zero_bias = {k: (np.zeros_like(v) if k.endswith(".bias") else v) for k, v in w.items()}
    with_b = ReferenceModel(write_weights(tmp_path / "b.gguf", spec, w)).forward(PROMPT)
    without = ReferenceModel(write_weights(tmp_path / "n.gguf", spec, no_bias)).forward(PROMPT)
    zeroed = ReferenceModel(write_weights(tmp_path / "z.gguf", spec, zero_bias)).forward(PROMPT)
    np.testing.assert_array_equal(zeroed, without)
    assert np.abs(with_b - without).max() > 1.0
    # each bias on its own changes the result
    for kind in ("attn_q", "attn_k", "attn_v"):
        one = {k: v for k, v in w.items() if not k.endswith(".bias") or kind in k}
        alone = ReferenceModel(write_weights(tmp_path / f"{kind}.gguf", spec, one)).forward(PROMPT)
        assert np.abs(alone - without).max() > 1e-3, kind


def test_neox_and_normal_rope_are_one_permutation_apart(tmp_path):
    """A qwen2 (NeoX) model equals a llama (normal RoPE) model whose q/k rows are
    permuted within each head the way convert_hf_to_gguf.py permutes HF Llama
    checkpoints: HF row i -> 2i, row i + d/2 -> 2i + 1."""
    neox_spec = LlamaSpec(arch="qwen2", weight_type="F32", with_bias=True, vocab="spm")
    w = make_weights(neox_spec)
    neox = ReferenceModel(write_weights(tmp_path / "neox.gguf", neox_spec, w))
    r = neox_spec.resolve()
    hd = r.head_dim

    def permute(value: np.ndarray) -> np.ndarray:
        heads = value.reshape(-1, 2, hd // 2, *value.shape[1:])       # [head, half, i, ...]
        return heads.swapaxes(1, 2).reshape(value.shape)              # [head, i, half, ...]

    permuted = {k: (permute(v) if any(s in k for s in ("attn_q.", "attn_k.")) else v)
                for k, v in w.items()}
    normal_spec = LlamaSpec(arch="llama", weight_type="F32", n_head_kv=r.n_head_kv, with_bias=True,
                            rope_freq_base=r.rope_freq_base, eps=r.eps)
    normal = ReferenceModel(write_weights(tmp_path / "normal.gguf", normal_spec, permuted))
    assert (neox.rope_ordering, normal.rope_ordering) == ("neox", "normal")
    np.testing.assert_allclose(neox.forward(PROMPT), normal.forward(PROMPT), rtol=0, atol=1e-9)
    # and without the permutation they differ: the ordering is not a no-op
    unpermuted = ReferenceModel(write_weights(tmp_path / "unperm.gguf", normal_spec, w))
    assert np.abs(neox.forward(PROMPT) - unpermuted.forward(PROMPT)).max() > 1e-2


def test_rope_by_hand():
    x = np.arange(1.0, 9.0).reshape(1, 1, 8)            # one token, one head, head_dim 8
    theta = rope_angles(np.array([3]), 8, 10000.0, 1.0)
    np.testing.assert_allclose(theta[0], 3 * 10000.0 ** (-np.arange(4) / 4))
    c, s = np.cos(theta[0]), np.sin(theta[0])
    normal = rope(x, theta, "normal")[0, 0]
    for i in range(4):                                   # pairs (2i, 2i+1)
        a, b = x[0, 0, 2 * i], x[0, 0, 2 * i + 1]
        assert normal[2 * i] == pytest.approx(a * c[i] - b * s[i])
        assert normal[2 * i + 1] == pytest.approx(a * s[i] + b * c[i])
    neox = rope(x, theta, "neox")[0, 0]
    for i in range(4):                                   # pairs (i, i+4)
        a, b = x[0, 0, i], x[0, 0, i + 4]
        assert neox[i] == pytest.approx(a * c[i] - b * s[i])
        assert neox[i + 4] == pytest.approx(a * s[i] + b * c[i])
    # position 0 is the identity; freq_scale scales the angle; n_rot < head_dim leaves the tail
    np.testing.assert_array_equal(rope(x, rope_angles(np.array([0]), 8, 1e4, 1.0), "normal"), x)
    np.testing.assert_allclose(rope_angles(np.array([6]), 8, 1e4, 0.5), theta)
    partial = rope(x, rope_angles(np.array([3]), 4, 1e4, 1.0), "neox")
    np.testing.assert_array_equal(partial[0, 0, 4:], x[0, 0, 4:])
    # relative: q.k depends only on the distance between the two positions
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((2, 1, 1, 8))
    for ordering in ("normal", "neox"):
        def score(pq, pk):
            return float((rope(q, rope_angles(np.array([pq]), 8, 1e4, 1.0), ordering)
                          * rope(k, rope_angles(np.array([pk]), 8, 1e4, 1.0), ordering)).sum())
        assert score(9, 4) == pytest.approx(score(105, 100))


def test_rope_metadata_is_read(tmp_path):
    plain = ReferenceModel(write_llama(tmp_path / "a.gguf", arch="llama", weight_type="F32"))
    scaled = ReferenceModel(write_llama(tmp_path / "b.gguf", arch="llama", weight_type="F32",
                                        rope_scaling_factor=4.0, rope_freq_base=5e5))
    assert (plain.freq_base, plain.freq_scale) == (10000.0, 1.0)
    assert (scaled.freq_base, scaled.freq_scale) == (5e5, 0.25)
    assert np.abs(plain.forward(PROMPT) - scaled.forward(PROMPT)).max() > 1e-2


def test_refuses_what_it_does_not_implement(tmp_path):
    spec = LlamaSpec(arch="llama", weight_type="F32", n_layer=1)
    w = make_weights(spec)
    w["blk.0.attn_q_norm.weight"] = np.ones(spec.resolve().head_dim, np.float32)   # Qwen3's
    with pytest.raises(ValueError, match="attn_q_norm"):
        ReferenceModel(write_weights(tmp_path / "extra.gguf", spec, w))
    from tests.model.ggufgen import write_model
    with pytest.raises(ValueError, match="gemma3"):
        ReferenceModel(write_model(tmp_path / "gemma.gguf", arch="gemma3"))


# --- the models are usable for greedy comparisons --------------------------------------

@pytest.mark.parametrize("arch", ARCHS + tuple(f"{a}-tied" for a in ARCHS))
def test_greedy_generations_are_not_degenerate(models, arch):
    m = models[arch]
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(0, m.n_vocab, 6)] for _ in range(4)]
    outs = [m.greedy(p, 16) for p in prompts]
    assert len({tuple(o) for o in outs}) == len(outs)          # different prompts, different text
    for o in outs:
        assert len(o) == 16 and len(set(o)) >= 6                 # not one token over and over
        repeats = sum(a == b for a, b in zip(o, o[1:]))
        assert repeats <= 4, o                                   # nor mostly its own last token
    # the whole prompt matters, not only its last token
    tail = prompts[0][-1]
    assert m.greedy([3, 4, 5, tail], 8) != m.greedy([200, 201, 202, tail], 8)
    # greedy() is the argmax of forward(), fed back token by token
    tokens, logits = m.greedy_logits(prompts[0], 5)
    assert tokens == outs[0][:5]
    full = m.forward(prompts[0] + tokens[:-1])
    np.testing.assert_allclose(logits, full[len(prompts[0]) - 1:], rtol=0, atol=1e-5)
    assert (top2_margin(logits) > 0).all()


def test_logits_are_well_spread(models):
    for m in models.values():
        logits = m.forward(PROMPT)
        assert 2.0 < logits.std() < 8.0
        assert np.median(top2_margin(logits)) > 0.2
