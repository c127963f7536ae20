"""gemma3 (Gemma 3 270M / 1B / 4B / 12B / 27B text), as llama.cpp defines it.

What llama.cpp computes for general.architecture "gemma3" (its
src/models/gemma3.cpp graph and llama-model.cpp hparams):

  x = token_embd[t] * sqrt(n_embd)                 (sqrtf, f32)
  per layer l:
    h = rms_norm(x) * attn_norm
    q, k, v = Wq h, Wk h, Wv h                      (no biases)
    q = rms_norm_per_head(q) * attn_q_norm          (over head_dim, one weight for every head)
    k = rms_norm_per_head(k) * attn_k_norm
    q, k = rope_neox(q, k; base_l, scale_l)
    o = attention(q, K, V; scale = f_attention_scale, window_l)
    x = x + rms_norm(Wo o) * post_attention_norm
    h = rms_norm(x) * ffn_norm
    x = x + rms_norm(Wdown (gelu(Wgate h) * Wup h)) * post_ffw_norm
  logits = Woutput (rms_norm(x) * output_norm)       (Woutput = token_embd when output.weight is absent)
  logits = cap * tanh(logits / cap)                   when A.final_logit_softcapping > 0

Conventions, as found:
  * Norm weights: Gemma's RMSNorm computes x_hat * (1 + w) in HF; llama.cpp's
    convert_hf_to_gguf.py adds 1 to every `*norm.weight` at conversion, and
    the graph multiplies by the stored weight.  So the kernel multiplies by
    the weight as stored.  The real Gemma 3 270M file agrees: its norm
    weights are stored "shifted" (attn_norm mean ~13, ffn_norm with exact
    0.0 entries = HF w of -1.0, output_norm up to 301); with them as stored,
    it continues "Q: What is the capital of France?\nA:" with " The capital
    of France is Paris."; with 1 + stored it produces "là........".
  * Sliding window: A.attention.sliding_window (512 in the 270M); when it is
    present and > 0, llama.cpp's set_swa_pattern(6) makes layer l sliding iff
    l % 6 < 5 (every 6th layer is global).  No key carries the pattern for
    gemma3, so 6 is assumed here too.  A sliding layer's query at position p
    sees cache rows p - window < j <= p.  Without the key (or 0) every layer
    is global.
  * RoPE: NeoX.  Global layers: base A.rope.freq_base (1e6 in the 270M),
    freq_scale 1/A.rope.scaling.factor for a "linear" scaling (the 4B-27B
    files carry factor 8).  Sliding layers: base 10000 and scale 1,
    hard-coded by llama.cpp (rope_freq_base_train_swa); no key.
  * Attention scale (query_pre_attn_scalar): 1/sqrt(key_length), except for
    the 27B (62 layers): 1/sqrt(n_embd / n_head) (integer division); no key.
  * GELU: ggml_gelu, the tanh approximation.
  * Final logit soft-capping: A.final_logit_softcapping when present and > 0
    (Gemma 3 checkpoints do not set it; llama.cpp's current gemma3 graph
    applies it only without a sliding window; a file with both is capped here).
"""

from __future__ import annotations

import math

from vramd.engine.arch.hparams import Hparams
from vramd.engine.arch.spec import ArchSpec, LayerSpec

SWA_PATTERN = 6            # llama.cpp: hparams.set_swa_pattern(6) for gemma3
SWA_FREQ_BASE = 10000.0    # llama.cpp: rope_freq_base_train_swa for gemma3
SWA_FREQ_SCALE = 1.0


def gemma3(hp: Hparams) -> ArchSpec:
    g = hp.common()
    window = hp.size("attention.sliding_window")
    softcap = hp.get("final_logit_softcapping", 0.0, kind=float)
    if softcap < 0:
        raise hp.fail(f"{hp.arch}.final_logit_softcapping = {softcap} is negative")
    base, scale = hp.get("rope.freq_base", 10000.0, kind=float), hp.rope_freq_scale()
    layers = tuple(LayerSpec(SWA_FREQ_BASE, SWA_FREQ_SCALE, window) if window and i % SWA_PATTERN < SWA_PATTERN - 1
                   else LayerSpec(base, scale) for i in range(g["n_layer"]))
    wide = g["n_layer"] == 62   # the 27B
    return ArchSpec(family="gemma3", n_ff=hp.get("feed_forward_length"), neox=True, qk_norm=True, post_norms=True,
                    embed_scale=math.sqrt(g["n_embd"]), activation="gelu", final_softcap=softcap,
                    attn_scale=1.0 / math.sqrt(g["n_embd"] // g["n_head"] if wide else g["head_dim"]),
                    layers=layers, **g)
