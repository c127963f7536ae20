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


def routed(hp: Hparams, *, neox: bool, qk_norm: bool = False, renormalize: bool = True,
           rope_factors: bool = False) -> ArchSpec:
    g = hp.common()
    n_expert, n_used = hp.get("expert_count"), hp.get("expert_used_count")
    if n_used > n_expert:
        raise hp.fail(f"{hp.arch}.expert_used_count {n_used} exceeds {hp.arch}.expert_count {n_expert}")
    moe = MoESpec(n_expert=n_expert, n_used=n_used,
                  n_ff_exp=hp.get("expert_feed_forward_length", hp.md.get(f"{hp.arch}.feed_forward_length")),
                  n_ff_shexp=shared_width(hp), renormalize=renormalize)
    base, scale = hp.get("rope.freq_base", 10000.0, kind=float), hp.rope_freq_scale()
    return ArchSpec(family=g["arch"], neox=neox, qk_norm=qk_norm, moe=moe, batch=BATCH, takes_embeds=False,
                    rope_factors=rope_factors,
                    layers=tuple(LayerSpec(base, scale, moe=True) for _ in range(g["n_layer"])), **g)


def shared_width(hp: Hparams) -> int:
    """The shared expert's width: expert_shared_feed_forward_length, or, where the
    key is absent but the file has shared-expert tensors, their width (so that a
    shared expert is never computed at width 0); 0: no shared expert."""
    key = "expert_shared_feed_forward_length"
    if hp.md.get(f"{hp.arch}.{key}"):
        return hp.get(key)
    name = "blk.0.ffn_gate_shexp.weight"
    if name not in hp.tensor_names:
        return 0
    shape = hp.mf.tensor(name).shape
    if len(shape) != 2 or not 0 < shape[1] <= (1 << 20):
        raise hp.fail(f"tensor {name!r} has shape {tuple(shape)}, expected (n_embd, width)")
    return shape[1]


def qwen3moe(hp: Hparams) -> ArchSpec:
    return routed(hp, neox=True, qk_norm=True)


def qwen2moe(hp: Hparams) -> ArchSpec:
    return routed(hp, neox=True, renormalize=False)


def mixtral(hp: Hparams) -> ArchSpec:
    return replace(routed(hp, neox=False, rope_factors=True), family="mixtral")
