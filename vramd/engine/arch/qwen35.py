"""Qwen3.5 ("qwen35"): Gated DeltaNet linear-attention layers interleaved with gated attention.

What it computes: tests/engine/reference/qwen35.py's header (from llama.cpp's
src/models/qwen35.cpp).  Layer i is a DeltaNet layer unless (i + 1) %
full_attention_interval == 0 (default 4); attention layers have QK-norm, NeoX RoPE over
rope.dimension_count dims (the file's M-RoPE sections all rotate by the text position:
a fourth section is refused) and the sigmoid output gate; every layer's FFN input norm is
post_attention_norm.  The DeltaNet geometry comes from ssm.conv_kernel, ssm.state_size
(key and value head size), ssm.group_count (key heads), ssm.time_step_rank (value heads),
ssm.inner_size (= value heads x state size).  qwen35moe: the same with routed experts and a
shared expert (expert_count, expert_used_count, expert_feed_forward_length,
expert_shared_feed_forward_length) through vramd/engine/moe.py.
"""

from __future__ import annotations

from vramd.engine.arch.hparams import Hparams
from vramd.engine.arch.moe import BATCH as MOE_BATCH
from vramd.engine.arch.moe import shared_width
from vramd.engine.arch.spec import ArchSpec, DeltaNetSpec, LayerSpec, MoESpec
from vramd.engine.deltanet_limits import MAX_CONV, MAX_STATE


def qwen35(hp: Hparams) -> ArchSpec:
    return _spec(hp, None)


def qwen35moe(hp: Hparams) -> ArchSpec:
    """qwen35's layers with every FFN routed: softmax over the experts, the top expert_used_count
    renormalized, plus the shared expert gated by sigmoid(ffn_gate_inp_shexp . h)
    (llama_model_qwen35moe::build_layer_ffn: build_moe_ffn with norm_w, softmax gating)."""
    n_expert, n_used = hp.get("expert_count"), hp.get("expert_used_count")
    if n_used > n_expert:
        raise hp.fail(f"{hp.arch}.expert_used_count {n_used} exceeds {hp.arch}.expert_count {n_expert}")
    return _spec(hp, MoESpec(n_expert=n_expert, n_used=n_used, n_ff_exp=hp.get("expert_feed_forward_length"),
                             n_ff_shexp=shared_width(hp), renormalize=True))


def _spec(hp: Hparams, moe_spec) -> ArchSpec:
    g = hp.common()
    if g["n_rot"] != g["head_dim"] and g["n_rot"] % 2:
        raise hp.fail(f"{hp.arch}.rope.dimension_count {g['n_rot']} is odd")
    sections = hp.md.get(f"{hp.arch}.rope.dimension_sections")
    if sections is None:
        raise hp.fail(f"missing {hp.arch}.rope.dimension_sections")
    if len(sections) > 3 and int(sections[3]) != 0:
        raise hp.fail(f"{hp.arch}.rope.dimension_sections {list(sections)}: a fourth (extra) section is not supported")
    net = DeltaNetSpec(d_conv=hp.get("ssm.conv_kernel"), s=hp.get("ssm.state_size"),
                       hk=hp.get("ssm.group_count"), hv=hp.get("ssm.time_step_rank"))
    if hp.get("ssm.inner_size") != net.value_dim:
        raise hp.fail(f"{hp.arch}.ssm.inner_size {hp.get('ssm.inner_size')} is not time_step_rank x state_size "
                      f"({net.value_dim})")
    if net.hv % net.hk:
        raise hp.fail(f"{hp.arch}.ssm.time_step_rank {net.hv} is not a multiple of ssm.group_count {net.hk}")
    if net.s > MAX_STATE or net.d_conv > MAX_CONV:
        raise hp.fail(f"{hp.arch}: ssm.state_size {net.s} / ssm.conv_kernel {net.d_conv} exceed the kernels' "
                      f"{MAX_STATE} / {MAX_CONV}")
    if int(hp.md.get(f"{hp.arch}.nextn_predict_layers", 0) or 0) > 0:
        # the multi-token-prediction block counts in block_count without being a layer of the graph
        raise hp.fail(f"{hp.arch}.nextn_predict_layers = {hp.md[f'{hp.arch}.nextn_predict_layers']}: "
                      f"multi-token-prediction blocks are not supported")
    interval = hp.get("full_attention_interval", 4)
    pattern = hp.md.get(f"{hp.arch}.attention.recurrent_layers")   # per layer, where the file says (llama.cpp reads it)
    if pattern is not None and len(pattern) != g["n_layer"]:
        raise hp.fail(f"{hp.arch}.attention.recurrent_layers has {len(pattern)} entries for {g['n_layer']} layers")
    recurrent = [bool(pattern[i]) if pattern is not None else (i + 1) % interval != 0 for i in range(g["n_layer"])]
    base, scale = hp.get("rope.freq_base", 10000.0, kind=float), hp.rope_freq_scale()
    layers = tuple(LayerSpec(base, scale, recurrent=recurrent[i], moe=moe_spec is not None)
                   for i in range(g["n_layer"]))
    ffn = (dict(moe=moe_spec, batch=MOE_BATCH, takes_embeds=False) if moe_spec is not None
           else dict(n_ff=hp.get("feed_forward_length")))
    return ArchSpec(family=hp.arch, neox=True, qk_norm=True, layers=layers, deltanet=net, attn_gate=True,
                    ffn_norm="post_attention_norm", **ffn, **g)
