"""gemma4 (Gemma 4's dense text decoder: the 31B), as llama.cpp build 10434 defines it.

What llama.cpp computes for general.architecture "gemma4" (src/models/gemma4.cpp:
llama_model_gemma4's load_arch_hparams, load_arch_tensors and graph;
llama-hparams.cpp's per-layer sizes), beside gemma3.py's Gemma graph:

  x = token_embd[t] * sqrt(n_embd)
  per layer l, of its kind (sliding or global: attention.sliding_window_pattern[l]):
    h = rms_norm(x) * attn_norm
    q = Wq h; k = Wk h; v = Wv h, or v = k where blk.l.attn_v is absent (attention_k_eq_v)
    q = rms_norm_per_head(q) * attn_q_norm; k = rms_norm_per_head(k) * attn_k_norm
    v = rms_norm_per_head(v)                           (no weight)
    q, k = rope_neox(q, k; n_rot_l, base_l, freq_factors_l)
    o = attention(q, K, V; scale 1 (f_attention_scale = 1), window on sliding layers)
    x = x + rms_norm(Wo o) * post_attention_norm
    h = rms_norm(x) * ffn_norm
    x = x + rms_norm(Wdown (gelu(Wgate h) * Wup h)) * post_ffw_norm
    x = x * layer_output_scale                        (blk.l.layer_output_scale, [1], where present)
  logits = cap * tanh(Woutput (rms_norm(x) * output_norm) / cap)   cap = final_logit_softcapping (0: none)

Per kind of layer:
  sliding  head size attention.key_length_swa, n_rot rope.dimension_count_swa,
           base rope.freq_base_swa (default rope.freq_base), window attention.sliding_window
  global   head size attention.key_length, n_rot rope.dimension_count, base
           rope.freq_base, and rope_freqs.weight as frequency factors: Gemma 4's
           "proportional" RoPE rotates a quarter of the pairs, the converter gives
           the others a factor of 1e30 (an angle of 0)
  both     attention.head_count_kv, one number or one per layer (the converter
           writes the array: the 31B has 16 KV heads on sliding layers, 4 on global)
Norm weights are used as stored (the converter shifts none for Gemma 4).
With expert_count (the 26B-A4B) arch/gemma4_moe.py adds the routed FFN to this spec.

E2B / E4B (attention.shared_kv_layers, embedding_length_per_layer_input, a
feed_forward_length per layer): arch/gemma4_e.py.
"""

from __future__ import annotations

import math
import os
import struct

from gguf import GGMLQuantizationType

from vramd.engine.arch import gemma4_e
from vramd.engine.arch.hparams import Hparams
from vramd.engine.arch.spec import ArchSpec, LayerSpec


def gemma4(hp: Hparams) -> ArchSpec:
    a = hp.arch
    n_layer, n_embd, n_head = hp.get("block_count"), hp.get("embedding_length"), hp.get("attention.head_count")
    swa = hp.flags("attention.sliding_window_pattern", n_layer)
    window = hp.get("attention.sliding_window")
    n_kv = hp.per_layer("attention.head_count_kv", n_layer, n_head)
    n_ff = hp.per_layer("feed_forward_length", n_layer)
    hd, rot, base = {}, {}, {}
    for kind, sfx in ((False, ""), (True, "_swa")):
        hd[kind] = hp.get("attention.key_length" + sfx, hd.get(False, n_embd // n_head))
        if hp.get("attention.value_length" + sfx, hd[kind]) != hd[kind]:
            raise hp.fail(f"{a}.attention.value_length{sfx} != key_length{sfx} is not supported")
        rot[kind] = hp.get("rope.dimension_count" + sfx, hd[kind])
        if rot[kind] % 2 or rot[kind] > hd[kind]:
            raise hp.fail(f"{a}.rope.dimension_count{sfx} {rot[kind]} does not fit head size {hd[kind]}")
    base[False] = hp.get("rope.freq_base", 10000.0, kind=float)
    base[True] = hp.get("rope.freq_base_swa", base[False], kind=float)
    scale = hp.rope_freq_scale()
    for i, k in enumerate(n_kv):
        if n_head % k:
            where = f" (layer {i})" if len(set(n_kv)) > 1 else ""
            raise hp.fail(f"{a}.attention.head_count {n_head} is not a multiple of {a}.attention.head_count_kv {k}{where}")
    softcap = hp.get("final_logit_softcapping", 0.0, kind=float)
    if softcap < 0:
        raise hp.fail(f"{a}.final_logit_softcapping = {softcap} is negative")
    layers = tuple(LayerSpec(base[s], scale, window if s else 0, head_dim=hd[s], n_head_kv=n_kv[i], n_rot=rot[s],
                             rope_factors=not s, v_from_k=f"blk.{i}.attn_v.weight" not in hp.tensor_names,
                             out_scale=_out_scale(hp, i))
                   for i, s in enumerate(swa))
    layers = gemma4_e.e_layers(hp, layers, n_ff, gemma4_e.kv_sources(hp, swa, n_kv, hd))
    glob = next((i for i, s in enumerate(swa) if not s), 0)   # the spec-level geometry: a global layer's
    return ArchSpec(arch=a, family=a, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_kv[glob],
                    head_dim=hd[False], n_vocab=hp.n_vocab(), eps=hp.get("attention.layer_norm_rms_epsilon", kind=float),
                    n_rot=rot[False], tied_output="output.weight" not in hp.tensor_names, layers=layers,
                    n_ff=max(n_ff), ple=gemma4_e.ple_width(hp), neox=True, qk_norm=True, post_norms=True, embed_scale=math.sqrt(n_embd),
                    activation="gelu", attn_scale=1.0, final_softcap=softcap, v_norm=True,
                    rope_factors="rope_freqs.weight" in hp.tensor_names, rope_scaling=hp.rope_scaling(),
                    takes_embeds=not gemma4_e.ple_width(hp))


def _out_scale(hp: Hparams, i: int) -> float:
    """blk.i.layer_output_scale.weight, one F32 read from the file (1 where absent): a
    constant of the layer, so the forward pass scales by it without reading a tensor."""
    name = f"blk.{i}.layer_output_scale.weight"
    if name not in hp.tensor_names:
        return 1.0
    t = hp.mf.tensor(name)
    if t.type != GGMLQuantizationType.F32 or t.n_elements != 1:
        raise hp.fail(f"{name} must be one F32 value, is {t.type.name} {list(t.shape)}")
    fd = os.open(hp.mf.path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        (v,) = struct.unpack("<f", os.pread(fd, 4, t.offset))
    finally:
        os.close(fd)
    if not math.isfinite(v):
        raise hp.fail(f"{name} = {v} is not finite")
    return v
