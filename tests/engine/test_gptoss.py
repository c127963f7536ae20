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
