"""Synthetic gpt-oss GGUF models (general.architecture "gpt-oss").

Owns: `GptOssSpec`, `make_gptoss_weights`, `write_gptoss_weights` and
`write_gptoss`: small, deterministic files laid out as llama.cpp's converter
writes OpenAI's gpt-oss-20b/120b (convert_hf_to_gguf.py's GptOss class) and
as src/models/openai-moe-iswa.cpp reads them; tests/engine/reference/gptoss.py
says what they compute.

What a file has (per layer blk.N.):
    attn_norm, post_attention_norm (the FFN's pre-norm, named so by the
        converter)                               F32 [n_embd]
    attn_q/k/v.weight + .bias, attn_output.weight + .bias (biases F32)
    attn_sinks.weight                            F32 [n_head]: a learned logit per head
    ffn_gate_inp.weight + .bias                  the router, F32 (never quantized)
    ffn_gate_exps, ffn_up_exps, ffn_down_exps .weight (expert_type, MXFP4 as the
        real files) + .bias (F32 [n_expert, rows])
and token_embd, output_norm, output (gpt-oss never ties).  Metadata: the
head counts, key/value_length (head_dim: n_head * head_dim need not be n_embd),
expert_count / expert_used_count / expert_feed_forward_length,
attention.sliding_window (llama.cpp: even layers slide, odd layers are full),
rope.scaling.type "yarn" with factor and original_context_length (the real
files: 32 over 4096).  general.file_type is MOSTLY_MXFP4_MOE when the experts
are MXFP4.

Shapes: n_embd, n_ff_exp, n_head * head_dim multiples of 32 (MXFP4 and Q8_0
blocks).  Weights (common.py's streams, scales as moe.py's):
    attn_q, attn_k N(0, (1.5/sqrt(n_embd))^2), attn_v N(0, 1/n_embd),
    attn_output N(0, 1/(n_head*head_dim)); q/k biases N(0, 0.5^2), v/o N(0, 0.1^2)
    attn_sinks N(1, 1): exp(sink) against the scores' sum: a sink takes a
        visible share of the attention (0.1-0.5 of it, more at early positions)
    router N(0, (4/sqrt(n_embd))^2), its bias N(0, 0.5^2)
    ffn_gate_exps, ffn_up_exps N(0, (3/sqrt(n_embd))^2): pre-activations of
        std ~3, so the clamp (swiglu_limit, 7 in llama.cpp) bites on a few %
        of them; their biases N(0, 1); ffn_down_exps N(0, 1/n_ff_exp), bias N(0, 0.1^2)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from tests.ggufgen.common import gain, normal, output_head, start_writer
from tests.ggufgen.quant import FILE_TYPES, WEIGHT_TYPES, write_tensors
from tests.ggufgen.vocab import CHATML_TEMPLATE, HARMONY_TEMPLATE, write_vocab

EXPERT_TYPES = {"MXFP4": Q.MXFP4} | WEIGHT_TYPES


@dataclass(frozen=True)
class GptOssSpec:
    arch: str = "gpt-oss"
    n_vocab: int = 320
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 32
    n_layer: int = 2
    n_expert: int = 8
    n_expert_used: int = 2
    n_ff_exp: int = 64
    window: int = 8                 # the real files: 128
    weight_type: str = "F16"        # every matrix but the experts and the router
    expert_type: str = "MXFP4"
    rope_freq_base: float = 150000.0
    yarn_factor: float | None = 4.0  # None: no rope.scaling keys (the real files: 32)
    orig_ctx: int = 16               # the real files: 4096
    eps: float = 1e-5
    seed: int = 0
    context_length: int = 4096
    vocab: str = "bpe"
    bpe_pre: str = "gpt-2"
    chat_template: str = CHATML_TEMPLATE
    tied_output: bool = False
    harmony: bool = False           # harmony's control tokens (vocab.HARMONY_TOKENS) and HARMONY_TEMPLATE

    def __post_init__(self):
        if self.harmony and self.chat_template == CHATML_TEMPLATE:
            object.__setattr__(self, "chat_template", HARMONY_TEMPLATE)

    def check(self) -> "GptOssSpec":
        if self.weight_type not in WEIGHT_TYPES or self.expert_type not in EXPERT_TYPES:
            raise ValueError(f"weight_type {self.weight_type!r} / expert_type {self.expert_type!r}")
        if self.n_head % self.n_head_kv or self.head_dim % 2:
            raise ValueError("bad head counts")
        for t in (self.weight_type, self.expert_type):
            block = gguf.GGML_QUANT_SIZES[EXPERT_TYPES[t]][0]
            for cols in (self.n_embd, self.n_ff_exp, self.n_head * self.head_dim):
                if cols % block:
                    raise ValueError(f"row length {cols} is not a multiple of {t}'s block {block}")
        return self

    @property
    def gguf_arch(self) -> str:
        return "gpt-oss"


def make_gptoss_weights(spec: GptOssSpec) -> dict[str, np.ndarray]:
    """Every tensor as float32 in numpy order (expert stacks [n_expert, rows, cols]), in file order."""
    spec = spec.check()
    e, hd, f, ne = spec.n_embd, spec.head_dim, spec.n_ff_exp, spec.n_expert
    qd, kd = spec.n_head * hd, spec.n_head_kv * hd
    w: dict[str, np.ndarray] = {"token_embd.weight": normal(spec, "token_embd.weight", (spec.n_vocab, e), 1.0)}
    for i in range(spec.n_layer):
        p = f"blk.{i}."

        def put(name: str, shape: tuple[int, ...], std: float, mean: float = 0.0) -> None:
            w[p + name] = normal(spec, p + name, shape, std) + np.float32(mean)

        w[p + "attn_norm.weight"] = gain(spec, p + "attn_norm.weight", e)
        put("attn_q.weight", (qd, e), 1.5 / np.sqrt(e))
        put("attn_q.bias", (qd,), 0.5)
        put("attn_k.weight", (kd, e), 1.5 / np.sqrt(e))
        put("attn_k.bias", (kd,), 0.5)
        put("attn_v.weight", (kd, e), 1 / np.sqrt(e))
        put("attn_v.bias", (kd,), 0.1)
        put("attn_output.weight", (e, qd), 1 / np.sqrt(qd))
        put("attn_output.bias", (e,), 0.1)
        put("attn_sinks.weight", (spec.n_head,), 1.0, 1.0)
        w[p + "post_attention_norm.weight"] = gain(spec, p + "post_attention_norm.weight", e)
        put("ffn_gate_inp.weight", (ne, e), 4 / np.sqrt(e))
        put("ffn_gate_inp.bias", (ne,), 0.5)
        put("ffn_gate_exps.weight", (ne, f, e), 3 / np.sqrt(e))
        put("ffn_gate_exps.bias", (ne, f), 1.0)
        put("ffn_up_exps.weight", (ne, f, e), 3 / np.sqrt(e))
        put("ffn_up_exps.bias", (ne, f), 1.0)
        put("ffn_down_exps.weight", (ne, e, f), 1 / np.sqrt(f))
        put("ffn_down_exps.bias", (ne, e), 0.1)
    return w | output_head(spec, e)


def write_gptoss_weights(path: str | Path, spec: GptOssSpec, weights: dict[str, np.ndarray]) -> Path:
    """Write `weights` (numpy order, float32) with spec's metadata and vocabulary."""
    spec = spec.check()
    path = Path(path)
    qtype, etype = WEIGHT_TYPES[spec.weight_type], EXPERT_TYPES[spec.expert_type]
    writer = start_writer(path, spec, spec.n_ff_exp)
    if etype == Q.MXFP4:   # what llama.cpp's converter declares for these files
        writer.kv_data[0].pop(gguf.Keys.General.FILE_TYPE)  # start_writer's, from weight_type
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_MXFP4_MOE)
    writer.add_key_length(spec.head_dim)
    writer.add_value_length(spec.head_dim)
    writer.add_expert_count(spec.n_expert)
    writer.add_expert_used_count(spec.n_expert_used)
    writer.add_expert_feed_forward_length(spec.n_ff_exp)
    writer.add_sliding_window(spec.window)
    if spec.yarn_factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(spec.yarn_factor)
        writer.add_rope_scaling_orig_ctx_len(spec.orig_ctx)
    writer.add_vocab_size(spec.n_vocab)
    write_vocab(writer, spec)

    def type_of(name: str, value: np.ndarray):
        if name.endswith(".bias") or np.ndim(value) == 1 or "ffn_gate_inp" in name:
            return Q.F32
        return etype if "_exps." in name else qtype

    write_tensors(writer, weights, type_of)
    return path


def write_gptoss(path: str | Path, **options) -> Path:
    """Write a synthetic gpt-oss model (GptOssSpec's fields as keywords) to `path`."""
    spec = GptOssSpec(**options).check()
    return write_gptoss_weights(path, spec, make_gptoss_weights(spec))
