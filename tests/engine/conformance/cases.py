"""The conformance suite's models: one small synthetic GGUF per (architecture, weight type).

Owns `ARCHS`, `TYPES`, `TYPES_OF` (the types each case is run in), `cases()`
(every pair) and `write_case(arch, weight_type, path)`.  Every architecture uses rows of 256 (n_embd, n_ff, the
experts' n_ff, n_head * head_dim), so that every type, the 256-value K-quant
blocks included, is written from the same float values: the files of one
architecture differ only by their weight type (the float weights are made
once per architecture and cached).

Shapes, chosen to be fast on llama.cpp's CPU backend and lavapipe (well under
a second per file either way) and still exercise what the engines must get
right: GQA everywhere (qwen2 and qwen3 2 query heads per KV head, the MoEs
too, gemma3 4 on 1), head_dim != n_embd / n_head for qwen3 (4 heads of 128
on an n_embd of 256, as Qwen3-0.6B's 16 x 128 on 1024) and gemma3, tied
output for qwen3 and gemma3, q/k/v biases for qwen2 and qwen2moe, a shared
expert for qwen2moe, 8 experts of which 2 are used, and for gemma3 a sliding
window of 8 positions over 7 layers (layer 5 global), which the suite's
prompts cross.

The long tail (issue 17), in F32, F16, Q8_0 and Q4_K each:
  gemma2      4 layers (0 and 2 slide over 8 positions), attention scores capped
              at 3 and logits at 15 (small caps, so that both bite), no QK-norm
  phi3        fused attn_qkv and gate/up, partial rotary (32 of head_dim 64),
              LongRoPE factors with an original context of 32 (both engines' contexts
              exceed it: the long factors) and attn_factor 1.19, a sliding_window key
              (ignored by llama.cpp, so by vramd)
  mistral3    YaRN factor 4 over an original context of 16 (the suite's 28 positions
              go past it), beta_fast 32 / beta_slow 0.5 and yarn_log_multiplier 1 read
              from the file (Ministral's), attention temperature 0.1 (q scaled from
              position 16 on)
  qwen3-yarn  qwen3 with YaRN factor 4 over an original context of 16, base 1e4 (the
              ramp covers pairs 0..7 of 64): what Qwen3's long-context GGUFs declare
and in F32 only, the other YaRN-declaring families: qwen2-yarn, llama-yarn (the
same scaling on qwen2's and llama's case).  And in F32, F16, Q8_0 and Q4_K:
  gemma4      tests/ggufgen/gemma4.py's default: 5 layers (2 and 4 global), sliding
              layers 4 heads of 64 over 2 KV heads with a window of 8, global layers
              4 heads of 128 over 1 KV head with V = K (no attn_v) and a proportional
              RoPE (rope_freqs: 16 of 64 pairs rotate), attention scale 1, V RMS-normed,
              a layer_output_scale per layer, logits capped at 15
  gemma4-moe  gemma4 with experts (tests/ggufgen/gemma4_moe.py's default, the 26B-A4B's layout):
              gemma4's 5 layers, each with the dense FFN of 512 beside 16 experts of 256 (4
              used, renormalized, GELU), fused ffn_gate_up_exps, per-expert output scales,
              the router on its own norm of x; in F32, F16 and Q8_0 only
  qwen35      Gated DeltaNet + gated attention (tests/ggufgen/qwen35.py's defaults: 4 layers,
              DeltaNet at 0 and 2, 2 key heads read by 4 value heads of 64, a conv of 4 taps,
              attention 4 x 64 on 2 KV heads with partial rotary 32), in QWEN35_TYPES; its
              prompt is PROMPTS["qwen35"], 80 tokens: llama.cpp's prefill crosses its
              delta-rule chunk of 64 (and the conv's window) before the chain is read.
  qwen35moe   the same layers with every FFN routed: 8 experts of 256, 2 used, renormalized,
              plus the sigmoid-gated shared expert; F32 and F16 (the reference keeps no routes
              to leave near-tie steps out by, so only the types whose rounding cannot flip them).

and Gemma 4's E-models, in F32, F16, Q8_0 and Q4_K (tests/ggufgen/gemma4.py's E2B_SHAPE / E4B_SHAPE
on gemma4's default heads):
  gemma4-e2b  7 layers, the last 3 sharing K/V (4 and 5 read sliding layer 2's, 6 global layer 3's),
              their FFNs double-wide (feed_forward_length per layer), per-layer embeddings of 256
  gemma4-e4b  8 layers, the last 2 sharing (6 reads 4's, 7 reads 5's), one FFN width, PLE of 256
  (the suite's 28-token prompt crosses the window of 8 on every sliding layer, the sharing ones included)

and gpt-oss (issue 17 item 2):
  gpt-oss     tests/ggufgen/gptoss.py: attention sinks, q/k/v/o, router and expert
              biases, the clamped SwiGLU, a window of 8 on even layers, YaRN factor 4
              over 16; weight types GPTOSS_TYPES: "F32"/"F16" (experts the same type)
              and "Q8_0" = the real files' mix (MXFP4 experts, Q8_0 other matrices).
              (tests/engine/test_reference_gptoss.py and test_gptoss.py add the
              features' ablations, --n-cpu-moe placements and the reference as oracle
              where llama.cpp's CPU kernels cannot run the MXFP4 file).
"""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path

import numpy as np

ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "qwen3moe", "qwen2moe", "mixtral",
         "gemma2", "phi3", "mistral3", "qwen3-yarn", "qwen2-yarn", "llama-yarn", "gemma4",
         "qwen35", "qwen35moe", "gpt-oss", "gemma4-e2b", "gemma4-e4b",
         "gemma4-moe")
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
TAIL_TYPES = ("F32", "F16", "Q8_0", "Q4_K")
# qwen35: the long tail's types and Q6_K.  (The prebuilt llama-server dies with SIGILL on quantized
# and BF16 files on a CPU without AVX-VNNI (VEX vpdpbusd); there scripts/setup.sh builds the oracle
# from source and vramd/bench/llama_binary.py picks that build.)
QWEN35_TYPES = ("F32", "F16", "Q8_0", "Q4_K", "Q6_K")
TYPES_OF = ({a: TYPES for a in ARCHS[:7]} | {a: TAIL_TYPES for a in ARCHS[7:11]} | {a: ("F32",) for a in ARCHS[11:13]}
            | {"gemma4": TAIL_TYPES, "gemma4-moe": ("F32", "F16", "Q8_0"), "qwen35": QWEN35_TYPES, "qwen35moe": ("F32", "F16")})
# gguf general.architecture of each case (the reference and the tolerance group go by it)
GGUF_ARCH = {a: a.split("-")[0] for a in ARCHS} | {"mixtral": "llama"}
# the prompt of an architecture whose default (test_conformance.PROMPT) is too short for it
PROMPTS = {"qwen35": [int(t) for t in np.random.default_rng(35).integers(0, 512, 80)]}
PROMPTS["qwen35moe"] = PROMPTS["qwen35"]
_YARN = dict(rope_scaling="yarn", rope_scaling_factor=4.0, orig_ctx=16)
GPTOSS_TYPES = ("F32", "F16", "Q8_0")
TYPES_OF["gpt-oss"] = GPTOSS_TYPES
TYPES_OF |= {"gemma4-e2b": TAIL_TYPES, "gemma4-e4b": TAIL_TYPES}
GGUF_ARCH["gpt-oss"] = "gpt-oss"

_DENSE = dict(n_embd=256, n_ff=512, n_head=4, n_layer=2, n_vocab=512, seed=7)
_MOE = dict(n_embd=256, n_ff_exp=256, n_ff_shexp=256, n_head=4, n_head_kv=2, n_layer=2, n_expert=8,
            n_expert_used=2, seed=3)


def cases() -> list[tuple[str, str]]:
    return [(a, t) for a in ARCHS for t in TYPES_OF[a]]


def _spec(arch: str):
    """The architecture's spec in F32 (the weight type is set per file) and its writer."""
    from tests.ggufgen import gemma3, gemma4, gptoss, llama, moe, qwen35

    if arch in ("qwen35", "qwen35moe"):
        n_expert = 8 if arch == "qwen35moe" else 0
        return (qwen35.Qwen35Spec(weight_type="F32", seed=11, n_expert=n_expert), qwen35.make_qwen35_weights,
                qwen35.write_qwen35_weights)

    dense = llama.make_weights, llama.write_weights
    if arch in ("llama", "qwen2"):
        return (llama.LlamaSpec(arch=arch, weight_type="F32", **_DENSE), *dense)
    if arch in ("llama-yarn", "qwen2-yarn"):
        return (llama.LlamaSpec(arch=arch.split("-")[0], weight_type="F32", **_YARN, **_DENSE), *dense)
    if arch in ("qwen3", "qwen3-yarn"):
        yarn = dict(_YARN, rope_freq_base=1e4) if arch == "qwen3-yarn" else {}
        return (llama.LlamaSpec(arch="qwen3", weight_type="F32", key_length=128, tied_output=True, n_head_kv=2,
                                **yarn, **_DENSE), *dense)
    if arch == "phi3":
        return (llama.LlamaSpec(arch=arch, weight_type="F32", n_rot=32, longrope=True, orig_ctx=32, n_head_kv=2,
                                rope_attn_factor=1.19, sliding_window=8, **_DENSE), *dense)
    if arch == "mistral3":
        return (llama.LlamaSpec(arch=arch, weight_type="F32", yarn_beta_fast=32.0, yarn_beta_slow=0.5,
                                yarn_log_mul=1.0, attn_temp_scale=0.1, rope_freq_base=1e4, **_YARN, **_DENSE), *dense)
    if arch == "gemma2":
        return (gemma3.Gemma3Spec(arch=arch, weight_type="F32", n_embd=256, n_ff=512, n_head=4, n_head_kv=2,
                                  head_dim=64, n_layer=4, window=8, attn_softcap=3.0, softcap=15.0, seed=5),
                gemma3.make_gemma3_weights, gemma3.write_gemma3_weights)
    if arch == "gemma4-moe":
        from tests.ggufgen import gemma4_moe
        return (gemma4_moe.Gemma4MoESpec(weight_type="F32", seed=5), gemma4_moe.make_gemma4_moe_weights,
                gemma4_moe.write_gemma4_moe_weights)
    if arch.startswith("gemma4"):
        shape = {"gemma4-e2b": gemma4.E2B_SHAPE, "gemma4-e4b": gemma4.E4B_SHAPE}.get(arch, {})
        return (gemma4.Gemma4Spec(weight_type="F32", seed=5, **shape), gemma4.make_gemma4_weights,
                gemma4.write_gemma4_weights)
    if arch == "gemma3":
        return (gemma3.Gemma3Spec(weight_type="F32", n_embd=256, n_ff=512, n_head=4, n_head_kv=1,
                                         head_dim=64, n_layer=7, window=8, seed=5),
                gemma3.make_gemma3_weights, gemma3.write_gemma3_weights)
    if arch == "gpt-oss":
        return (gptoss.GptOssSpec(weight_type="F32", expert_type="F32", n_embd=256, n_ff_exp=256, head_dim=64,
                                  n_vocab=512, seed=11), gptoss.make_gptoss_weights, gptoss.write_gptoss_weights)
    return (moe.MoESpec(arch=arch, weight_type="F32", **_MOE), moe.make_moe_weights,
            moe.write_moe_weights)


@functools.lru_cache(maxsize=None)
def _weights(arch: str) -> dict:
    spec, make, _ = _spec(arch)
    return make(spec)


def write_case(arch: str, weight_type: str, path: str | Path) -> Path:
    spec, _, write = _spec(arch)
    if arch == "gpt-oss":   # experts: MXFP4 beside quantized matrices (the real files), else the same type
        spec = replace(spec, expert_type="MXFP4" if weight_type == "Q8_0" else weight_type)
    return write(path, replace(spec, weight_type=weight_type), _weights(arch))
