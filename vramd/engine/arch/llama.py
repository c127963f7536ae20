"""The llama family: llama 2/3 and Mistral ("llama"), Qwen2 ("qwen2"), Qwen3 ("qwen3").

What they compute (llama.cpp's src/models/llama.cpp, qwen2.cpp, qwen3.cpp):
x = token_embd[t]; per layer h = rms_norm(x) * attn_norm, q/k/v = W h (+ bias
where the file has one: qwen2), RoPE on q and k (llama: pairs (2i, 2i+1),
rope_freqs.weight as frequency factors where present; qwen2/qwen3: NeoX
pairs (i, i + n_rot/2)), causal GQA attention with scale 1/sqrt(head_dim),
x += Wo o; h = rms_norm(x) * ffn_norm, x += Wdown(silu(Wgate h) * Wup h);
logits = Woutput rms_norm(x) * output_norm (token_embd when output.weight is
absent).  qwen3 adds an RMSNorm over each head of q and k before RoPE
(attn_q_norm / attn_k_norm, one [head_dim] weight for every head).
A "llama" file with llama.expert_count is mixtral: see arch/moe.py.

mistral3 (src/models/mistral3.cpp: Ministral 3, Mistral Small 3.x text) is
llama's graph (normal RoPE, optional biases and rope_freqs) with what its
loader reads beyond: YaRN's rope.scaling.yarn_beta_fast / _slow /
_log_multiplier, and Llama-4-style attention temperature
attention.temperature_scale: after RoPE q *= 1 + scale * ln(floor(p /
n_ctx_orig) + 1) (n_ctx_orig = rope.scaling.original_context_length, else
context_length; offset 0).

phi3 (src/models/phi3.cpp: Phi-3, Phi-3.5, Phi-4-mini) is llama's block with
NeoX RoPE (partial where rope.dimension_count < head_dim, as Phi-4-mini),
q/k/v either separate or fused in attn_qkv.weight (rows q, k, v) and gate and
up fused in ffn_up.weight (2 n_ff rows: gate first, SwiGLU silu(gate) * up),
no ffn_gate; LongRoPE: rope_factors_long / rope_factors_short.weight
([n_rot/2], one pair for the model) divide the frequencies, long when the
context exceeds rope.scaling.original_context_length (else context_length),
and rope.scaling.attn_factor multiplies cos and sin.  attention.sliding_window
is read and ignored, as llama.cpp does (its phi3 SWA is disabled: every layer
attends to every key).
"""

from __future__ import annotations

from vramd.engine.arch.hparams import Hparams
from vramd.engine.arch.spec import ArchSpec, LayerSpec


def dense(hp: Hparams, *, neox: bool, qk_norm: bool = False, rope_factors: bool = False, **fields) -> ArchSpec:
    g = hp.common()
    g.update(fields)
    base, scale = hp.get("rope.freq_base", 10000.0, kind=float), hp.rope_freq_scale()
    return ArchSpec(family=g["arch"], n_ff=hp.get("feed_forward_length"), neox=neox, qk_norm=qk_norm,
                    rope_factors=rope_factors,
                    layers=tuple(LayerSpec(base, scale) for _ in range(g["n_layer"])), **g)


def llama(hp: Hparams) -> ArchSpec:
    return dense(hp, neox=False, rope_factors=True)


def qwen2(hp: Hparams) -> ArchSpec:
    return dense(hp, neox=True)


def qwen3(hp: Hparams) -> ArchSpec:
    return dense(hp, neox=True, qk_norm=True)


def mistral3(hp: Hparams) -> ArchSpec:
    temp = hp.get("attention.temperature_scale", 0.0, kind=float)
    if temp < 0:
        raise hp.fail(f"{hp.arch}.attention.temperature_scale = {temp} is negative")
    return dense(hp, neox=False, rope_factors=True, rope_scaling=hp.rope_scaling(yarn_keys=True),
                 attn_temp_scale=temp, attn_temp_floor=hp.n_ctx_orig() if temp else 0)


def phi3(hp: Hparams) -> ArchSpec:
    hp.size("attention.sliding_window")   # checked, then ignored as llama.cpp does (see the header)
    longrope = "rope_factors_long.weight" in hp.tensor_names or "rope_factors_short.weight" in hp.tensor_names
    return dense(hp, neox=True, longrope_ctx=hp.n_ctx_orig() if longrope else 0,
                 fused_qkv="blk.0.attn_qkv.weight" in hp.tensor_names, fused_up=True)
