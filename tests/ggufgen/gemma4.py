"""Synthetic gemma4 GGUF models (Gemma 4's dense text decoder, as llama.cpp's converter writes it).

Owns `write_gemma4` (and `Gemma4Spec`, `make_gemma4_weights`,
`write_gemma4_weights`): general.architecture "gemma4" with what the dense
Gemma 4 checkpoints (the 31B) carry, at test size:

  * a per-layer sliding pattern, `attention.sliding_window_pattern`, an array of
    bools (the converter's `layer_types == "sliding_attention"`); default
    (T, T, F, T, F): layers 2 and 4 global, the last layer global as in Gemma 4;
  * different geometry per kind of layer: sliding layers heads of key_length_swa
    (64) over n_head_kv_swa (2) KV heads, RoPE over rope.dimension_count_swa with
    base rope.freq_base_swa (1e4); global layers heads of key_length (128) over
    n_head_kv (1) KV heads (head_count_kv is written as a per-layer array), base
    rope.freq_base (1e6), rope.dimension_count = key_length and "proportional"
    RoPE: rope_freqs.weight [key_length / 2] with 1.0 for the first
    partial_rotary * key_length / 2 pairs and 1e30 (no rotation) for the rest;
  * global layers without attn_v (Gemma 4's attention_k_eq_v: V is K's projection);
  * blk.N.layer_output_scale.weight, a [1] scalar per layer (the HF layer_scalar);
  * final_logit_softcapping (15 here, small enough to bite; Gemma 4 ships 30);
  * the metadata the loader requires: shared_kv_layers and
    embedding_length_per_layer_input (0 for the dense 31B layout).

E2B / E4B (`shared_kv` > 0, `n_ple` > 0, `wide_shared`): the last `shared_kv`
layers share an earlier layer's K/V (they still carry attn_k / attn_v /
attn_k_norm, which nothing reads, as checkpoints do), per-layer embeddings of
`n_ple` (per_layer_token_embd [n_vocab, n_layer * n_ple], per_layer_model_proj,
per_layer_proj_norm; blk.N.inp_gate, blk.N.proj, blk.N.post_norm), and with
`wide_shared` the sharing layers' FFN twice as wide (feed_forward_length written
as one width per layer: use_double_wide_mlp).  E2B_SHAPE / E4B_SHAPE are the
conformance suite's shapes.

Norm weights are stored as the graph multiplies them (Gemma 4's converter
shifts nothing: norm_shift 0).  attn_q_norm / attn_k_norm gains are 0.4 because
Gemma 4 scales attention scores by 1 (not 1/sqrt(head_dim)): q.k of unit-RMS
heads times 0.16 has a std of 1.3-1.8, selective, not one-hot (with 0.5, std
2-3, llama.cpp's f16 rounding of K and the softmax weights grew to 0.04 in
log-probability on F32 weights against the float64 reference: 0.009 with 0.4).  The rest is
gemma3.py's scheme (common.py streams, token_embd N(0, (0.25/sqrt(n_embd))^2),
tied output) and tests/ggufgen/vocab.py's SentencePiece vocabulary.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from tests.ggufgen.common import LOGIT_STD, TIED_EMBD, gain, normal
from tests.ggufgen.quant import FILE_TYPES, WEIGHT_TYPES, write_tensors
from tests.ggufgen.vocab import write_vocab

NO_ROTATION = 1e30   # the converter's freq factor for the unrotated pairs of a proportional RoPE


@dataclass(frozen=True)
class Gemma4Spec:
    n_vocab: int = 512
    n_embd: int = 256
    n_head: int = 4
    swa_layers: tuple = (True, True, False, True, False)
    head_dim: int = 128            # global layers (key_length)
    n_head_kv: int = 1
    head_dim_swa: int = 64         # sliding layers (key_length_swa)
    n_head_kv_swa: int = 2
    n_rot_swa: int = 64
    partial_rotary: float = 0.25   # of the global layers' pairs, rotated
    k_eq_v: bool = True            # global layers have no attn_v
    layer_scale: bool = True       # blk.N.layer_output_scale.weight
    n_ff: int = 512
    weight_type: str = "F16"
    window: int = 8
    rope_freq_base: float = 1e6
    rope_freq_base_swa: float = 1e4
    softcap: float | None = 15.0
    tied_output: bool = True
    eps: float = 1e-6
    seed: int = 0
    chat_template: str = ""        # "": none (tests/ggufgen/vocab.py)
    vocab: str = "spm"             # or "gemma4": tokenizer.ggml.model "gemma4", as real Gemma 4 files
    shared_kv: int = 0             # attention.shared_kv_layers (E2B / E4B)
    n_ple: int = 0                 # embedding_length_per_layer_input (E2B / E4B)
    wide_shared: bool = False      # the KV-sharing layers' FFN 2 n_ff wide

    def ff(self, i: int) -> int:
        return 2 * self.n_ff if self.wide_shared and i >= self.n_layer - self.shared_kv else self.n_ff

    @property
    def n_layer(self) -> int:
        return len(self.swa_layers)

    def geometry(self, i: int) -> tuple[int, int]:
        """(head_dim, n_head_kv) of layer i."""
        return (self.head_dim_swa, self.n_head_kv_swa) if self.swa_layers[i] else (self.head_dim, self.n_head_kv)

    def check(self) -> "Gemma4Spec":
        if self.weight_type not in WEIGHT_TYPES:
            raise ValueError(f"weight_type {self.weight_type!r}")
        block = gguf.GGML_QUANT_SIZES[WEIGHT_TYPES[self.weight_type]][0]
        for i in range(self.n_layer):
            hd, kv = self.geometry(i)
            if self.n_head % kv or hd % 2 or (self.n_head * hd) % block:
                raise ValueError(f"layer {i}: {self.n_head} heads of {hd} over {kv} KV heads")
        if self.n_embd % block or self.n_ff % block or self.n_ple % block:
            raise ValueError(f"rows of {self.n_embd} / {self.n_ff}: not multiples of {self.weight_type}'s {block}")
        return self


def make_gemma4_weights(spec: Gemma4Spec) -> dict[str, np.ndarray]:
    """Every tensor as float32 in numpy order ([rows, row length]), in file order."""
    spec = spec.check()
    e, P = spec.n_embd, spec.n_ple
    normal_, gain_ = functools.partial(normal, spec), functools.partial(gain, spec)
    pairs = spec.head_dim // 2
    rotated = int(spec.head_dim * spec.partial_rotary / 2)
    w = {"rope_freqs.weight": np.array([1.0] * rotated + [NO_ROTATION] * (pairs - rotated), np.float32),
         "token_embd.weight": normal_("token_embd.weight", (spec.n_vocab, e), TIED_EMBD / np.sqrt(e))}
    if P:
        lp = spec.n_layer * P
        w["per_layer_token_embd.weight"] = normal_("per_layer_token_embd.weight", (spec.n_vocab, lp), 1 / np.sqrt(P))
        w["per_layer_model_proj.weight"] = normal_("per_layer_model_proj.weight", (lp, e), 1 / np.sqrt(e))
        w["per_layer_proj_norm.weight"] = gain_("per_layer_proj_norm.weight", P)
    for i in range(spec.n_layer):
        p, (hd, kv), f = f"blk.{i}.", spec.geometry(i), spec.ff(i)
        q = spec.n_head * hd
        w[p + "attn_norm.weight"] = gain_(p + "attn_norm.weight", e)
        w[p + "attn_q.weight"] = normal_(p + "attn_q.weight", (q, e), 1 / np.sqrt(e))
        w[p + "attn_k.weight"] = normal_(p + "attn_k.weight", (kv * hd, e), 1 / np.sqrt(e))
        if spec.swa_layers[i] or not spec.k_eq_v:
            w[p + "attn_v.weight"] = normal_(p + "attn_v.weight", (kv * hd, e), 1 / np.sqrt(e))
        w[p + "attn_q_norm.weight"] = gain_(p + "attn_q_norm.weight", hd, 0.4)
        w[p + "attn_k_norm.weight"] = gain_(p + "attn_k_norm.weight", hd, 0.4)
        w[p + "attn_output.weight"] = normal_(p + "attn_output.weight", (e, q), 1 / np.sqrt(q))
        w[p + "post_attention_norm.weight"] = gain_(p + "post_attention_norm.weight", e)
        w[p + "ffn_norm.weight"] = gain_(p + "ffn_norm.weight", e)
        w[p + "ffn_gate.weight"] = normal_(p + "ffn_gate.weight", (f, e), 1 / np.sqrt(e))
        w[p + "ffn_up.weight"] = normal_(p + "ffn_up.weight", (f, e), 1 / np.sqrt(e))
        w[p + "ffn_down.weight"] = normal_(p + "ffn_down.weight", (e, f), 1 / np.sqrt(f))
        w[p + "post_ffw_norm.weight"] = gain_(p + "post_ffw_norm.weight", e)
        if P:
            w[p + "inp_gate.weight"] = normal_(p + "inp_gate.weight", (P, e), 1 / np.sqrt(e))
            w[p + "proj.weight"] = normal_(p + "proj.weight", (e, P), 1 / np.sqrt(P))
            w[p + "post_norm.weight"] = gain_(p + "post_norm.weight", e, 0.5)
        if spec.layer_scale:
            w[p + "layer_output_scale.weight"] = gain_(p + "layer_output_scale.weight", 1, 0.7)
    if spec.tied_output:
        w["output_norm.weight"] = gain_("output_norm.weight", e, LOGIT_STD / TIED_EMBD)
    else:
        w["output_norm.weight"] = gain_("output_norm.weight", e)
        w["output.weight"] = normal_("output.weight", (spec.n_vocab, e), LOGIT_STD / np.sqrt(e))
    return w


def write_gemma4(path: str | Path, **options) -> Path:
    """Write a synthetic gemma4 model (Gemma4Spec's fields as keywords) to `path`."""
    spec = Gemma4Spec(**options).check()
    return write_gemma4_weights(path, spec, make_gemma4_weights(spec))


def write_gemma4_weights(path: str | Path, spec: Gemma4Spec, weights: dict[str, np.ndarray], *,
                         more_keys=None, type_of=None) -> Path:
    """Write `weights` (numpy order, float32) with the metadata and vocabulary of `spec`;
    more_keys(writer) adds keys (tests/ggufgen/gemma4_moe.py's experts), type_of(name, value,
    qtype) picks a tensor's type (default: F32 for 1-D tensors, else the weight type)."""
    spec = spec.check()
    path = Path(path)
    qtype = WEIGHT_TYPES[spec.weight_type]
    writer = gguf.GGUFWriter(str(path), "gemma4")
    writer.add_name(f"synthetic-gemma4-{spec.weight_type}-{spec.seed}")
    writer.add_file_type(FILE_TYPES[qtype])
    writer.add_context_length(4096)
    writer.add_embedding_length(spec.n_embd)
    ffs = [spec.ff(i) for i in range(spec.n_layer)]
    writer.add_feed_forward_length(ffs if len(set(ffs)) > 1 else spec.n_ff)
    writer.add_block_count(spec.n_layer)
    writer.add_head_count(spec.n_head)
    writer.add_head_count_kv([spec.geometry(i)[1] for i in range(spec.n_layer)])
    writer.add_key_length(spec.head_dim)
    writer.add_value_length(spec.head_dim)
    writer.add_key_length_swa(spec.head_dim_swa)
    writer.add_value_length_swa(spec.head_dim_swa)
    writer.add_rope_dimension_count(spec.head_dim)
    writer.add_rope_dimension_count_swa(spec.n_rot_swa)
    writer.add_layer_norm_rms_eps(spec.eps)
    writer.add_rope_freq_base(spec.rope_freq_base)
    writer.add_rope_freq_base_swa(spec.rope_freq_base_swa)
    writer.add_sliding_window(spec.window)
    writer.add_sliding_window_pattern(list(spec.swa_layers))
    writer.add_shared_kv_layers(spec.shared_kv)
    writer.add_embedding_length_per_layer_input(spec.n_ple)
    if spec.softcap is not None:
        writer.add_final_logit_softcapping(spec.softcap)
    if more_keys is not None:
        more_keys(writer)
    write_vocab(writer, SimpleNamespace(n_vocab=spec.n_vocab, vocab=spec.vocab, chat_template=spec.chat_template))
    type_of = type_of or (lambda name, value, qtype: Q.F32 if np.ndim(value) == 1 else qtype)
    write_tensors(writer, weights, lambda name, value: type_of(name, value, qtype))
    return path


# The conformance suite's E-model shapes (cases.py): E2B's (7 layers, the last 3 sharing K/V --
# layers 4 and 5 read sliding layer 2's, 6 global layer 3's -- their FFNs double-wide) and
# E4B's (8 layers, 2 sharing: 6 reads 4's, 7 reads 5's; one FFN width); per-layer embeddings of 256.
E2B_SHAPE = dict(swa_layers=(True, False, True, False, True, True, False), shared_kv=3, n_ple=256, wide_shared=True)
E4B_SHAPE = dict(swa_layers=(True, True, False, True, True, False, True, False), shared_kv=2, n_ple=256)
