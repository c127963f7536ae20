"""The Gemma family: gemma3 (Gemma 3 270M / 1B / 4B / 12B / 27B text) and gemma2, as llama.cpp defines them.

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

gemma2 (src/models/gemma2-iswa.cpp; llama-model.cpp's LLM_ARCH_GEMMA2) is the
same graph without QK-norm, and:
  * attention logits soft-capped: s = cap * tanh(s / cap) after the scale,
    before the mask and softmax; cap = A.attn_logit_softcapping, default 50
    (llama.cpp's hparams.attn_soft_cap is always on for gemma2);
  * final logits always soft-capped: A.final_logit_softcapping, default 30;
  * sliding window A.attention.sliding_window (default 4096), pattern 2:
    layer l slides iff l % 2 == 0; sliding layers keep the global RoPE base
    and scale (no gemma3-style 10000);
  * the same query scale rule: 1/sqrt(key_length), for 46 layers (the 27B)
    1/sqrt(n_embd / n_head).
"""

from __future__ import annotations

import math

from vramd.engine.arch.hparams import Hparams
from vramd.engine.arch.spec import ArchSpec, LayerSpec

SWA_PATTERN = 6            # llama.cpp: hparams.set_swa_pattern(6) for gemma3
SWA_FREQ_BASE = 10000.0    # llama.cpp: rope_freq_base_train_swa for gemma3
SWA_FREQ_SCALE = 1.0
GEMMA2_SWA_PATTERN = 2     # set_swa_pattern(2)
GEMMA2_WINDOW = 4096       # n_swa when the key is absent
GEMMA2_ATTN_SOFTCAP, GEMMA2_FINAL_SOFTCAP = 50.0, 30.0   # llama-hparams.h defaults


def gemma(hp: Hparams, *, pattern: int, window: int, swa_rope: tuple | None, wide_layers: int, **fields) -> ArchSpec:
    """The Gemma graph: every `pattern`-th layer global, the others sliding over `window`
    (0: none) with RoPE (base, scale) `swa_rope` (None: the global one); embeddings times
    sqrt(n_embd), post-norms, GELU; the query scale of the `wide_layers`-layer 27B differs."""
    g = hp.common()
    base, scale = hp.get("rope.freq_base", 10000.0, kind=float), hp.rope_freq_scale()
    swa = LayerSpec(*(swa_rope or (base, scale)), window)
    layers = tuple(swa if window and i % pattern < pattern - 1 else LayerSpec(base, scale) for i in range(g["n_layer"]))
    wide = g["n_layer"] == wide_layers
    return ArchSpec(family=hp.arch, n_ff=hp.get("feed_forward_length"), neox=True, post_norms=True,
                    embed_scale=math.sqrt(g["n_embd"]), activation="gelu",
                    attn_scale=1.0 / math.sqrt(g["n_embd"] // g["n_head"] if wide else g["head_dim"]),
                    layers=layers, **fields, **g)


def gemma3(hp: Hparams) -> ArchSpec:
    softcap = hp.get("final_logit_softcapping", 0.0, kind=float)
    if softcap < 0:
        raise hp.fail(f"{hp.arch}.final_logit_softcapping = {softcap} is negative")
    return gemma(hp, pattern=SWA_PATTERN, window=hp.size("attention.sliding_window"),
                 swa_rope=(SWA_FREQ_BASE, SWA_FREQ_SCALE), wide_layers=62, qk_norm=True, final_softcap=softcap)


def gemma2(hp: Hparams) -> ArchSpec:
    window = hp.size("attention.sliding_window") if hp.has("attention.sliding_window") else GEMMA2_WINDOW
    return gemma(hp, pattern=GEMMA2_SWA_PATTERN, window=window, swa_rope=None, wide_layers=46,
                 attn_softcap=hp.positive("attn_logit_softcapping", GEMMA2_ATTN_SOFTCAP),
                 final_softcap=hp.positive("final_logit_softcapping", GEMMA2_FINAL_SOFTCAP))
