"""Synthetic gemma3 and gemma2 GGUF models for the engine's tests.

arch="gemma2" writes general.architecture "gemma2" (src/models/gemma2-iswa.cpp):
no attn_q_norm / attn_k_norm (attn_q, attn_k then N(0, (1.5/sqrt(n_embd))^2), as
llama.py's, so that q.k is selective), attn_softcap written as
attn_logit_softcapping and softcap as final_logit_softcapping (None: no key,
llama.cpp's defaults 50 and 30 apply), the window on even layers (pattern 2).

Owns: `write_gemma3` (and `Gemma3Spec`, `make_gemma3_weights`), which writes a
small, deterministic model with general.architecture "gemma3": QK-norm,
post-attention and post-FFN norms, a GELU FFN, sliding-window and global
layers, separate RoPE bases, optional linear RoPE scaling and logit
soft-capping, tied output by default (as Gemma), and tests/ggufgen/vocab.py's
SentencePiece vocabulary (no chat template: the engine falls back to its
Gemma template for this architecture).  Nothing binary is committed; tests
write the files they need (the default is ~0.3 MB in F16, ~0.1 s).

Shape defaults exercise what the 270M has: head_dim (key_length) 64 differs
from n_embd / n_head (32), one KV head for four query heads, 7 layers (so
layer 5 is global and layers 0-4 and 6 slide), a window of 8 positions (so a
short prompt already slides; the 270M's is 512), rope.freq_base 1e6 for the
global layers (the sliding ones use 10000, from no key).

Weights, well-conditioned (numpy default_rng streams seeded by (seed,
crc32(name)), common.py's, so one option leaves every other tensor alone):
    token_embd          N(0, (0.25/sqrt(n_embd))^2): times sqrt(n_embd) in the graph, the
                        embedding enters the residual stream at std ~0.25, a small part
                        next to the layers' normalized outputs (std ~1 each), so a tied
                        model does not predict its last token forever
    attn_q, attn_k      N(0, 1/n_embd) -- their scale is irrelevant: QK-norm follows
    attn_q_norm, attn_k_norm   1.5 (1 + N(0, 0.1^2)): q.k * 1/sqrt(head_dim) then has a
                        std of ~2.3: attention is selective without being one-hot
    attn_v N(0, 1/n_embd), attn_output N(0, 1/(n_head*head_dim))
    ffn_gate, ffn_up N(0, 1/n_embd), ffn_down N(0, 1/n_ff)
    attn_norm, post_attention_norm, ffn_norm, post_ffw_norm   1 + N(0, 0.1^2), stored as
                        is (the GGUF convention: llama.cpp's converter has already added
                        Gemma's +1, and the graph multiplies by the stored value)
    output_norm         16 (1 + N(0, 0.1^2)) tied (logits std ~4), else 1 + N(0, 0.1^2)
                        with output.weight N(0, (4/sqrt(n_embd))^2)
Norm vectors are F32; every matrix (token_embd included) takes `weight_type`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from tests.ggufgen.common import LOGIT_STD, TIED_EMBD, gain, normal
from tests.ggufgen.llama import LlamaSpec
from tests.ggufgen.quant import FILE_TYPES, WEIGHT_TYPES, write_tensors
from tests.ggufgen.vocab import write_vocab


@dataclass(frozen=True)
class Gemma3Spec:
    arch: str = "gemma3"                     # or "gemma2"
    n_vocab: int = 512
    n_embd: int = 128
    n_head: int = 4
    n_head_kv: int = 1
    head_dim: int = 64
    n_layer: int = 7
    n_ff: int = 256
    weight_type: str = "F16"
    window: int = 8                          # 0: no attention.sliding_window key
    rope_freq_base: float = 1e6
    rope_scaling_factor: float | None = None
    softcap: float | None = None             # final_logit_softcapping
    tied_output: bool = True
    eps: float = 1e-6
    seed: int = 0
    pooling_type: int | None = None          # gemma3.pooling_type (llama.py's LlamaSpec says what it is)
    attn_softcap: float | None = None        # gemma2: attn_logit_softcapping
    rope_scaling: str | None = None          # "yarn": with rope_scaling_factor and orig_ctx
    orig_ctx: int | None = None

    def check(self) -> "Gemma3Spec":
        if self.arch not in ("gemma3", "gemma2"):
            raise ValueError(f"arch {self.arch!r}")
        if self.weight_type not in WEIGHT_TYPES:
            raise ValueError(f"weight_type {self.weight_type!r}")
        if self.n_head % self.n_head_kv or self.head_dim % 2:
            raise ValueError("bad head counts")
        block = gguf.GGML_QUANT_SIZES[WEIGHT_TYPES[self.weight_type]][0]
        for cols in (self.n_embd, self.n_ff, self.n_head * self.head_dim):
            if cols % block:
                raise ValueError(f"row length {cols} is not a multiple of {self.weight_type}'s block {block}")
        return self


def make_gemma3_weights(spec: Gemma3Spec) -> dict[str, np.ndarray]:
    """Every tensor as float32 in numpy order ([rows, row length]), in file order."""
    spec = spec.check()
    e, hd, f = spec.n_embd, spec.head_dim, spec.n_ff
    normal_ = functools.partial(normal, spec)
    gain_ = functools.partial(gain, spec)
    w = {"token_embd.weight": normal_("token_embd.weight", (spec.n_vocab, e), TIED_EMBD / np.sqrt(e))}
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        w[p + "attn_norm.weight"] = gain_(p + "attn_norm.weight", e)
        qk_std = (1.0 if spec.arch == "gemma3" else 1.5) / np.sqrt(e)
        w[p + "attn_q.weight"] = normal_(p + "attn_q.weight", (spec.n_head * hd, e), qk_std)
        w[p + "attn_k.weight"] = normal_(p + "attn_k.weight", (spec.n_head_kv * hd, e), qk_std)
        w[p + "attn_v.weight"] = normal_(p + "attn_v.weight", (spec.n_head_kv * hd, e), 1 / np.sqrt(e))
        if spec.arch == "gemma3":
            w[p + "attn_q_norm.weight"] = gain_(p + "attn_q_norm.weight", hd, 1.5)
            w[p + "attn_k_norm.weight"] = gain_(p + "attn_k_norm.weight", hd, 1.5)
        w[p + "attn_output.weight"] = normal_(p + "attn_output.weight", (e, spec.n_head * hd),
                                             1 / np.sqrt(spec.n_head * hd))
        w[p + "post_attention_norm.weight"] = gain_(p + "post_attention_norm.weight", e)
        w[p + "ffn_norm.weight"] = gain_(p + "ffn_norm.weight", e)
        w[p + "ffn_gate.weight"] = normal_(p + "ffn_gate.weight", (f, e), 1 / np.sqrt(e))
        w[p + "ffn_up.weight"] = normal_(p + "ffn_up.weight", (f, e), 1 / np.sqrt(e))
        w[p + "ffn_down.weight"] = normal_(p + "ffn_down.weight", (e, f), 1 / np.sqrt(f))
        w[p + "post_ffw_norm.weight"] = gain_(p + "post_ffw_norm.weight", e)
    if spec.tied_output:
        w["output_norm.weight"] = gain_("output_norm.weight", e, LOGIT_STD / TIED_EMBD)
    else:
        w["output_norm.weight"] = gain_("output_norm.weight", e)
        w["output.weight"] = normal_("output.weight", (spec.n_vocab, e), LOGIT_STD / np.sqrt(e))
    return w


def write_gemma3(path: str | Path, **options) -> Path:
    """Write a synthetic gemma3 model (Gemma3Spec's fields as keywords) to `path`."""
    spec = Gemma3Spec(**options).check()
    return write_gemma3_weights(path, spec, make_gemma3_weights(spec))


def write_gemma3_weights(path: str | Path, spec: Gemma3Spec, weights: dict[str, np.ndarray]) -> Path:
    """Write `weights` (numpy order, float32) with the metadata and vocabulary of `spec`."""
    spec = spec.check()
    path = Path(path)
    qtype = WEIGHT_TYPES[spec.weight_type]
    writer = gguf.GGUFWriter(str(path), spec.arch)
    writer.add_name(f"synthetic-{spec.arch}-{spec.weight_type}-{spec.seed}")
    writer.add_file_type(FILE_TYPES[qtype])
    writer.add_context_length(4096)
    writer.add_embedding_length(spec.n_embd)
    writer.add_feed_forward_length(spec.n_ff)
    writer.add_block_count(spec.n_layer)
    writer.add_head_count(spec.n_head)
    writer.add_head_count_kv(spec.n_head_kv)
    writer.add_key_length(spec.head_dim)
    writer.add_value_length(spec.head_dim)
    writer.add_layer_norm_rms_eps(spec.eps)
    writer.add_rope_freq_base(spec.rope_freq_base)
    if spec.window:
        writer.add_sliding_window(spec.window)
    if spec.rope_scaling_factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType(spec.rope_scaling or "linear"))
        writer.add_rope_scaling_factor(spec.rope_scaling_factor)
    if spec.orig_ctx is not None:
        writer.add_rope_scaling_orig_ctx_len(spec.orig_ctx)
    if spec.softcap is not None:
        writer.add_final_logit_softcapping(spec.softcap)
    if spec.attn_softcap is not None:
        writer.add_attn_logit_softcapping(spec.attn_softcap)
    if spec.pooling_type is not None:
        writer.add_pooling_type(gguf.PoolingType(spec.pooling_type))
    write_vocab(writer, LlamaSpec(n_vocab=spec.n_vocab, vocab="spm", chat_template="").resolve())
    write_tensors(writer, weights, lambda name, value: Q.F32 if np.ndim(value) == 1 else qtype)
    return path
