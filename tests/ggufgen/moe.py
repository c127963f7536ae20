"""Synthetic mixture-of-experts GGUF models for the engine's MoE tests.

Owns: `write_moe` (and `MoESpec`, `make_moe_weights`, `write_moe_weights`), which
writes small, deterministic qwen3moe, qwen2moe and mixtral-style models with
complete tokenizer metadata, in any type of quant.py (K-quants with rows of 256).  The
vocabularies, chat templates and random streams are the package's (vocab.py,
common.py): the same seed gives the same tokenizer as a
dense model.  Nothing is committed as a binary; a default model is ~0.8 MB in
F16 and takes well under 0.1 s to write.  tests/engine/reference/moe.py says what the
files compute.

Architectures
    qwen3moe  general.architecture "qwen3moe": NeoX RoPE, attn_q_norm/attn_k_norm,
              no biases, top-k weights renormalized, rope base 1e6, eps 1e-6,
              BPE vocabulary with ChatML; writes attention.key_length/value_length
              (head_dim may differ from n_embd / n_head, as in Qwen3-30B-A3B) and
              expert_feed_forward_length.
    qwen2moe  general.architecture "qwen2moe": NeoX RoPE, q/k/v biases, top-k weights
              NOT renormalized, a shared expert (ffn_{gate,up,down}_shexp, n_ff_shexp,
              gated by sigmoid(ffn_gate_inp_shexp . h)); rope base 1e6, eps 1e-6, BPE;
              writes expert_feed_forward_length and expert_shared_feed_forward_length;
              always an output.weight (llama.cpp requires one for qwen2moe).
    mixtral   general.architecture "llama" with llama.expert_count: normal RoPE, GQA,
              no biases, renormalized top-k, rope base 1e6, eps 1e-5, SentencePiece
              vocabulary and Mistral's template; the experts' n_ff is written as
              llama.feed_forward_length (as llama.cpp's converter writes Mixtral).
  `vocab=` overrides the vocabulary ("spm" or "bpe"; the template follows it).

Sizes: n_vocab defaults to 320, not 256: vocab.py's SentencePiece vocabulary
needs at least 305 tokens (259 fixed + CORPUS's characters) and the BPE one 259.
n_embd, n_ff_exp and n_ff_shexp must be multiples of the weight type's block (32
for Q8_0/Q4_0).

Weights (numpy's default_rng, one stream per tensor seeded by (seed, crc32(name)),
as llama.py; scales as llama.py's so that activations stay O(1)):
    token_embd               N(0, 1)                        (tied_output: see llama.py)
    attn_q, attn_k           N(0, (1.5/sqrt(n_embd))^2)  (qwen3moe: N(0, 1/n_embd), the
                                                          QK-norm sets the scale instead)
    attn_v                   N(0, 1/n_embd);  attn_output N(0, 1/(n_head*head_dim))
    q/k/v biases (qwen2moe)  N(0, 0.5^2), N(0, 0.5^2), N(0, 0.1^2)
    attn_q_norm, attn_k_norm (qwen3moe)  QK_NORM_GAIN * (1 + N(0, 0.1^2)), QK_NORM_GAIN = 1.5:
                             after the norm each head has |q| ~ |k| ~ 1.5 sqrt(head_dim),
                             so q.k/sqrt(head_dim) has std ~1.5^2, as in llama.py
    ffn_gate_exps, ffn_up_exps   N(0, 1/n_embd); ffn_down_exps N(0, 1/n_ff_exp)
                             (every expert its own slab of one stream)
    ffn_{gate,up}_shexp      N(0, 1/n_embd); ffn_down_shexp N(0, 1/n_ff_shexp)
    ffn_gate_inp_shexp       N(0, 1/n_embd): the gate's logit has std ~1, sigmoid ~0.3..0.7
    ffn_gate_inp (router)    N(0, (ROUTER_STD/sqrt(n_embd))^2), ROUTER_STD = 4: router
                             logits have a std of ~4 (h = the ffn_norm output has
                             |h| ~ sqrt(n_embd)).  Measured on 1200 routes of random
                             prompts per default model: the margin between the k-th and
                             the (k+1)-th logit has a median of ~1.2; 2-4% of routes are
                             below 0.05, 0.2-1% below 0.01; the second of two experts
                             gets a median 13% of the weight (10th percentile 0.5%); the
                             tokens of a prompt use all 8 experts.  A larger std would
                             make ties rarer only by making the top expert dominate.
    norms                    1 + N(0, 0.1^2); output N(0, (4/sqrt(n_embd))^2) (logits' std ~4)
  Types: every matrix takes `weight_type` (expert slabs included) EXCEPT the router,
  always F32 -- llama.cpp's llama-quantize never quantizes ffn_gate_inp, and a
  quantized router would move routing margins for no benefit; 1-D tensors
  (norms, biases, ffn_gate_inp_shexp) are F32 as in llama.cpp conversions.

Near-ties: a linear router cannot exclude a tie for every possible input, and
the rates above mean that a prompt of a dozen tokens has a near-tie (< 0.05)
in one of its 36 routes about two times in three.  ReferenceMoE reports every
route's margin (`last_routes[l].margin`, `min_route_margin(tokens)`), and
reference.moe.well_routed_prompt(model, length) finds, deterministically, a
prompt whose routes are all decided by >= 0.05, far above an f32 engine's
error in router logits (~1e-3): an engine test should compare logits on such
prompts, or check the margin of the prompt it uses.  Exact ties do not occur
(continuous random weights) except where a test builds them (equal routers).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from tests.ggufgen.common import TIED_EMBD, gain, normal, output_head, start_writer
from tests.ggufgen.quant import WEIGHT_TYPES, write_tensors
from tests.ggufgen.vocab import CHATML_TEMPLATE, MISTRAL_TEMPLATE, write_vocab

ROUTER_STD = 4.0
QK_NORM_GAIN = 1.5
# The types test_reference_moe checks at the default sizes (Q5_0: a type the native host
# matvec leaves to gguf.quants).  write_moe takes every type of quant.WEIGHT_TYPES
# (K-quants need n_embd, n_ff_exp, n_ff_shexp and n_head*head_dim multiples of 256).
MOE_WEIGHT_TYPES = {"F32": Q.F32, "F16": Q.F16, "BF16": Q.BF16, "Q8_0": Q.Q8_0, "Q4_0": Q.Q4_0,
                    "Q5_0": Q.Q5_0}

# arch -> (general.architecture, rope base, eps, vocabulary, q/k/v biases, chat template)
_MOE_STYLES = {
    "qwen3moe": ("qwen3moe", 1e6, 1e-6, "bpe", False),
    "qwen2moe": ("qwen2moe", 1e6, 1e-6, "bpe", True),
    "mixtral": ("llama", 1e6, 1e-5, "spm", False),
}


@dataclass(frozen=True)
class MoESpec:
    """Everything write_moe is told (field names follow llama.LlamaSpec where they
    mean the same, so vocab.write_vocab can read it)."""

    arch: str = "qwen3moe"
    n_vocab: int = 320
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_layer: int = 3
    n_expert: int = 8
    n_expert_used: int = 2
    n_ff_exp: int = 64
    n_ff_shexp: int = 64
    head_dim: int | None = None         # None: n_embd // n_head (qwen2moe must keep that)
    weight_type: str = "F16"
    vocab: str | None = None
    seed: int = 0
    tied_output: bool = False
    context_length: int = 4096
    bpe_pre: str = "gpt-2"
    chat_template: str | None = None
    rope_freq_base: float | None = None
    eps: float | None = None

    def resolve(self) -> "MoESpec":
        if self.arch not in _MOE_STYLES:
            raise ValueError(f"arch {self.arch!r}: expected one of {', '.join(_MOE_STYLES)}")
        _, base, eps, vocab, _ = _MOE_STYLES[self.arch]
        vocab = self.vocab or vocab
        spec = replace(self, vocab=vocab,
                       head_dim=self.head_dim or self.n_embd // self.n_head,
                       rope_freq_base=base if self.rope_freq_base is None else self.rope_freq_base,
                       eps=eps if self.eps is None else self.eps,
                       chat_template=(self.chat_template if self.chat_template is not None else
                                      CHATML_TEMPLATE if vocab == "bpe" else MISTRAL_TEMPLATE))
        if spec.weight_type not in WEIGHT_TYPES:
            raise ValueError(f"weight_type {spec.weight_type!r}: expected one of "
                             f"{', '.join(WEIGHT_TYPES)}")
        if spec.vocab not in ("spm", "bpe"):
            raise ValueError(f"vocab {spec.vocab!r}: expected 'spm' or 'bpe'")
        if spec.head_dim % 2:
            raise ValueError(f"head_dim {spec.head_dim} must be even (RoPE pairs)")
        if self.arch == "qwen2moe" and spec.head_dim * spec.n_head != spec.n_embd:
            raise ValueError("qwen2moe: llama.cpp fixes attn_q to n_embd rows, so head_dim "
                             "must be n_embd / n_head")
        if spec.n_head % spec.n_head_kv:
            raise ValueError(f"n_head {spec.n_head} is not a multiple of n_head_kv {spec.n_head_kv}")
        if not 1 <= spec.n_expert_used <= spec.n_expert:
            raise ValueError(f"n_expert_used {spec.n_expert_used} outside 1..{spec.n_expert}")
        if self.arch == "qwen2moe" and self.tied_output:
            raise ValueError("qwen2moe: llama.cpp requires output.weight (no tied output)")
        block = gguf.GGML_QUANT_SIZES[WEIGHT_TYPES[spec.weight_type]][0]
        cols = [("n_embd", spec.n_embd), ("n_ff_exp", spec.n_ff_exp),
                ("n_head*head_dim", spec.n_head * spec.head_dim)]
        if self.arch == "qwen2moe":
            cols.append(("n_ff_shexp", spec.n_ff_shexp))
        for name, n in cols:
            if n % block:
                raise ValueError(f"{name} {n} is not a multiple of {spec.weight_type}'s block {block}")
        return spec

    @property
    def gguf_arch(self) -> str:
        return _MOE_STYLES[self.arch][0]


def make_moe_weights(spec: MoESpec) -> dict[str, np.ndarray]:
    """Every tensor as float32 in numpy order (expert stacks [n_expert, rows, row
    length]), in file order: token_embd, the blocks, output_norm, output."""
    spec = spec.resolve()
    e, hd, f, fs, ne = spec.n_embd, spec.head_dim, spec.n_ff_exp, spec.n_ff_shexp, spec.n_expert
    qk = spec.arch == "qwen3moe"
    qk_std = (1.0 if qk else 1.5) / np.sqrt(e)
    embd_std = TIED_EMBD / np.sqrt(e) if spec.tied_output else 1.0
    w: dict[str, np.ndarray] = {"token_embd.weight": normal(spec, "token_embd.weight",
                                                             (spec.n_vocab, e), embd_std)}
    for i in range(spec.n_layer):
        p = f"blk.{i}."

        def put(name: str, shape: tuple[int, ...], std: float) -> None:
            w[p + name] = normal(spec, p + name, shape, std)

        w[p + "attn_norm.weight"] = gain(spec, p + "attn_norm.weight", e)
        put("attn_q.weight", (spec.n_head * hd, e), qk_std)
        put("attn_k.weight", (spec.n_head_kv * hd, e), qk_std)
        put("attn_v.weight", (spec.n_head_kv * hd, e), 1 / np.sqrt(e))
        if _MOE_STYLES[spec.arch][4]:
            put("attn_q.bias", (spec.n_head * hd,), 0.5)
            put("attn_k.bias", (spec.n_head_kv * hd,), 0.5)
            put("attn_v.bias", (spec.n_head_kv * hd,), 0.1)
        if qk:
            w[p + "attn_q_norm.weight"] = gain(spec, p + "attn_q_norm.weight", hd, QK_NORM_GAIN)
            w[p + "attn_k_norm.weight"] = gain(spec, p + "attn_k_norm.weight", hd, QK_NORM_GAIN)
        put("attn_output.weight", (e, spec.n_head * hd), 1 / np.sqrt(spec.n_head * hd))
        w[p + "ffn_norm.weight"] = gain(spec, p + "ffn_norm.weight", e)
        put("ffn_gate_inp.weight", (ne, e), ROUTER_STD / np.sqrt(e))
        put("ffn_gate_exps.weight", (ne, f, e), 1 / np.sqrt(e))
        put("ffn_up_exps.weight", (ne, f, e), 1 / np.sqrt(e))
        put("ffn_down_exps.weight", (ne, e, f), 1 / np.sqrt(f))
        if spec.arch == "qwen2moe":
            put("ffn_gate_inp_shexp.weight", (e,), 1 / np.sqrt(e))
            put("ffn_gate_shexp.weight", (fs, e), 1 / np.sqrt(e))
            put("ffn_up_shexp.weight", (fs, e), 1 / np.sqrt(e))
            put("ffn_down_shexp.weight", (e, fs), 1 / np.sqrt(fs))
    return w | output_head(spec, e)


def write_moe_weights(path: str | Path, spec: MoESpec, weights: dict[str, np.ndarray]) -> Path:
    """Write `weights` (numpy order, float32) with the metadata and vocabulary of
    `spec`: matrices and expert stacks in spec.weight_type, ffn_gate_inp and 1-D
    tensors in F32.  Tests use it to write edited weights (equal routers, ...)."""
    spec = spec.resolve()
    path = Path(path)
    qtype = WEIGHT_TYPES[spec.weight_type]
    writer = start_writer(path, spec, None)
    writer.add_expert_count(spec.n_expert)
    writer.add_expert_used_count(spec.n_expert_used)
    if spec.arch == "mixtral":
        writer.add_feed_forward_length(spec.n_ff_exp)       # Mixtral: the experts' n_ff
    else:
        # Qwen conversions write the dense n_ff too; llama.cpp reads it but the MoE
        # graphs use expert_feed_forward_length.
        writer.add_feed_forward_length(spec.n_ff_exp * spec.n_expert_used)
        writer.add_expert_feed_forward_length(spec.n_ff_exp)
    if spec.arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(spec.n_ff_shexp)
    if spec.arch == "qwen3moe":
        writer.add_key_length(spec.head_dim)
        writer.add_value_length(spec.head_dim)
    writer.add_vocab_size(spec.n_vocab)
    write_vocab(writer, spec)
    write_tensors(writer, weights, lambda name, value: Q.F32 if np.ndim(value) == 1
                  or name.endswith("ffn_gate_inp.weight") else qtype)
    return path


def write_moe(path: str | Path, *, arch: str = "qwen3moe", n_vocab: int = 320, n_embd: int = 64,
              n_head: int = 4, n_head_kv: int = 2, n_layer: int = 3, n_expert: int = 8,
              n_expert_used: int = 2, n_ff_exp: int = 64, n_ff_shexp: int = 64,
              weight_type: str = "F16", seed: int = 0, vocab: str | None = None, **more) -> Path:
    """Write a synthetic MoE model to `path` and return the path.  Same arguments,
    same bytes.  `more` takes MoESpec's other fields (head_dim, tied_output,
    context_length, bpe_pre, chat_template, rope_freq_base, eps).  n_ff_shexp
    is used by qwen2moe only."""
    spec = MoESpec(arch=arch, n_vocab=n_vocab, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
                   n_layer=n_layer, n_expert=n_expert, n_expert_used=n_expert_used,
                   n_ff_exp=n_ff_exp, n_ff_shexp=n_ff_shexp, weight_type=weight_type, seed=seed,
                   vocab=vocab, **more)
    return write_moe_weights(path, spec, make_moe_weights(spec))
