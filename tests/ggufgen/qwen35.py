"""Synthetic Qwen3.5 (general.architecture "qwen35") GGUF models: Gated DeltaNet + gated attention.

Owns: `Qwen35Spec`, `make_qwen35_weights`, `write_qwen35_weights` and `write_qwen35`,
small deterministic qwen35 files with complete tokenizer metadata (the BPE vocabulary
and Qwen3's template of vocab.py) in any type of quant.py.  What the files compute:
tests/engine/reference/qwen35.py (from llama.cpp's src/models/qwen35.cpp).

n_expert > 0 writes qwen35moe (general.architecture "qwen35moe", llama_model_qwen35moe): the same
layers with every FFN a mixture of experts -- ffn_gate_inp [n_expert, n_embd] (F32, router logits'
std ~4 as moe.py's), ffn_{gate,up}_exps [n_expert, n_ff_exp, n_embd], ffn_down_exps, and the shared
expert ffn_{gate,up,down}_shexp with its gate ffn_gate_inp_shexp [n_embd]; expert_count,
expert_used_count, expert_feed_forward_length, expert_shared_feed_forward_length written.

Layout (as llama.cpp's loader, llama_model_qwen35::load_arch_tensors, wants it)
    layer i is linear attention (Gated DeltaNet) unless (i + 1) % full_attention_interval
    == 0 (then gated full attention); every layer has attn_norm, post_attention_norm
    (the FFN's input norm) and a dense SwiGLU FFN.
    DeltaNet layer: attn_qkv [2 H_k S + H_v S, n_embd] (rows q, k, v), attn_gate (z)
      [H_v S, n_embd], ssm_conv1d [conv channels, d_conv] (F32: rows of d_conv), ssm_dt.bias
      [H_v], ssm_a [H_v] (= -exp(A_log), negative), ssm_alpha / ssm_beta [H_v, n_embd],
      ssm_norm [S], ssm_out [n_embd, H_v S].  H_k = ssm.group_count, H_v =
      ssm.time_step_rank, S = ssm.state_size (key and value head size), ssm.inner_size
      = H_v S, ssm.conv_kernel = d_conv.
    attention layer: attn_q [n_head 2 hd, n_embd] (per head hd query rows, then hd gate
      rows), attn_k / attn_v [n_head_kv hd, n_embd], attn_q_norm / attn_k_norm [hd],
      attn_output [n_embd, n_head hd].  rope.dimension_sections (required by llama.cpp)
      is SECTIONS: with text positions every section rotates by the same position, so
      M-RoPE is NeoX RoPE over rope.dimension_count dimensions.
Weights (one random stream per tensor, common.py): matrices N(0, 1/n_in) (attn_q/k
N(0, 1/n_embd) with QK-norm gains 1.5 as llama.py's qwen3), ssm_conv1d N(0, 0.5^2)
(4 taps of O(1) inputs: O(1) outputs), ssm_alpha N(0, (0.5/sqrt(n_embd))^2), ssm_dt.bias
N(0, 0.5^2), ssm_a = -exp(U(ln 0.02, ln 0.2)): the decay exp(softplus(.) a) is ~0.9-0.99
a step, so the state remembers tens of tokens (the suite's prompts cross llama.cpp's
delta-rule chunk of 64), ssm_beta N(0, 1/n_embd) (beta = sigmoid ~0.3-0.7), norms 1 +
N(0, 0.1^2), the output head as common.output_head.  Types: every matrix whose rows are
a multiple of the type's block takes weight_type; ssm_conv1d and 1-D tensors are F32.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from tests.ggufgen.common import TIED_EMBD, gain, normal, output_head, rng, start_writer
from tests.ggufgen.quant import WEIGHT_TYPES, write_tensors
from tests.ggufgen.vocab import QWEN3_TEMPLATE, write_vocab

SECTIONS = (6, 5, 5, 0)
QK_NORM_GAIN = 1.5


@dataclass(frozen=True)
class Qwen35Spec:
    arch: str = "qwen35"
    n_vocab: int = 512
    n_embd: int = 256
    n_ff: int = 512
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 64
    n_rot: int = 32
    n_layer: int = 4
    full_attention_interval: int = 2
    d_conv: int = 4
    state_size: int = 64      # S: key and value head size of the DeltaNet
    n_k_heads: int = 2        # H_k (ssm.group_count)
    n_v_heads: int = 4        # H_v (ssm.time_step_rank)
    weight_type: str = "F16"
    tied_output: bool = False
    seed: int = 0
    eps: float = 1e-6
    rope_freq_base: float = 1e7
    context_length: int = 4096
    vocab: str = "bpe"
    bpe_pre: str = "gpt-2"
    chat_template: str = QWEN3_TEMPLATE
    head_type: str | None = None  # token_embd / output.weight's type (None: weight_type)
    n_expert: int = 0             # > 0: qwen35moe, every FFN routed (n_expert_used of them) + a shared expert
    n_expert_used: int = 2
    n_ff_exp: int = 256
    n_ff_shexp: int = 256

    @property
    def gguf_arch(self) -> str:
        return "qwen35moe" if self.n_expert else self.arch

    @property
    def rot(self) -> int:
        return self.n_rot

    def recurrent(self, i: int) -> bool:
        return (i + 1) % self.full_attention_interval != 0

    def resolve(self) -> "Qwen35Spec":
        if self.weight_type not in WEIGHT_TYPES:
            raise ValueError(f"weight_type {self.weight_type!r}: expected one of {', '.join(WEIGHT_TYPES)}")
        if self.n_v_heads % self.n_k_heads or self.n_head % self.n_head_kv:
            raise ValueError("n_v_heads must be a multiple of n_k_heads, n_head of n_head_kv")
        if 2 * sum(SECTIONS) != self.n_rot:
            raise ValueError(f"n_rot {self.n_rot} must be twice the sections' sum {sum(SECTIONS)}")
        return self


def make_qwen35_weights(spec: Qwen35Spec) -> dict[str, np.ndarray]:
    """Every tensor as float32 in numpy order, in file order."""
    spec = spec.resolve()
    e, hd, f, s = spec.n_embd, spec.head_dim, spec.n_ff, spec.state_size
    key_dim, value_dim = spec.n_k_heads * s, spec.n_v_heads * s
    embd_std = TIED_EMBD / np.sqrt(e) if spec.tied_output else 1.0
    w = {"token_embd.weight": normal(spec, "token_embd.weight", (spec.n_vocab, e), embd_std)}
    inv = 1 / np.sqrt(e)
    for i in range(spec.n_layer):
        p = f"blk.{i}."

        def mat(name, rows, cols, std):
            w[p + name] = normal(spec, p + name, (rows, cols), std)
        w[p + "attn_norm.weight"] = gain(spec, p + "attn_norm.weight", e)
        if spec.recurrent(i):
            mat("attn_qkv.weight", 2 * key_dim + value_dim, e, inv)
            mat("attn_gate.weight", value_dim, e, inv)
            mat("ssm_conv1d.weight", 2 * key_dim + value_dim, spec.d_conv, 0.5)
            w[p + "ssm_dt.bias"] = normal(spec, p + "ssm_dt.bias", (spec.n_v_heads,), 0.5)
            log_a = rng(spec.seed, p + "ssm_a").uniform(np.log(0.02), np.log(0.2), spec.n_v_heads)
            w[p + "ssm_a"] = (-np.exp(log_a)).astype(np.float32)
            mat("ssm_alpha.weight", spec.n_v_heads, e, 0.5 * inv)
            mat("ssm_beta.weight", spec.n_v_heads, e, inv)
            w[p + "ssm_norm.weight"] = gain(spec, p + "ssm_norm.weight", s)
            mat("ssm_out.weight", e, value_dim, 1 / np.sqrt(value_dim))
        else:
            mat("attn_q.weight", spec.n_head * hd * 2, e, inv)
            w[p + "attn_q_norm.weight"] = gain(spec, p + "attn_q_norm.weight", hd, QK_NORM_GAIN)
            mat("attn_k.weight", spec.n_head_kv * hd, e, inv)
            w[p + "attn_k_norm.weight"] = gain(spec, p + "attn_k_norm.weight", hd, QK_NORM_GAIN)
            mat("attn_v.weight", spec.n_head_kv * hd, e, inv)
            mat("attn_output.weight", e, spec.n_head * hd, 1 / np.sqrt(spec.n_head * hd))
        w[p + "post_attention_norm.weight"] = gain(spec, p + "post_attention_norm.weight", e)
        if spec.n_expert:   # scales as moe.py's (router logits' std ~4)
            ne, fe, fs = spec.n_expert, spec.n_ff_exp, spec.n_ff_shexp
            mat("ffn_gate_inp.weight", ne, e, 4.0 * inv)
            w[p + "ffn_gate_exps.weight"] = normal(spec, p + "ffn_gate_exps.weight", (ne, fe, e), inv)
            w[p + "ffn_up_exps.weight"] = normal(spec, p + "ffn_up_exps.weight", (ne, fe, e), inv)
            w[p + "ffn_down_exps.weight"] = normal(spec, p + "ffn_down_exps.weight", (ne, e, fe), 1 / np.sqrt(fe))
            w[p + "ffn_gate_inp_shexp.weight"] = normal(spec, p + "ffn_gate_inp_shexp.weight", (e,), inv)
            mat("ffn_gate_shexp.weight", fs, e, inv)
            mat("ffn_up_shexp.weight", fs, e, inv)
            mat("ffn_down_shexp.weight", e, fs, 1 / np.sqrt(fs))
            continue
        mat("ffn_gate.weight", f, e, inv)
        mat("ffn_up.weight", f, e, inv)
        mat("ffn_down.weight", e, f, 1 / np.sqrt(f))
    return w | output_head(spec, e)


def write_qwen35_weights(path: str | Path, spec: Qwen35Spec, weights: dict[str, np.ndarray]) -> Path:
    """Write `weights` with spec's metadata and vocabulary (see the header for types)."""
    spec = spec.resolve()
    path = Path(path)
    qtype = WEIGHT_TYPES[spec.weight_type]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    writer = start_writer(path, spec, spec.n_ff)
    writer.add_key_length(spec.head_dim)
    writer.add_value_length(spec.head_dim)
    writer.add_rope_dimension_sections(list(SECTIONS))
    writer.add_full_attention_interval(spec.full_attention_interval)
    writer.add_ssm_conv_kernel(spec.d_conv)
    writer.add_ssm_state_size(spec.state_size)
    writer.add_ssm_group_count(spec.n_k_heads)
    writer.add_ssm_time_step_rank(spec.n_v_heads)
    writer.add_ssm_inner_size(spec.n_v_heads * spec.state_size)
    if spec.n_expert:
        writer.add_expert_count(spec.n_expert)
        writer.add_expert_used_count(spec.n_expert_used)
        writer.add_expert_feed_forward_length(spec.n_ff_exp)
        writer.add_expert_shared_feed_forward_length(spec.n_ff_shexp)
    writer.add_vocab_size(spec.n_vocab)
    write_vocab(writer, spec)

    def type_of(name: str, value: np.ndarray):
        if spec.head_type is not None and name in ("token_embd.weight", "output.weight"):
            return WEIGHT_TYPES[spec.head_type]
        if np.ndim(value) < 2 or "ssm_conv1d" in name or "ffn_gate_inp" in name or value.shape[-1] % block:
            return Q.F32     # llama.cpp's ssm_conv wants an f32 kernel
        return qtype
    write_tensors(writer, weights, type_of)
    return path


def write_qwen35(path: str | Path, **fields) -> Path:
    """Write a synthetic qwen35 model (Qwen35Spec's fields) to `path`; same arguments, same bytes."""
    spec = Qwen35Spec(**fields)
    return write_qwen35_weights(path, spec, make_qwen35_weights(spec))


__all__ = ["Qwen35Spec", "SECTIONS", "make_qwen35_weights", "write_qwen35", "write_qwen35_weights"]
