"""Synthetic llama-family GGUF models for the engine's tests.

Owns: `write_llama` (and the pieces it is made of: `LlamaSpec`, `make_weights`,
`write_weights`), which writes small, deterministic llama / mistral-style /
qwen2 / qwen3 models with complete tokenizer metadata, in any type of
tests/ggufgen/quant.py (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K,
Q5_K, Q6_K).  Nothing is committed as a binary: tests write the files they
need (a default model is ~0.9 MB in F16, ~0.25 MB in Q4_0, ~0.1 s to write).

Architectures ("arch" here is a style; general.architecture is what is written)
    llama    general.architecture "llama", n_head_kv = n_head, rope base 1e4,
             SentencePiece vocabulary, Llama-2 [INST]/<<SYS>> chat template.
    mistral  general.architecture "llama" (as llama.cpp converts Mistral 7B),
             GQA n_head_kv = n_head / 4 (at least 1), rope base 1e6, SentencePiece
             vocabulary, Mistral [INST] chat template.
    qwen2    general.architecture "qwen2" (NeoX RoPE), GQA n_head_kv = n_head / 2,
             q/k/v biases, rope base 1e6, eps 1e-6, GPT-2 BPE vocabulary with
             ChatML specials and template, no BOS added.
    qwen3    general.architecture "qwen3" (src/models/qwen3.cpp): qwen2's shape
             without biases, with attn_q_norm / attn_k_norm [head_dim] (gains
             QK_NORM_GAIN (1 + N(0, 0.1^2)), QK_NORM_GAIN = 1.5, and attn_q/attn_k
             N(0, 1/n_embd): the norm sets the scale), attention.key_length /
             value_length always written (key_length= sets a head_dim other than
             n_embd / n_head, as Qwen3's 128), BPE vocabulary with Qwen3's own
             chat template (vocab.QWEN3_TEMPLATE).
    mistral3 general.architecture "mistral3" (src/models/mistral3.cpp): llama's graph
             and tensors, GQA n_head / 4, rope base 1e6, SentencePiece vocabulary,
             Mistral template; YaRN and attention temperature where asked (below).
    phi3     general.architecture "phi3" (src/models/phi3.cpp): NeoX RoPE, q/k/v
             fused into attn_qkv.weight (fused_qkv=True, the default; False writes
             attn_q/k/v) and gate and up fused into ffn_up.weight (2 n_ff rows, gate
             first: always), no biases, SentencePiece vocabulary ending in Phi-3's
             control tokens (vocab.PHI3_TOKENS: llama.cpp needs "<|endoftext|>"),
             ChatML template;
             longrope=True writes rope_factors_long / rope_factors_short.weight
             (LongRoPE_LONG / _SHORT below).
  Every default can be overridden (n_head_kv, with_bias, vocab, rope_freq_base...).
  RoPE options, for every style: n_rot (rope.dimension_count below head_dim: partial
  rotary), rope_scaling ("yarn", "longrope" or "linear" with rope_scaling_factor; None:
  linear when a factor is given), orig_ctx (rope.scaling.original_context_length),
  rope_attn_factor (rope.scaling.attn_factor), yarn_beta_fast / yarn_beta_slow /
  yarn_log_mul (rope.scaling.yarn_*), attn_temp_scale (attention.temperature_scale),
  sliding_window (attention.sliding_window, which phi3 ignores).  The fused tensors are
  the unfused ones' values stacked (the same random streams), so a fused and an unfused
  file of one spec compute the same function.

Weights (all from numpy's default_rng, one stream per tensor seeded by
(seed, crc32(name)), so changing one option leaves every other tensor as it was):
    token_embd       N(0, 1); tied: N(0, (0.25/sqrt(n_embd))^2), see below
    attn_q, attn_k   N(0, (1.5/sqrt(n_embd))^2)  q.k/sqrt(d) has std ~1.5^2: attention
                                              is selective without being one-hot
    attn_v           N(0, 1/n_embd)
    attn_output      N(0, 1/(n_head*head_dim))
    ffn_gate, ffn_up N(0, 1/n_embd);  ffn_down N(0, 1/n_ff)
    q/k/v biases     N(0, 0.5^2), N(0, 0.5^2), N(0, 0.1^2)
    attn_norm, ffn_norm   1 + N(0, 0.1^2)
    output           N(0, (LOGIT_STD/sqrt(n_embd))^2), output_norm 1 + N(0, 0.1^2):
                     logits have a standard deviation of about LOGIT_STD = 4.
    tied output      no output.weight; token_embd N(0, (TIED_EMBD/sqrt(n_embd))^2) and
                     output_norm (LOGIT_STD/TIED_EMBD) * (1 + N(0, 0.1^2)), TIED_EMBD = 0.25.
      Why the small tied embedding: the final hidden state contains the current
      token's own embedding e_t, and e_t.e_t ~ |e|^2 dwarfs e_t.e_v ~ |e|^2/sqrt(n_embd),
      so with N(0, 1) embeddings a tied model predicts its last token forever
      (llama.cpp does exactly that on such a file).  At 0.25/sqrt(n_embd) the
      embedding is a small part of the residual stream (the first attn_norm
      rescales it for layer 0), and the logits keep a std of ~LOGIT_STD.
  With logits that spread, the gap between the best and the second-best token
  is typically ~1 (median 0.6 to 1.3), so small numeric differences rarely flip
  a greedy choice, and each layer's attention and FFN add at least as much to
  the residual stream as the embedding: continuations depend on the whole
  prompt, not only on its last token (test_reference checks both, tied models
  included).  Quantized types quantize these values with gguf.quants.quantize,
  K-quants with quant.quantize_k (what a test compares against is always the
  dequantized file, never the float values).  Norm weights and biases are F32,
  as in llama.cpp conversions; every matrix, token_embd and output included,
  takes `weight_type`.
  Vocabularies and templates: tests/ggufgen/vocab.py; types and quantization:
  tests/ggufgen/quant.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from tests.ggufgen.common import TIED_EMBD, gain, normal, output_head, rng, start_writer
from tests.ggufgen.quant import WEIGHT_TYPES, write_tensors
from tests.ggufgen.vocab import CHATML_TEMPLATE, LLAMA2_TEMPLATE, MISTRAL_TEMPLATE, QWEN3_TEMPLATE, write_vocab

# Per style: (general.architecture, default n_head_kv given n_head, rope base, eps,
#             vocabulary, biases, chat template for that vocabulary)
_STYLES = {
    "llama": ("llama", lambda h: h, 10000.0, 1e-5, "spm", False, LLAMA2_TEMPLATE),
    "mistral": ("llama", lambda h: max(1, h // 4), 1e6, 1e-5, "spm", False, MISTRAL_TEMPLATE),
    "qwen2": ("qwen2", lambda h: max(1, h // 2), 1e6, 1e-6, "bpe", True, CHATML_TEMPLATE),
    "qwen3": ("qwen3", lambda h: max(1, h // 2), 1e6, 1e-6, "bpe", False, QWEN3_TEMPLATE),
    "mistral3": ("mistral3", lambda h: max(1, h // 4), 1e6, 1e-5, "spm", False, MISTRAL_TEMPLATE),
    "phi3": ("phi3", lambda h: h, 10000.0, 1e-5, "spm", False, CHATML_TEMPLATE),
}
# LongRoPE factors (phi3's rope_factors_*): both slow the rotation, the long ones much more,
# as Phi-3-128k's (short ~1-1.1, long up to tens), so that the choice between them matters.
LONGROPE_SHORT, LONGROPE_LONG = (1.0, 1.2), (1.0, 24.0)
QK_NORM_GAIN = 1.5   # qwen3's attn_q_norm / attn_k_norm: see the module header


@dataclass(frozen=True)
class LlamaSpec:
    """Everything write_llama is told; None fields take the style's default (see resolve())."""

    arch: str = "llama"
    n_vocab: int = 512
    n_embd: int = 128
    n_head: int = 4
    n_head_kv: int | None = None
    n_layer: int = 2
    n_ff: int = 256
    weight_type: str = "F16"
    tied_output: bool = False
    with_bias: bool | None = None
    vocab: str | None = None
    seed: int = 0
    rope_freq_base: float | None = None
    rope_scaling_factor: float | None = None   # written as rope.scaling.type linear + factor
    eps: float | None = None
    context_length: int = 4096
    bpe_pre: str = "gpt-2"
    chat_template: str | None = None           # None: the style's; "" writes none
    key_length: int | None = None              # head_dim; None: n_embd / n_head
    pooling_type: int | None = None            # <arch>.pooling_type (llama.cpp's enum: 0 none, 1 mean, 2 cls, 3 last)
    fim: str | None = None                     # FIM tokens and how they are named (vocab.py), None: none
    tool_tokens: bool = False                  # <tool_call> and </tool_call> as tokens of their own (vocab.py)
    n_rot: int | None = None                   # rope.dimension_count; None: head_dim
    rope_scaling: str | None = None            # rope.scaling.type; None: "linear" when a factor is set
    orig_ctx: int | None = None                # rope.scaling.original_context_length
    rope_attn_factor: float | None = None      # rope.scaling.attn_factor
    yarn_beta_fast: float | None = None
    yarn_beta_slow: float | None = None
    yarn_log_mul: float | None = None
    attn_temp_scale: float | None = None       # attention.temperature_scale (mistral3)
    sliding_window: int | None = None          # attention.sliding_window
    fused_qkv: bool = True                     # phi3 only: attn_qkv.weight
    longrope: bool = False                     # phi3 only: rope_factors_long/short.weight

    def resolve(self) -> "LlamaSpec":
        if self.arch not in _STYLES:
            raise ValueError(f"arch {self.arch!r}: expected one of {', '.join(_STYLES)}")
        _, kv_heads, base, eps, vocab, bias, template = _STYLES[self.arch]
        own = self.vocab is None or self.vocab == vocab
        spec = replace(
            self,
            n_head_kv=kv_heads(self.n_head) if self.n_head_kv is None else self.n_head_kv,
            rope_freq_base=base if self.rope_freq_base is None else self.rope_freq_base,
            eps=eps if self.eps is None else self.eps,
            vocab=vocab if self.vocab is None else self.vocab,
            with_bias=bias if self.with_bias is None else self.with_bias,
            chat_template=(self.chat_template if self.chat_template is not None else
                           template if own else
                           CHATML_TEMPLATE if self.vocab == "bpe" else LLAMA2_TEMPLATE))
        if spec.weight_type not in WEIGHT_TYPES:
            raise ValueError(f"weight_type {spec.weight_type!r}: expected one of {', '.join(WEIGHT_TYPES)}")
        if spec.vocab not in ("spm", "bpe"):
            raise ValueError(f"vocab {spec.vocab!r}: expected 'spm' or 'bpe'")
        if spec.key_length is None and spec.n_embd % spec.n_head or spec.head_dim % 2:
            raise ValueError(f"n_embd {spec.n_embd} must split into {spec.n_head} heads of even size")
        if spec.n_rot is not None and (spec.n_rot % 2 or not 0 < spec.n_rot <= spec.head_dim):
            raise ValueError(f"n_rot {spec.n_rot} must be even and at most head_dim {spec.head_dim}")
        if spec.n_head % spec.n_head_kv:
            raise ValueError(f"n_head {spec.n_head} is not a multiple of n_head_kv {spec.n_head_kv}")
        block = gguf.GGML_QUANT_SIZES[WEIGHT_TYPES[spec.weight_type]][0]
        for name, cols in (("n_embd", spec.n_embd), ("n_ff", spec.n_ff)):
            if cols % block:
                raise ValueError(f"{name} {cols} is not a multiple of {spec.weight_type}'s block {block}")
        return spec

    @property
    def gguf_arch(self) -> str:
        return _STYLES[self.arch][0]

    @property
    def head_dim(self) -> int:
        return self.key_length or self.n_embd // self.n_head

    @property
    def qk_norm(self) -> bool:
        return self.arch == "qwen3"

    @property
    def rot(self) -> int:
        return self.n_rot or self.head_dim


# --- weights -------------------------------------------------------------------------

def make_weights(spec: LlamaSpec) -> dict[str, np.ndarray]:
    """Every tensor of the model as float32 in numpy order ([rows, row length]),
    in file order: token_embd, the blocks, output_norm, output."""
    spec = spec.resolve()
    e, hd, f = spec.n_embd, spec.head_dim, spec.n_ff
    qk_std = (1.0 if spec.qk_norm else 1.5) / np.sqrt(e)   # with QK-norm the gains set the scale
    embd_std = TIED_EMBD / np.sqrt(e) if spec.tied_output else 1.0
    w: dict[str, np.ndarray] = {"token_embd.weight": normal(spec, "token_embd.weight", (spec.n_vocab, e),
                                                             embd_std)}
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        w[p + "attn_norm.weight"] = gain(spec, p + "attn_norm.weight", e)
        w[p + "attn_q.weight"] = normal(spec, p + "attn_q.weight", (spec.n_head * hd, e), qk_std)
        w[p + "attn_k.weight"] = normal(spec, p + "attn_k.weight", (spec.n_head_kv * hd, e), qk_std)
        w[p + "attn_v.weight"] = normal(spec, p + "attn_v.weight", (spec.n_head_kv * hd, e), 1 / np.sqrt(e))
        if spec.with_bias:
            w[p + "attn_q.bias"] = normal(spec, p + "attn_q.bias", (spec.n_head * hd,), 0.5)
            w[p + "attn_k.bias"] = normal(spec, p + "attn_k.bias", (spec.n_head_kv * hd,), 0.5)
            w[p + "attn_v.bias"] = normal(spec, p + "attn_v.bias", (spec.n_head_kv * hd,), 0.1)
        if spec.qk_norm:
            w[p + "attn_q_norm.weight"] = gain(spec, p + "attn_q_norm.weight", hd, QK_NORM_GAIN)
            w[p + "attn_k_norm.weight"] = gain(spec, p + "attn_k_norm.weight", hd, QK_NORM_GAIN)
        w[p + "attn_output.weight"] = normal(spec, p + "attn_output.weight", (e, spec.n_head * hd),
                                              1 / np.sqrt(spec.n_head * hd))
        w[p + "ffn_norm.weight"] = gain(spec, p + "ffn_norm.weight", e)
        w[p + "ffn_gate.weight"] = normal(spec, p + "ffn_gate.weight", (f, e), 1 / np.sqrt(e))
        w[p + "ffn_up.weight"] = normal(spec, p + "ffn_up.weight", (f, e), 1 / np.sqrt(e))
        w[p + "ffn_down.weight"] = normal(spec, p + "ffn_down.weight", (e, f), 1 / np.sqrt(f))
    if spec.arch == "phi3":
        w = _fuse_phi3(spec, w)
    return w | output_head(spec, e)


def _fuse_phi3(spec: LlamaSpec, w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """phi3's tensors from the unfused ones: attn_qkv (rows q, k, v) unless fused_qkv is
    False, ffn_up = [gate; up] (2 n_ff rows), and the LongRoPE factors first if asked."""
    out: dict[str, np.ndarray] = {}
    if spec.longrope:
        half = spec.rot // 2
        for name, (lo, hi) in (("rope_factors_long.weight", LONGROPE_LONG),
                               ("rope_factors_short.weight", LONGROPE_SHORT)):
            ramp = np.exp(np.linspace(np.log(lo), np.log(hi), half))
            out[name] = (ramp * (1.0 + 0.02 * rng(spec.seed, name).standard_normal(half))).astype(np.float32)
    for name, value in w.items():
        block, short = name.rsplit(".", 2)[0] + ".", name.split(".")[-2]   # "blk.3.", "attn_q"
        if short in ("attn_k", "attn_v") and spec.fused_qkv or short == "ffn_gate":
            continue
        if short == "attn_q" and spec.fused_qkv:
            out[block + "attn_qkv.weight"] = np.concatenate([value, w[block + "attn_k.weight"],
                                                            w[block + "attn_v.weight"]])
        elif short == "ffn_up":
            out[name] = np.concatenate([w[block + "ffn_gate.weight"], value])
        else:
            out[name] = value
    return out


def write_weights(path: str | Path, spec: LlamaSpec, weights: dict[str, np.ndarray]) -> Path:
    """Write `weights` (numpy order, float32) with the metadata and vocabulary
    of `spec`: 2-D tensors in spec.weight_type, 1-D ones in F32.  Tests use it
    to write edited weights (an expanded GQA, a tied copy, zeroed biases)."""
    spec = spec.resolve()
    path = Path(path)
    qtype = WEIGHT_TYPES[spec.weight_type]
    writer = start_writer(path, spec, spec.n_ff)
    if spec.qk_norm or spec.key_length is not None:     # Qwen3 conversions always write them
        writer.add_key_length(spec.head_dim)
        writer.add_value_length(spec.head_dim)
    write_rope_keys(writer, spec)
    if spec.pooling_type is not None:
        writer.add_pooling_type(gguf.PoolingType(spec.pooling_type))
    writer.add_vocab_size(spec.n_vocab)
    write_vocab(writer, spec)
    write_tensors(writer, weights, lambda name, value: Q.F32 if np.ndim(value) == 1 else qtype)
    return path


def write_rope_keys(writer: gguf.GGUFWriter, spec) -> None:
    """The RoPE-scaling, temperature and window keys LlamaSpec's options ask for."""
    if spec.rope_scaling is not None or spec.rope_scaling_factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType(spec.rope_scaling or "linear"))
    if spec.rope_scaling_factor is not None:
        writer.add_rope_scaling_factor(spec.rope_scaling_factor)
    for value, add in ((spec.orig_ctx, writer.add_rope_scaling_orig_ctx_len),
                       (spec.rope_attn_factor, writer.add_rope_scaling_attn_factors),
                       (spec.yarn_beta_fast, writer.add_rope_scaling_yarn_beta_fast),
                       (spec.yarn_beta_slow, writer.add_rope_scaling_yarn_beta_slow),
                       (spec.yarn_log_mul, writer.add_rope_scaling_yarn_log_mul),
                       (spec.attn_temp_scale, writer.add_attn_temperature_scale),
                       (spec.sliding_window, writer.add_sliding_window)):
        if value is not None:
            add(value)


def write_llama(path: str | Path, *, arch: str = "llama", n_vocab: int = 512, n_embd: int = 128,
                n_head: int = 4, n_head_kv: int | None = None, n_layer: int = 2, n_ff: int = 256,
                weight_type: str = "F16", tied_output: bool = False, with_bias: bool | None = None,
                vocab: str | None = None, seed: int = 0, **more) -> Path:
    """Write a synthetic model to `path` and return the path.  Same arguments,
    same bytes.  `more` takes LlamaSpec's other fields (rope_freq_base,
    rope_scaling_factor, eps, context_length, bpe_pre, chat_template, key_length,
    pooling_type, fim, and the RoPE options of the module header)."""
    spec = LlamaSpec(arch=arch, n_vocab=n_vocab, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
                     n_layer=n_layer, n_ff=n_ff, weight_type=weight_type, tied_output=tied_output,
                     with_bias=with_bias, vocab=vocab, seed=seed, **more)
    return write_weights(path, spec, make_weights(spec))
