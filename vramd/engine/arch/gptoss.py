"""gpt-oss (OpenAI's gpt-oss-20b / 120b), as llama.cpp defines it (general.architecture "gpt-oss").

What llama.cpp computes (src/models/openai-moe-iswa.cpp; llama-model.cpp's
hparams for LLM_ARCH_OPENAI_MOE; build_moe_ffn with LLM_FFN_SWIGLU_OAI_MOE and
LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT):

  per layer l:
    h = rms_norm(x) * attn_norm
    q, k, v = Wq h + bq, Wk h + bk, Wv h + bv; NeoX RoPE (YaRN from rope.scaling.*)
    o = attention(q, K, V; scale 1/sqrt(head_dim), sinks_l)   even layers slide
        over attention.sliding_window keys (set_swa_pattern(2)), odd layers are full;
        sinks: a logit per head in the softmax's denominator (attn_sinks.weight)
    x = x + Wo o + bo
    h = rms_norm(x) * post_attention_norm              (the FFN's pre-norm, so named)
    router = Wr h + br; the top k (expert_used_count); weights softmax over the
        k chosen logits (= softmax over all, renormalized over the k)
    x = x + sum_j w_j (Wdown_j swiglu_oai(Wgate_j h + bgate_j, Wup_j h + bup_j) + bdown_j)
  logits = Woutput (rms_norm(x) * output_norm)

swiglu_oai: alpha 1.702 and limit 7, constants in llama.cpp's graph (no key).
Head geometry: attention.key_length (64) with n_head * head_dim != n_embd
(2880 for 64 x 64).  Expert matrices are MXFP4 in the released files.
"""

from __future__ import annotations

from vramd.engine.arch.hparams import Hparams
from vramd.engine.arch.moe import BATCH
from vramd.engine.arch.spec import ArchSpec, LayerSpec, MoESpec

SWA_PATTERN = 2            # llama.cpp: hparams.set_swa_pattern(2): layer l slides iff l % 2 == 0
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0


def gptoss(hp: Hparams) -> ArchSpec:
    g = hp.common()
    n_expert, n_used = hp.get("expert_count"), hp.get("expert_used_count")
    if n_used > n_expert:
        raise hp.fail(f"{hp.arch}.expert_used_count {n_used} exceeds {hp.arch}.expert_count {n_expert}")
    moe = MoESpec(n_expert=n_expert, n_used=n_used, n_ff_exp=hp.get("expert_feed_forward_length"),
                  renormalize=True, biases=True, activation="swiglu_oai", swiglu_alpha=SWIGLU_ALPHA,
                  swiglu_limit=SWIGLU_LIMIT)
    window = hp.size("attention.sliding_window")
    base, scale = hp.get("rope.freq_base", 10000.0, kind=float), hp.rope_freq_scale()
    layers = tuple(LayerSpec(base, scale, window=window if i % SWA_PATTERN < SWA_PATTERN - 1 else 0, moe=True)
                   for i in range(g["n_layer"]))
    return ArchSpec(family=hp.arch, neox=True, moe=moe, batch=BATCH, takes_embeds=False, attn_sinks=True,
                    ffn_norm="post_attention_norm", layers=layers, **g)
