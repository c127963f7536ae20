"""What an architecture is, as data: `ArchSpec` (the model) and `LayerSpec` (one layer).

An architecture module (vramd/engine/arch/<family>.py) turns a file's
metadata into an ArchSpec; everything after that — the tensor table
(vramd/engine/tensors.py), the scratch layout, the layer math
(vramd/engine/blocks.py, moe.py) and the forward pass
(vramd/engine/model.py) — reads only the spec, so two architectures that
differ in a convention differ in one field here, not in a copied forward pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RopeScaling:
    """What scales the rotary angles beyond freq_scale, as ggml's rope takes it
    (ggml-cpu's rope_yarn / ggml_rope_yarn_corr_dims; llama.cpp's cparams):

      theta_extrap = p * base^(-2k/n_rot) / factor[k]     theta_interp = freq_scale * theta_extrap
      ext_factor != 0 (YaRN): theta = theta_interp (1 - mix_k) + theta_extrap mix_k,
          mix_k = ext_factor * (1 - clamp((k - lo) / max(0.001, hi - lo), 0, 1)),
          [lo, hi] = corr_dims(base): the pairs whose wavelength lies between
          n_ctx_orig / beta_fast and n_ctx_orig / beta_slow
      cos and sin multiplied by mscale: attn_factor, and under YaRN also
          (1 + 0.1 ln(1 / freq_scale)) (the kernel's own YaRN magnitude)

    attn_factor is llama.cpp's cparams.yarn_attn_factor (the arch module
    derives it from rope.scaling.attn_factor and, for YaRN, the factor).
    LongRoPE (phi3) is frequency factors with ext_factor 0 and attn_factor."""

    ext_factor: float = 0.0
    attn_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    n_ctx_orig: int = 0

    def corr_dims(self, n_rot: int, base: float) -> tuple[float, float]:
        """ggml_rope_yarn_corr_dims: the first and last pair index of the ramp."""
        def dim(beta: float) -> float:
            return n_rot * math.log(self.n_ctx_orig / (beta * 2 * math.pi)) / (2 * math.log(base))
        lo, hi = math.floor(dim(self.beta_fast)), math.ceil(dim(self.beta_slow))
        return float(max(0, lo)), float(min(n_rot - 1, hi))


@dataclass(frozen=True)
class LayerSpec:
    rope_base: float
    rope_scale: float          # freq_scale (1 / linear factor)
    window: int = 0            # sliding-window size; 0: the layer attends to every key
    moe: bool = False          # the FFN is routed experts (else dense)
    # Per-layer geometry where an architecture mixes kinds of layer (gemma4: sliding
    # layers of one head size and KV-head count, global ones of another); 0: the spec's.
    head_dim: int = 0
    n_head_kv: int = 0
    n_rot: int = 0
    rope_factors: bool = True  # the spec's RoPE frequency factors apply here (gemma4: global layers only)
    v_from_k: bool = False     # no attn_v: V is the K projection, before k's norm and RoPE (gemma4)
    out_scale: float = 1.0     # the layer's output (the residual stream) times this (gemma4's layer_output_scale)
    recurrent: bool = False    # a Gated DeltaNet layer (spec.deltanet) instead of attention (qwen35)
    kv_source: int = -1        # >= 0: the layer writes no K/V and attends over that layer's (gemma4 E2B/E4B)
    n_ff: int = 0              # the layer's dense FFN width where it differs per layer (0: the spec's)


@dataclass(frozen=True)
class DeltaNetSpec:
    """Gated DeltaNet's geometry (qwen35's ssm.* keys): d_conv taps, hk key heads and hv value
    heads of size s; vramd/engine/deltanet.py's header says what the layer computes."""
    d_conv: int
    s: int
    hk: int
    hv: int

    @property
    def conv_dim(self) -> int:     # channels of the convolution: q, k (hk s each) and v (hv s)
        return 2 * self.hk * self.s + self.hv * self.s

    @property
    def value_dim(self) -> int:
        return self.hv * self.s


@dataclass(frozen=True)
class MoESpec:
    n_expert: int
    n_used: int
    n_ff_exp: int
    n_ff_shexp: int = 0        # qwen2moe's shared expert (0: none)
    renormalize: bool = True   # the chosen experts' weights are scaled to sum 1
    # gpt-oss: biases on the router and every expert matrix (ffn_*.bias, F32), and the
    # clamped SwiGLU "swiglu_oai": g = min(g, limit), u = clamp(u, +-limit),
    # g * sigmoid(alpha * g) * (u + 1); "silu": silu(g) * u
    biases: bool = False
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # gemma4 (arch/gemma4_moe.py): a dense FFN beside the experts (ffn_norm in, post_ffw_norm_1
    # out), the experts' own input norm (pre_ffw_norm_2) and output norm (post_ffw_norm_2),
    # their sum post-normed (post_ffw_norm) into the residual stream; "gelu": gelu(g) * u
    dense_beside: bool = False
    router_scale: bool = False   # the router reads rms_norm(x) / sqrt(n_embd) * ffn_gate_inp.scale
    expert_scale: bool = False   # ffn_down_exps.scale: expert e's output times scale[e]
    fused_gate_up: bool = False  # ffn_gate_up_exps: per expert n_ff_exp gate rows, then n_ff_exp up rows


@dataclass(frozen=True)
class ArchSpec:
    arch: str                  # general.architecture
    family: str                # what the registry calls it (mixtral is "llama" with experts)
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    eps: float
    n_rot: int
    tied_output: bool
    layers: tuple              # LayerSpec per layer
    n_ff: int = 0              # dense FFN width (0: every FFN is MoE)
    neox: bool = False         # RoPE pairs (x[i], x[i + n_rot/2]) instead of (x[2i], x[2i+1])
    rope_factors: bool = False  # rope_freqs.weight, where the file has it, divides the frequencies (llama 3)
    qk_norm: bool = False      # RMSNorm over each head of q and k (attn_q_norm, attn_k_norm)
    post_norms: bool = False   # gemma: RMSNorm of the attention and FFN outputs before the residual add
    embed_scale: float = 1.0   # token embeddings are multiplied by this (gemma: sqrt(n_embd))
    attn_scale: float = 0.0    # softmax scale; 0: 1/sqrt(head_dim)
    activation: str = "silu"   # the gated FFN's: "silu" or "gelu" (tanh approximation)
    final_softcap: float = 0.0  # logits = cap * tanh(logits / cap) when > 0
    attn_softcap: float = 0.0   # attention scores s = cap * tanh(s / cap) when > 0 (gemma2)
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)   # YaRN, LongRoPE's magnitude
    longrope_ctx: int = 0       # > 0: rope_factors_long/short.weight, long when the context exceeds this (phi3)
    attn_temp_scale: float = 0.0  # > 0: q *= 1 + scale * ln(floor((p + offset) / floor_) + 1) (mistral3, llama 4)
    attn_temp_floor: int = 0
    attn_temp_offset: float = 0.0
    fused_qkv: bool = False     # attn_qkv.weight holds q, k, v rows (phi3): the table hands out row views
    fused_up: bool = False      # ffn_up.weight holds gate then up rows, 2 n_ff (phi3)
    v_norm: bool = False        # V RMS-normed per head, no weight, before the cache (gemma4)
    attn_sinks: bool = False    # attn_sinks.weight: a logit per head in each softmax's denominator (gpt-oss)
    moe: MoESpec | None = None
    deltanet: DeltaNetSpec | None = None   # the recurrent layers' geometry (LayerSpec.recurrent)
    ple: int = 0               # > 0: per-layer embeddings of this width (gemma4 E2B/E4B: vramd/engine/ple.py)
    attn_gate: bool = False    # attn_q holds per head [query | gate]; out *= sigmoid(gate) before Wo (qwen35)
    ffn_norm: str = "ffn_norm"  # the FFN's input norm tensor (qwen35: post_attention_norm)
    batch: int = 512           # tokens per prefill chunk by default (--prefill-chunk; vramd/engine/scratch.py;
    #                            2048 measured 15 % faster at a 2,000-token prompt on the H200, the same at
    #                            512, for 2.8x the scratch: docs/benchmarks.md)
    # Capabilities the daemon asks about instead of sniffing the code:
    takes_embeds: bool = True  # input embeddings (an image's) can stand in for tokens

    @property
    def q_width(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.n_head_kv * self.head_dim

    def head_dim_of(self, i: int) -> int:
        return self.layers[i].head_dim or self.head_dim

    def n_head_kv_of(self, i: int) -> int:
        return self.layers[i].n_head_kv or self.n_head_kv

    def n_rot_of(self, i: int) -> int:
        return self.layers[i].n_rot or self.n_rot

    def n_ff_of(self, i: int) -> int:
        return self.layers[i].n_ff or self.n_ff

    def q_width_of(self, i: int) -> int:
        return self.n_head * self.head_dim_of(i)

    def kv_width_of(self, i: int) -> int:
        return self.n_head_kv_of(i) * self.head_dim_of(i)

    @property
    def max_q_width(self) -> int:
        """The widest layer's query rows (the scratch and KV cache are sized for the widest)."""
        return max(self.q_width_of(i) for i in range(self.n_layer))

    @property
    def max_kv_width(self) -> int:
        return max(self.kv_width_of(i) for i in range(self.n_layer))

    @property
    def scale(self) -> float:
        return self.attn_scale or 1.0 / math.sqrt(self.head_dim)

    def rope_factors_name(self, ctx: int) -> str | None:
        """The frequency-factor tensor the RoPE of a model loaded with `ctx` reads, if any:
        rope_freqs.weight (llama 3), or LongRoPE's long factors when ctx exceeds the
        original context (llama.cpp's get_rope_factors), else its short ones."""
        if self.longrope_ctx:
            return "rope_factors_long.weight" if ctx > self.longrope_ctx else "rope_factors_short.weight"
        return "rope_freqs.weight" if self.rope_factors else None

    def rope_params(self, i: int) -> dict:
        """Layer i's RoPE as Ops.rope takes it (ordering, base, scale, YaRN ramp, magnitude)."""
        layer, r, n_rot = self.layers[i], self.rope_scaling, self.n_rot_of(i)
        lo = hi = 0.0
        mscale = r.attn_factor
        if r.ext_factor != 0.0:
            lo, hi = r.corr_dims(n_rot, layer.rope_base)
            mscale *= 1.0 + 0.1 * math.log(1.0 / layer.rope_scale)
        return dict(n_rot=n_rot, neox=self.neox, freq_base=layer.rope_base, freq_scale=layer.rope_scale,
                    ext_factor=r.ext_factor, corr_dims=(lo, hi), mscale=mscale)
