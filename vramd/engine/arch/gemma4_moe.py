"""gemma4 with experts (Gemma 4 26B-A4B), as llama.cpp (0c1e570 / build 10434) defines it.

The attention and every per-layer convention are arch/gemma4.py's (the
dense builder makes the spec; this module adds the routed FFN).  A layer is
routed where the file has blk.l.ffn_gate_inp.weight (llama.cpp decides per
layer, src/models/gemma4.cpp's `is_moe_layer`); such a layer computes, from
x = the residual stream after the attention (llama.cpp's attn_out):

    dense  = rms_norm(Wdown (gelu(Wgate h1) * Wup h1)) * post_ffw_norm_1,  h1 = rms_norm(x) * ffn_norm
    router = Wr (rms_norm(x) / sqrt(n_embd) * ffn_gate_inp.scale)          (no bias; its own norm of x)
    p = softmax(router); the top k (expert_used_count); w = p_j / sum of the k  (build_moe_ffn,
        LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX, norm_w = true, w_scale 1)
    experts = rms_norm(sum_j w_j s_e (Wdown_e (gelu(Wgate_e h2) * Wup_e h2))) * post_ffw_norm_2,
        h2 = rms_norm(x) * pre_ffw_norm_2, s_e = ffn_down_exps.scale[e] (the checkpoint's
        per_expert_scale; 1 where the file has none)
    x = x + rms_norm(dense + experts) * post_ffw_norm;  x *= layer_output_scale

The experts' gate and up are ffn_gate_up_exps.weight [n_embd, 2 n_ff_exp, n_expert]
(gate rows, then up rows, per expert: what the converter writes from the
checkpoint's experts.gate_up_proj) or the two separate stacks; both are read.
Widths: feed_forward_length (the dense FFN), expert_feed_forward_length (one
number, or one per layer as llama.cpp's get_key_or_arr: they must agree).
The engine side is vramd/engine/moe.py (MoESpec.dense_beside and its siblings).
"""

from __future__ import annotations

from dataclasses import replace

from vramd.engine.arch import gemma4
from vramd.engine.arch.hparams import Hparams
from vramd.engine.arch.moe import BATCH
from vramd.engine.arch.spec import ArchSpec, MoESpec


def gemma4_moe(hp: Hparams) -> ArchSpec:
    a, dense = hp.arch, gemma4.gemma4(hp)
    n_expert, n_used = hp.get("expert_count"), hp.get("expert_used_count")
    if not 0 < n_used <= n_expert:
        raise hp.fail(f"{a}.expert_used_count {n_used} is not in 1..{a}.expert_count {n_expert}")
    routed = [f"blk.{i}.ffn_gate_inp.weight" in hp.tensor_names for i in range(dense.n_layer)]
    if not any(routed):
        raise hp.fail(f"{a}.expert_count is {n_expert} but no layer has ffn_gate_inp.weight")
    n_ff_exp = {w for w, r in zip(hp.per_layer("expert_feed_forward_length", dense.n_layer), routed) if r}
    if len(n_ff_exp) != 1:
        raise hp.fail(f"{a}.expert_feed_forward_length differs between routed layers {sorted(n_ff_exp)}: "
                      f"not supported")
    moe = MoESpec(n_expert=n_expert, n_used=n_used, n_ff_exp=n_ff_exp.pop(), renormalize=True, activation="gelu",
                  dense_beside=True, router_scale=True,
                  expert_scale=_all_or_none(hp, routed, "ffn_down_exps.scale"),
                  fused_gate_up=_all_or_none(hp, routed, "ffn_gate_up_exps.weight"))
    layers = tuple(replace(layer, moe=r) for layer, r in zip(dense.layers, routed))
    return replace(dense, moe=moe, layers=layers, batch=BATCH)


def _all_or_none(hp: Hparams, routed: list[bool], tensor: str) -> bool:
    """Whether the routed layers have blk.l.<tensor>: all of them, or none (else a ModelError)."""
    have = [i for i, r in enumerate(routed) if r and f"blk.{i}.{tensor}" in hp.tensor_names]
    if have and len(have) != sum(routed):
        missing = next(i for i, r in enumerate(routed) if r and i not in have)
        raise hp.fail(f"blk.{missing}.{tensor} is missing (other routed layers have one)")
    return bool(have)
