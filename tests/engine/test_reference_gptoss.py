"""The gpt-oss numpy reference (tests/engine/reference/gptoss.py) against
llama.cpp on tests/ggufgen/gptoss.py's files (conformance/cases.py's
"gpt-oss" case), and each gpt-oss feature shown to matter.

The same protocol as test_conformance.py (its PROMPT: 28 positions, so the
window of 8 slides; its chain length, top-k and MoE near-tie rule; its MoE
tolerances): llama.cpp's greedy chain with top-8 log-probabilities, the
reference teacher-forced along it with an f16 KV cache.

Measured (2026-12-02, build 10434, this host): F32 0.0056, F16 0.0133
(tolerances 0.015 and 0.015).  The "Q8_0" case (MXFP4 experts + Q8_0
matrices, the real files' mix) needs a CPU with AVX-VNNI: this llama.cpp
build's MXFP4 and Q8_0 CPU kernels (ggml_gemv_mxfp4_8x8_q8_0,
ggml_vec_dot_q8_0_q8_0) execute VEX vpdpbusd and die of SIGILL on CPUs with
only AVX512-VNNI; the test says so and skips there rather than pass.

Each feature matters: with the sinks, the sliding window, the SwiGLU clamp,
the biases or YaRN switched off in the reference, the F32 chain disagrees
with llama.cpp by far more than the tolerance.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from tests.engine.conformance.cases import GPTOSS_TYPES, write_case
from tests.engine.conformance.compare import compare
from tests.engine.conformance.peer import LlamaServer
from tests.engine.reference import gptoss as ref_mod
from tests.engine.reference.gptoss import GptOssReference, swiglu_oai
from tests.engine.test_conformance import N_CHAIN, N_PROBS, PROMPT, ROUTE_TIE, TOL, check

MOE_GROUP = 2


def _has_avx_vnni() -> bool:
    """Whether the oracle runs MXFP4/Q8_0 files here: a native build of it (scripts/setup.sh makes one
    where the prebuilt dies) or $VRAMD_LLAMA_SERVER does wherever it was built; the prebuilt needs
    AVX-VNNI."""
    from vramd.bench.llama_binary import llama_server_binary
    if llama_server_binary().origin != "prebuilt":
        return True
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx_vnni" in line for line in f)
    except OSError:
        return False


@pytest.fixture(scope="module")
def chains(tmp_path_factory):
    made = {}
    tmp = tmp_path_factory.mktemp("gptoss")

    def get(weight_type: str, run_peer: bool = True):
        """The case's file and llama.cpp's chain on it; run_peer False: the numpy
        reference's own greedy chain instead (where llama.cpp cannot run the file)."""
        key = (weight_type, run_peer)
        if key not in made:
            path = write_case("gpt-oss", weight_type, tmp / f"gpt-oss-{weight_type}.gguf")
            if run_peer:
                with LlamaServer(path, ctx=128) as peer:
                    chain = peer.greedy_chain(PROMPT, N_CHAIN, N_PROBS)
            else:
                tokens, _ = GptOssReference(path).greedy_logits(PROMPT, N_CHAIN, kv_dtype=np.float16)
                chain = SimpleNamespace(prompt=PROMPT, tokens=tokens)
            made[key] = SimpleNamespace(path=path, chain=chain, arch="gpt-oss", weight_type=weight_type,
                                        tol=TOL[weight_type][MOE_GROUP])
        return made[key]

    return get


def reference_logits(c, ref: GptOssReference | None = None):
    ref = ref or GptOssReference(c.path)
    tokens = PROMPT + c.chain.tokens[:-1]
    logits = ref.forward(tokens, ref.new_kv(np.float16), 0)
    margin = np.min([r.margin for r in ref.last_routes], axis=0)
    keep = margin[len(PROMPT) - 1:len(PROMPT) - 1 + N_CHAIN] >= ROUTE_TIE
    return logits, keep


@pytest.mark.parametrize("weight_type", GPTOSS_TYPES)
def test_reference_agrees_with_llama_cpp(chains, weight_type):
    if weight_type == "Q8_0" and not _has_avx_vnni():
        pytest.skip("this llama.cpp build's MXFP4/Q8_0 CPU kernels need AVX-VNNI (SIGILL here)")
    c = chains(weight_type)
    logits, keep = reference_logits(c)
    check(c, logits, keep, "the numpy reference")


def _off(what: str, ref: GptOssReference) -> None:
    if what == "sinks":
        for L in ref.layers:
            L["attn_sinks"] = np.full_like(L["attn_sinks"], -np.inf)
    elif what == "window":
        ref.swa_layers = [False] * ref.n_layer
    elif what == "biases":
        for L in ref.layers:
            for name in [n for n in L if n.endswith(".bias")]:
                L[name] = np.zeros_like(L[name])
    elif what == "yarn":
        ref.yarn, ref.freq_scale = None, 1.0
        ref.rope_magnitude = lambda freq_scale: 1.0


@pytest.mark.parametrize("what", ["sinks", "window", "biases", "yarn", "clamp"])
def test_each_feature_matters(chains, monkeypatch, what):
    c = chains("F32")
    ref = GptOssReference(c.path)
    if what == "clamp":
        monkeypatch.setattr(ref_mod, "SWIGLU_LIMIT", math.inf)
        monkeypatch.setattr(ref_mod, "swiglu_oai", lambda g, u: swiglu_oai(g, u, limit=math.inf))
    else:
        _off(what, ref)
    logits, _ = reference_logits(c, ref)
    worst = compare(c.chain, logits).diff.max()
    assert worst > 3 * c.tol, f"without {what} the reference still agrees with llama.cpp ({worst:.4f})"


def test_swiglu_oai_clamps_gate_above_and_up_both_ways():
    g = np.array([-10.0, 0.0, 1.0, 7.0, 20.0])
    u = np.array([-20.0, 0.0, 2.0, 7.0, 20.0])
    sig = 1 / (1 + np.exp(-1.702 * np.minimum(g, 7)))
    want = np.minimum(g, 7) * sig * (np.clip(u, -7, 7) + 1)
    np.testing.assert_allclose(swiglu_oai(g, u), want, rtol=1e-9)  # tanh-form sigmoid
    assert swiglu_oai(np.array([20.0]), np.array([1.0]))[0] == pytest.approx(7 * 2 / (1 + math.exp(-1.702 * 7)))
