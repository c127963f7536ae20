"""gemma4 at the real models' head sizes, vramd against the numpy reference (tests/engine/reference/gemma4.py),
and Gemma 4's tokenizer (tokenizer.ggml.model "gemma4") against llama.cpp's.

The conformance case (cases.py) holds vramd and the reference against llama.cpp
on small heads; Gemma 4 31B's are 256 wide (sliding, 16 KV heads) and 512 wide
(global, 4 KV heads, V = K, a quarter of the pairs rotated): the attention,
RoPE and norm kernels at 512 and the scratch / KV cache sized for the widest
layer are what this file checks, on prefill and on the replayed decode step,
with the window crossed (12 tokens over a window of 4); and the E2B / E4B layouts
(per-layer embeddings, KV-sharing layers) at those head sizes.

The tokenizer: tests/ggufgen/vocab.py's "gemma4" vocabulary, each text tokenized
and detokenized by vramd and by llama-server build 10434 (/tokenize, /detokenize):
spaces as "▁", newline runs split off (a run that is a token, "\n\n", whole; one
that is not, "\n\n\n\n", merged or per character), characters outside the
vocabulary as <0xNN> byte tokens, special tokens parsed or spelled out, and the
BOS llama.cpp adds even where the file says add_bos_token false.
"""

import numpy as np
import pytest
from gguf import GGUFValueType as V

from tests.engine.conformance.compare import log_softmax
from tests.engine.conformance.engine import vramd_logits
from tests.engine.conformance.peer import LlamaServer
from tests.engine.reference.gemma4 import Gemma4Reference
from tests.ggufgen.check import GGUFImage
from tests.ggufgen.gemma4 import write_gemma4
from vramd.engine.tokenizer import Tokenizer
from vramd.model.gguf_check import validate_gguf

TOKENS = [1, 17, 42, 99, 3, 250, 8, 64, 5, 77, 31, 2]


@pytest.mark.gpu
def test_gemma4_at_31b_head_sizes_matches_the_reference(device, tmp_path):
    _matches_at_large_heads(device, tmp_path, 5e-3, n_head_kv_swa=2, swa_layers=(True, False, True), seed=11)


def _matches_at_large_heads(device, tmp_path, tol: float, **shape) -> None:
    """vramd against the reference with 2 query heads of 512 (global, 1 KV head) and 256
    (sliding), on prefill and three replayed decode steps, over a window of 4."""
    path = write_gemma4(tmp_path / "g4.gguf", weight_type="F32", n_head=2, head_dim=512, n_head_kv=1,
                        head_dim_swa=256, n_rot_swa=256, window=4, **shape)
    ref = Gemma4Reference(path)
    want = log_softmax(ref.forward(TOKENS, ref.new_kv(np.float16), 0))
    got = log_softmax(vramd_logits(device, path, TOKENS, 32, decode_from=len(TOKENS) - 3))
    assert np.abs(got - want).max() < tol, np.abs(got - want).max()
    assert (got.argmax(axis=1) == want.argmax(axis=1)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("wide", [True, False], ids=["E2B-double-wide-FFN", "E4B-one-FFN-width"])
def test_gemma4_e_models_at_their_head_sizes_match_the_reference(device, tmp_path, wide):
    """E2B / E4B's heads (sliding 256 wide, global 512 with V = K) with their per-layer
    embeddings of 256 and two KV-sharing layers (2 reads sliding layer 0's cache, 3 global
    layer 1's), on prefill and the replayed decode step (the PLE gather and the sharing
    layers' reads of an earlier layer's cache in the recorded step), the window of 4 crossed.
    Four layers, and 1e-2: at these heads the dense graph's own f16-cache rounding grows
    with depth (the same four layers without PLE and sharing: 0.0087 at this seed; seven: 0.033;
    the E-layers here 0.0055 on prefill)."""
    _matches_at_large_heads(device, tmp_path, 1e-2, n_head_kv_swa=1, seed=13, swa_layers=(True, False, True, False),
                            shared_kv=2, n_ple=256, wide_shared=wide)


@pytest.mark.gpu
def test_an_e_model_decodes_right_after_its_scratch_was_freed(device, tmp_path):
    """The per-layer gather's row numbers (ple.py's "ple_idx") live in the scratch, which a
    switch frees: a decode step after release/restore, with no prefill chunk between to
    write them, must still match the reference (the model writes them again when the
    residency generation moved)."""
    from vramd.engine.model import TransformerModel
    from vramd.engine.scratch import scratch_layout
    from vramd.gpu.residency import Residency
    from vramd.model import loader
    from tests.ggufgen.gemma4 import E4B_SHAPE
    path = write_gemma4(tmp_path / "e.gguf", weight_type="F32", seed=5, **E4B_SHAPE)
    mf, ref = validate_gguf(path), Gemma4Reference(path)
    kv = ref.new_kv(np.float16)
    res = Residency(device)
    m = None
    try:
        from vramd.engine.arch import spec_for
        lm = loader.load(path, res, 32, mf=mf, scratch=scratch_layout(spec_for(mf), 16), progress=False)
        res.restore(["weights", "state"])
        m = TransformerModel(lm, res, 32, lm.scratch, batch=16)
        m.forward(TOKENS[:9], 0)
        ref.forward(TOKENS[:9], kv, 0)
        for pos in (9, 10, 11):
            if pos == 10:   # a switch: every region out, scratch freed, then back
                res.release(["weights", "state", "scratch"])
                res.drain()
                res.restore(["weights", "state"])
            got = log_softmax(np.asarray(m.forward([TOKENS[pos]], pos), np.float32)[None])
            want = log_softmax(ref.forward([TOKENS[pos]], kv)[-1:])
            assert np.abs(got - want).max() < 5e-3, (pos, np.abs(got - want).max())
        assert m.step_records == 2
    finally:
        if m is not None:
            m.close()
        res.close()


@pytest.mark.gpu
def test_v_taken_from_k_without_a_norm_is_the_raw_projection(device, tmp_path):
    """The spec's other combination (v_from_k, no v_norm: a copy of K's projection) against
    the reference with its V norm off -- no file declares it; the layer math must still mean it."""
    import dataclasses
    from vramd.engine.arch import spec_for
    path = write_gemma4(tmp_path / "g4.gguf", weight_type="F32", swa_layers=(True, False), seed=3)
    ref = Gemma4Reference(path)
    ref.v_norm = False
    want = log_softmax(ref.forward(TOKENS, ref.new_kv(np.float16), 0))
    spec = dataclasses.replace(spec_for(validate_gguf(path)), v_norm=False)
    got = log_softmax(vramd_logits(device, path, TOKENS, 32, decode_from=len(TOKENS) - 2, spec=spec))
    assert np.abs(got - want).max() < 5e-3


TEXTS = ["The river ran past the old mill.", " Hello world", "café 日本 🙂", "12 sacks\n\n  and 300 more\n\n\n\nx\n",
         "<|turn>user\nhi<turn|>", "the  miller's daughter ", "a\n\nb\n\n\nc", "\n", "  ", "ÿ€ zz",
         "<turn|>\n\n<|turn>model"]


def test_gemma4_tokenizer_matches_llama_cpp(tmp_path):
    path = write_gemma4(tmp_path / "v.gguf", weight_type="F32", vocab="gemma4", swa_layers=(True, False))
    nobos = GGUFImage.from_file(path).set_kv("tokenizer.ggml.add_bos_token", V.BOOL, False).write(tmp_path / "n.gguf")
    for p in (path, nobos):
        tok = Tokenizer.from_metadata(validate_gguf(p).metadata)
        with LlamaServer(p, ctx=64) as peer:
            for text in TEXTS if p == path else TEXTS[:1]:
                for special in (False, True):
                    want = peer.tokenize(text, parse_special=special)
                    assert tok.encode(text, parse_special=special) == want, (text, special)
                    assert tok.decode(want, special=True) == peer.detokenize(want), (text, special)   # it renders specials
        assert want[0] == tok.bos_id
