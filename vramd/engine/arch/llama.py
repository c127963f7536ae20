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
"""

from __future__ import annotations

from vramd.engine.arch.hparams import Hparams
from vramd.engine.arch.spec import ArchSpec, LayerSpec


def dense(hp: Hparams, *, neox: bool, qk_norm: bool = False, rope_factors: bool = False) -> ArchSpec:
    g = hp.common()
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
