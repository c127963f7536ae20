"""Mixture-of-experts architectures: qwen3moe, qwen2moe, and mixtral (a "llama" file with experts).

The attention is the llama family's (arch/llama.py; qwen3moe with QK-norm,
qwen2moe with q/k/v biases); the FFN is routed (vramd/engine/moe.py):
softmax of the router's logits (ffn_gate_inp), the top k experts
(expert_used_count of expert_count), their weights renormalised to sum 1
except for qwen2moe, only those experts computed (SiLU-gated, stacked
ffn_{gate,up,down}_exps), plus qwen2moe's shared expert gated by
sigmoid(ffn_gate_inp_shexp . h).  Expert widths: expert_feed_forward_length
(default feed_forward_length), expert_shared_feed_forward_length.
"""

from __future__ import annotations

from dataclasses import replace

from vramd.engine.arch.hparams import Hparams
from vramd.engine.arch.spec import ArchSpec, LayerSpec, MoESpec

BATCH = 64   # tokens per prefill chunk: the slots' buffers grow with batch x experts used


def is_moe(hp: Hparams) -> bool:
    n = hp.md.get(f"{hp.arch}.expert_count", 0)
    return isinstance(n, int) and not isinstance(n, bool) and n > 0


def routed(hp: Hparams, *, neox: bool, qk_norm: bool = False, renormalize: bool = True) -> ArchSpec:
    g = hp.common()
    n_expert, n_used = hp.get("expert_count"), hp.get("expert_used_count")
    if n_used > n_expert:
        raise hp.fail(f"{hp.arch}.expert_used_count {n_used} exceeds {hp.arch}.expert_count {n_expert}")
    shexp = "expert_shared_feed_forward_length"
    moe = MoESpec(n_expert=n_expert, n_used=n_used,
                  n_ff_exp=hp.get("expert_feed_forward_length", hp.md.get(f"{hp.arch}.feed_forward_length")),
                  n_ff_shexp=hp.get(shexp) if hp.md.get(f"{hp.arch}.{shexp}") else 0, renormalize=renormalize)
    base, scale = hp.get("rope.freq_base", 10000.0, kind=float), hp.rope_freq_scale()
    return ArchSpec(family=g["arch"], neox=neox, qk_norm=qk_norm, moe=moe, batch=BATCH, takes_embeds=False,
                    layers=tuple(LayerSpec(base, scale, moe=True) for _ in range(g["n_layer"])), **g)


def qwen3moe(hp: Hparams) -> ArchSpec:
    return routed(hp, neox=True, qk_norm=True)


def qwen2moe(hp: Hparams) -> ArchSpec:
    return routed(hp, neox=True, renormalize=False)


def mixtral(hp: Hparams) -> ArchSpec:
    return replace(routed(hp, neox=False), family="mixtral")
