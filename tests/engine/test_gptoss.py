"""vramd's gpt-oss (vramd/engine/arch/gptoss.py through blocks.py, moe.py and
the sink-taking attention kernels) against llama.cpp and the numpy reference
(tests/engine/reference/gptoss.py) on conformance/cases.py's "gpt-oss" files.

The protocol of test_conformance.py (teacher-forced along llama.cpp's greedy
chain: one all-logits prefill over 24 positions, then the last N_DECODE tokens
through the decode step; the window of 8 slides in both), its MoE tolerances
and near-tie rule.  The "Q8_0" file (MXFP4 experts, Q8_0 matrices: the real
files' mix) runs llama.cpp only on CPUs with AVX-VNNI (test_reference_gptoss
says why); against the numpy reference it runs everywhere, within REF_TOL
(vramd keeps f32 activations and dequantizes exactly, as the reference does:
what is left is f32 against float64 and the f16 cache both use).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.engine.conformance.cases import GPTOSS_TYPES
from tests.engine.conformance.engine import vramd_logits
from tests.engine.test_conformance import CTX, N_CHAIN, N_DECODE, PROMPT, check
from tests.engine.test_reference_gptoss import _has_avx_vnni, chains, reference_logits  # noqa: F401 (fixture)

REF_TOL = 3e-3


def _logits(device, c):
    tokens = PROMPT + c.chain.tokens[:-1]
    return vramd_logits(device, c.path, tokens, CTX, decode_from=len(tokens) - N_DECODE)


@pytest.mark.gpu
@pytest.mark.parametrize("weight_type", GPTOSS_TYPES)
def test_vramd_agrees_with_the_reference(device, chains, weight_type):
    c = chains(weight_type, run_peer=False) if weight_type == "Q8_0" and not _has_avx_vnni() else chains(weight_type)
    ref, keep = reference_logits(c)
    got = _logits(device, c)
    lp = lambda z: z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(-1, keepdims=True)
    rows = slice(len(PROMPT) - 1, len(PROMPT) - 1 + N_CHAIN)
    diff = np.abs(lp(got[rows].astype(np.float64)) - lp(ref[rows]))[keep].max()
    print(f"vramd vs the reference on gpt-oss {weight_type}: {diff:.5f}")
    assert diff <= REF_TOL, f"vramd vs the reference on gpt-oss {weight_type}: {diff:.5f}"


@pytest.mark.gpu
@pytest.mark.parametrize("weight_type", GPTOSS_TYPES)
def test_vramd_agrees_with_llama_cpp(device, chains, weight_type):
    if weight_type == "Q8_0" and not _has_avx_vnni():
        pytest.skip("this llama.cpp build's MXFP4/Q8_0 CPU kernels need AVX-VNNI (SIGILL here)")
    c = chains(weight_type)
    _, keep = reference_logits(c)
    check(c, _logits(device, c), keep, "vramd")


# -- --n-cpu-moe: the host-routed path (vramd/engine/moe.py host_routed_layer) ------------------

N_LAYER = 3


@pytest.fixture(scope="module")
def small_mxfp4(tmp_path_factory):
    """3 layers (0 and 2 slide), MXFP4 experts, Q8_0 matrices; a prompt past the window."""
    from tests.ggufgen.gptoss import write_gptoss
    return write_gptoss(tmp_path_factory.mktemp("gptoss-host") / "g.gguf", n_layer=N_LAYER, weight_type="Q8_0",
                        expert_type="MXFP4", window=4, seed=2)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [0, 1, 4 / 3, 5 / 3, N_LAYER])
def test_every_placement_matches_the_reference(device, small_mxfp4, n):
    """Whole layers and a boundary layer's gate (4/3) or gate and up (5/3) on the
    host: the host adds its share's biases and runs the clamped SwiGLU, the device
    the rest; prefill and one decode step within 2e-3 of the reference."""
    from tests.engine.reference.gptoss import GptOssReference
    from vramd.engine.arch import spec_for
    from vramd.engine.model import TransformerModel
    from vramd.engine.scratch import scratch_layout
    from vramd.gpu.residency import Residency
    from vramd.model import loader, placement
    from vramd.model.gguf_check import validate_gguf

    mf = validate_gguf(small_mxfp4)
    res = Residency(device)
    model = None
    try:
        lm = loader.load(small_mxfp4, res, 64, mf=mf, scratch=scratch_layout(spec_for(mf), 16),
                         host_tensors=placement.host_tensors(mf, n))
        res.restore(["weights", "state"])
        model = TransformerModel(lm, res, 64, lm.scratch, batch=16)
        assert (len(lm.host) > 0) == (n > 0)
        ref = GptOssReference(small_mxfp4)
        prompt = [1, 9, 33, 70, 5, 81, 14, 200]
        kv = ref.new_kv(np.float16)
        want = ref.forward(prompt, kv, 0)
        assert min(r.margin.min() for r in ref.last_routes) > 0.01   # no near-tie a rounding could flip
        got = np.asarray(model.forward(prompt, 0, all_logits=True), np.float64)
        assert np.abs(got - want).max() / np.abs(want).max() < 2e-3
        step_want = ref.forward([12], kv)[-1]
        step = np.asarray(model.forward([12], len(prompt)), np.float64)
        assert np.abs(step - step_want).max() / np.abs(step_want).max() < 2e-3
    finally:
        if model is not None:
            model.close()
        res.close()
