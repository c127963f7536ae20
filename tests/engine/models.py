"""Synthetic llama-family GGUF models for the engine's tests.

Owns: `write_llama` (and the pieces it is made of: `LlamaSpec`, `make_weights`,
`write_weights`, `make_vocab`, `quantize_k`), which writes small, deterministic
llama / mistral-style / qwen2 models with complete tokenizer metadata, in F32,
F16, BF16, Q8_0 or Q4_0 (the engine's types), or Q4_1, Q5_0, Q5_1, Q4_K, Q6_K;
and `LLAMA_CPP_TOKENIZATIONS`, llama.cpp's tokenizations of a few texts with
these vocabularies.  Nothing is committed as a binary: tests write the files
they need (a default model is ~0.9 MB in F16, ~0.25 MB in Q4_0, ~0.1 s to write).

Architectures ("arch" here is a style; general.architecture is what is written)
    llama    general.architecture "llama", n_head_kv = n_head, rope base 1e4,
             SentencePiece vocabulary, Llama-2 [INST]/<<SYS>> chat template.
    mistral  general.architecture "llama" (as llama.cpp converts Mistral 7B),
             GQA n_head_kv = n_head / 4 (at least 1), rope base 1e6, SentencePiece
             vocabulary, Mistral [INST] chat template.
    qwen2    general.architecture "qwen2" (NeoX RoPE), GQA n_head_kv = n_head / 2,
             q/k/v biases, rope base 1e6, eps 1e-6, GPT-2 BPE vocabulary with
             ChatML specials and template, no BOS added.
  Every default can be overridden (n_head_kv, with_bias, vocab, rope_freq_base...).

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
  Q4_K and Q6_K with quantize_k (what a test compares against is always the
  dequantized file, never the float values).  Norm weights and biases are F32,
  as in llama.cpp conversions; every matrix, token_embd and output included,
  takes `weight_type`.

Vocabularies (built from CORPUS, a few hundred words of plain English, by a
small deterministic BPE trainer):
    spm   tokenizer.ggml.model "llama": <unk>=0 (UNKNOWN), <s>=1 and </s>=2
          (CONTROL), <0x00>..<0xFF> = 3..258 (BYTE), then the learned pieces
          (NORMAL, "▁" for a space) by descending score (score = -rank), then the
          corpus's single characters (lowest scores).  Every learned piece is
          the concatenation of two pieces that rank before it (or of single
          characters), so SentencePiece's score-driven merging reaches it;
          characters outside the corpus go through byte fallback.
          add_bos_token true, add_space_prefix true.
    bpe   tokenizer.ggml.model "gpt2", pre "gpt-2" (override with bpe_pre=): the
          256 byte tokens in GPT-2's byte-to-unicode alphabet, id = byte value,
          then one token per learned merge (tokenizer.ggml.merges "a b"), then
          <|endoftext|> (BOS), <|im_start|>, <|im_end|> (EOS) as CONTROL tokens.
          add_bos_token false.
  llama.cpp loads and tokenizes both (see LLAMA_CPP_TOKENIZATIONS), and the three
  chat templates render with jinja2 (checked by hand; jinja2 is not a dependency).
"""

from __future__ import annotations

import re
import zlib
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

LOGIT_STD = 4.0
TIED_EMBD = 0.25

# The types issue 5's engine runs, then more for the next issue's work: Q4_1, Q5_0
# and Q5_1 quantized by gguf.quants, Q4_K, Q5_K and Q6_K by quantize_k() below (gguf
# has no quantizer for them).  K-quants need n_embd and n_ff multiples of 256.
WEIGHT_TYPES = {"F32": Q.F32, "F16": Q.F16, "BF16": Q.BF16, "Q8_0": Q.Q8_0, "Q4_0": Q.Q4_0,
                "Q4_1": Q.Q4_1, "Q5_0": Q.Q5_0, "Q5_1": Q.Q5_1, "Q4_K": Q.Q4_K, "Q5_K": Q.Q5_K,
                "Q6_K": Q.Q6_K}
ENGINE_WEIGHT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0")
_FT = gguf.LlamaFileType
_FILE_TYPES = {Q.F32: _FT.ALL_F32, Q.F16: _FT.MOSTLY_F16, Q.BF16: _FT.MOSTLY_BF16,
               Q.Q8_0: _FT.MOSTLY_Q8_0, Q.Q4_0: _FT.MOSTLY_Q4_0, Q.Q4_1: _FT.MOSTLY_Q4_1,
               Q.Q5_0: _FT.MOSTLY_Q5_0, Q.Q5_1: _FT.MOSTLY_Q5_1, Q.Q4_K: _FT.MOSTLY_Q4_K_S,
               Q.Q5_K: _FT.MOSTLY_Q5_K_S, Q.Q6_K: _FT.MOSTLY_Q6_K}

# token types (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

CORPUS = """\
The river ran past the old mill, and the miller sat by the door to watch the water.
Every morning he counted the sacks of grain, and every evening he counted them again.
When the rain came in the spring, the wheel turned faster and the whole house sang.
His daughter kept the books; she wrote the numbers in a clean, careful hand: 12 sacks
on Monday, 30 on Tuesday, 7 on the day the bridge was closed. She liked the numbers
because they did not change when you looked away from them.
In the summer the travellers came down the road with carts and questions. Where is the
market? How far to the sea? Is the water good to drink? The miller answered them all,
and his daughter listened, and later she drew a map of the valley on the back of a
ledger: the road, the river, the forest to the north, the hills to the east, and the
small stone church where the road turned west towards the coast.
Years later the map was still on the wall. The paper was brown and the ink was faded,
but you could read every name. A visitor from the city asked if he could buy it. "It is
not for sale," she said, "but you may copy it, if you are careful with the corners."
He copied it that afternoon, slowly, line by line, while the wheel turned and the water
went on past the mill as it always had. Then he thanked her, paid for his bread, and
walked on towards the coast, where the road ends and the boats begin.
Some say the café by the harbour still keeps a copy of that map; others say it was a
different map, drawn by someone else, for a different valley. Nobody knows for certain,
and nobody minds very much. The river does not care who draws it; it only runs.
"""

LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' }}"
    "{% if loop.first and system %}{{ '<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' }}{% endif %}"
    "{{ message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + ' ' + eos_token }}"
    "{% endif %}{% endfor %}")
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% elif message['role'] == 'system' %}{{ message['content'] + '\\n\\n' }}"
    "{% endif %}{% endfor %}")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

# Qwen3's own template (the "chat_template" of Qwen/Qwen3-0.6B's tokenizer_config.json,
# with its enable_thinking switch), kept as a data file of the writer package.
QWEN3_TEMPLATE = (Path(__file__).parents[1] / "ggufgen" / "templates" / "qwen3.jinja").read_text()

# Per style: (general.architecture, default n_head_kv given n_head, rope base, eps,
#             vocabulary, biases, chat template for that vocabulary)
_STYLES = {
    "llama": ("llama", lambda h: h, 10000.0, 1e-5, "spm", False, LLAMA2_TEMPLATE),
    "mistral": ("llama", lambda h: max(1, h // 4), 1e6, 1e-5, "spm", False, MISTRAL_TEMPLATE),
    "qwen2": ("qwen2", lambda h: max(1, h // 2), 1e6, 1e-6, "bpe", True, CHATML_TEMPLATE),
    "qwen3": ("qwen3", lambda h: max(1, h // 2), 1e6, 1e-6, "bpe", False, QWEN3_TEMPLATE),
}
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


# --- weights -------------------------------------------------------------------------

def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def _normal(spec: LlamaSpec, name: str, shape: tuple[int, ...], std: float) -> np.ndarray:
    return (_rng(spec.seed, name).standard_normal(shape) * std).astype(np.float32)


def _gain(spec: LlamaSpec, name: str, n: int, scale: float = 1.0) -> np.ndarray:
    return (scale * (1.0 + 0.1 * _rng(spec.seed, name).standard_normal(n))).astype(np.float32)


def make_weights(spec: LlamaSpec) -> dict[str, np.ndarray]:
    """Every tensor of the model as float32 in numpy order ([rows, row length]),
    in file order: token_embd, the blocks, output_norm, output."""
    spec = spec.resolve()
    e, hd, f = spec.n_embd, spec.head_dim, spec.n_ff
    qk_std = (1.0 if spec.qk_norm else 1.5) / np.sqrt(e)   # with QK-norm the gains set the scale
    embd_std = TIED_EMBD / np.sqrt(e) if spec.tied_output else 1.0
    w: dict[str, np.ndarray] = {"token_embd.weight": _normal(spec, "token_embd.weight", (spec.n_vocab, e),
                                                             embd_std)}
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        w[p + "attn_norm.weight"] = _gain(spec, p + "attn_norm.weight", e)
        w[p + "attn_q.weight"] = _normal(spec, p + "attn_q.weight", (spec.n_head * hd, e), qk_std)
        w[p + "attn_k.weight"] = _normal(spec, p + "attn_k.weight", (spec.n_head_kv * hd, e), qk_std)
        w[p + "attn_v.weight"] = _normal(spec, p + "attn_v.weight", (spec.n_head_kv * hd, e), 1 / np.sqrt(e))
        if spec.with_bias:
            w[p + "attn_q.bias"] = _normal(spec, p + "attn_q.bias", (spec.n_head * hd,), 0.5)
            w[p + "attn_k.bias"] = _normal(spec, p + "attn_k.bias", (spec.n_head_kv * hd,), 0.5)
            w[p + "attn_v.bias"] = _normal(spec, p + "attn_v.bias", (spec.n_head_kv * hd,), 0.1)
        if spec.qk_norm:
            w[p + "attn_q_norm.weight"] = _gain(spec, p + "attn_q_norm.weight", hd, QK_NORM_GAIN)
            w[p + "attn_k_norm.weight"] = _gain(spec, p + "attn_k_norm.weight", hd, QK_NORM_GAIN)
        w[p + "attn_output.weight"] = _normal(spec, p + "attn_output.weight", (e, spec.n_head * hd),
                                              1 / np.sqrt(spec.n_head * hd))
        w[p + "ffn_norm.weight"] = _gain(spec, p + "ffn_norm.weight", e)
        w[p + "ffn_gate.weight"] = _normal(spec, p + "ffn_gate.weight", (f, e), 1 / np.sqrt(e))
        w[p + "ffn_up.weight"] = _normal(spec, p + "ffn_up.weight", (f, e), 1 / np.sqrt(e))
        w[p + "ffn_down.weight"] = _normal(spec, p + "ffn_down.weight", (e, f), 1 / np.sqrt(f))
    if spec.tied_output:
        w["output_norm.weight"] = _gain(spec, "output_norm.weight", e, LOGIT_STD / TIED_EMBD)
    else:
        w["output_norm.weight"] = _gain(spec, "output_norm.weight", e)
        w["output.weight"] = _normal(spec, "output.weight", (spec.n_vocab, e), LOGIT_STD / np.sqrt(e))
    return w


def write_weights(path: str | Path, spec: LlamaSpec, weights: dict[str, np.ndarray]) -> Path:
    """Write `weights` (numpy order, float32) with the metadata and vocabulary
    of `spec`: 2-D tensors in spec.weight_type, 1-D ones in F32.  Tests use it
    to write edited weights (an expanded GQA, a tied copy, zeroed biases)."""
    spec = spec.resolve()
    path = Path(path)
    qtype = WEIGHT_TYPES[spec.weight_type]
    arch = spec.gguf_arch
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"synthetic-{spec.arch}-{spec.weight_type}-{spec.seed}")
    writer.add_file_type(_FILE_TYPES[qtype])
    writer.add_context_length(spec.context_length)
    writer.add_embedding_length(spec.n_embd)
    writer.add_feed_forward_length(spec.n_ff)
    writer.add_block_count(spec.n_layer)
    writer.add_head_count(spec.n_head)
    writer.add_head_count_kv(spec.n_head_kv)
    writer.add_layer_norm_rms_eps(spec.eps)
    writer.add_rope_freq_base(spec.rope_freq_base)
    writer.add_rope_dimension_count(spec.head_dim)
    if spec.qk_norm or spec.key_length is not None:     # Qwen3 conversions always write them
        writer.add_key_length(spec.head_dim)
        writer.add_value_length(spec.head_dim)
    if spec.rope_scaling_factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(spec.rope_scaling_factor)
    writer.add_vocab_size(spec.n_vocab)
    _write_vocab(writer, spec)
    for name, value in weights.items():
        add_tensor(writer, name, value, Q.F32 if np.ndim(value) == 1 else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_llama(path: str | Path, *, arch: str = "llama", n_vocab: int = 512, n_embd: int = 128,
                n_head: int = 4, n_head_kv: int | None = None, n_layer: int = 2, n_ff: int = 256,
                weight_type: str = "F16", tied_output: bool = False, with_bias: bool | None = None,
                vocab: str | None = None, seed: int = 0, **more) -> Path:
    """Write a synthetic model to `path` and return the path.  Same arguments,
    same bytes.  `more` takes LlamaSpec's other fields (rope_freq_base,
    rope_scaling_factor, eps, context_length, bpe_pre, chat_template, key_length)."""
    spec = LlamaSpec(arch=arch, n_vocab=n_vocab, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
                     n_layer=n_layer, n_ff=n_ff, weight_type=weight_type, tied_output=tied_output,
                     with_bias=with_bias, vocab=vocab, seed=seed, **more)
    return write_weights(path, spec, make_weights(spec))


def add_tensor(writer: gguf.GGUFWriter, name: str, value: np.ndarray, qtype: Q) -> None:
    """Add float32 `value` (numpy order) to `writer` as `qtype`: F32 and F16 as
    arrays, K-quants by quantize_k, the other types by gguf.quants.quantize."""
    value = np.ascontiguousarray(value, dtype=np.float32)
    if qtype == Q.F32:
        writer.add_tensor(name, value)
    elif qtype == Q.F16:
        writer.add_tensor(name, value.astype(np.float16))
    elif qtype in K_QUANTS:
        writer.add_tensor(name, quantize_k(value, qtype), raw_dtype=qtype)
    else:
        writer.add_tensor(name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)


# --- K-quants -------------------------------------------------------------------------

K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)


def quantize_k(values: np.ndarray, qtype: Q) -> np.ndarray:
    """Q4_K, Q5_K or Q6_K blocks (uint8 [..., bytes]) for float32 `values` [..., n*256]
    (a matrix or a stack of them): a plain round-to-nearest quantizer (no search for
    the best scales, unlike llama.cpp's), laid out as ggml's block_q4_K / q5_K / q6_K.
    Whatever it produces, gguf.quants.dequantize defines the values a test compares with."""
    x = values.astype(np.float32).reshape(-1, 256)
    if qtype == Q.Q6_K:
        blocks = _quantize_q6_k(x)
    elif qtype == Q.Q4_K:
        blocks = _quantize_q4_k(x, 15)
    elif qtype == Q.Q5_K:
        blocks = _quantize_q4_k(x, 31)
    else:
        raise ValueError(f"quantize_k does not do {qtype.name}")
    return blocks.reshape(values.shape[:-1] + (-1,))


def _f16(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros(np.broadcast(a, b).shape, np.float32), where=b != 0)


def _quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """block_q6_K: ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] (int8, one per
    16 values), d (f16); value = d * scales[k] * (q - 32)."""
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    s = np.abs(sub).max(axis=-1) / 31.0                               # wanted step per 16 values
    d = _f16(s.max(axis=-1) / 127.0)
    sc = np.clip(np.rint(_safe_div(s, d.astype(np.float32)[:, None])), 0, 127).astype(np.int8)
    step = d.astype(np.float32)[:, None] * sc.astype(np.float32)
    q = np.clip(np.rint(_safe_div(sub, step[:, :, None])), -32, 31).astype(np.int16) + 32
    q = q.reshape(n, 2, 4, 32).astype(np.uint8)         # [half, group of 32, l]
    ql = np.concatenate([q[:, :, 0] & 0xF | (q[:, :, 2] & 0xF) << 4,
                         q[:, :, 1] & 0xF | (q[:, :, 3] & 0xF) << 4], axis=2)     # [n, 2, 64]
    qh = (q[:, :, 0] >> 4) | (q[:, :, 1] >> 4) << 2 | (q[:, :, 2] >> 4) << 4 | (q[:, :, 3] >> 4) << 6
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8),
                           d.reshape(n, 1).view(np.uint8)], axis=1)


def _quantize_q4_k(x: np.ndarray, levels: int) -> np.ndarray:
    """block_q4_K (levels 15): d, dmin (f16), scales[12] (6-bit scale and min per 32
    values, packed), qs[128] (4 bits); value = d * sc[j] * q - dmin * m[j].
    block_q5_K (levels 31): the same, with the fifth bit of every q in qh[32]
    (bit j of qh[l] is value l of sub-block j) between scales and qs."""
    n = x.shape[0]
    sub = x.reshape(n, 8, 32)
    lo = np.minimum(sub.min(axis=-1), 0.0)
    scale = (sub.max(axis=-1) - lo) / levels
    d = _f16(scale.max(axis=-1) / 63.0)
    dmin = _f16((-lo).max(axis=-1) / 63.0)
    sc = np.clip(np.rint(_safe_div(scale, d.astype(np.float32)[:, None])), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(_safe_div(-lo, dmin.astype(np.float32)[:, None])), 0, 63).astype(np.uint8)
    step = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * m
    q = np.clip(np.rint(_safe_div(sub + offset[:, :, None], step[:, :, None])), 0, levels).astype(np.uint8)
    scales = np.empty((n, 12), np.uint8)
    scales[:, 0:4] = sc[:, 0:4] | (sc[:, 4:8] >> 4) << 6
    scales[:, 4:8] = m[:, 0:4] | (m[:, 4:8] >> 4) << 6
    scales[:, 8:12] = (sc[:, 4:8] & 0xF) | (m[:, 4:8] & 0xF) << 4
    high = [] if levels == 15 else [np.bitwise_or.reduce((q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None],
                                                         axis=1).astype(np.uint8)]   # qh [n, 32]
    q = (q & 0xF).reshape(n, 4, 2, 32)                  # [chunk of 64, low/high nibble, l]
    qs = (q[:, :, 0] | q[:, :, 1] << 4).reshape(n, 128)
    return np.concatenate([d.reshape(n, 1).view(np.uint8), dmin.reshape(n, 1).view(np.uint8),
                           scales] + high + [qs], axis=1)


# --- vocabularies --------------------------------------------------------------------

@dataclass(frozen=True)
class Vocab:
    model: str                  # tokenizer.ggml.model
    tokens: list[str]
    types: list[int]
    scores: list[float] | None  # SentencePiece only
    merges: list[str] | None    # BPE only
    bos: int
    eos: int
    unk: int | None
    special: dict[str, int] = field(default_factory=dict)


def make_vocab(kind: str, n_vocab: int) -> Vocab:
    """A vocabulary of exactly n_vocab tokens learned from CORPUS."""
    if kind == "spm":
        return _spm_vocab(n_vocab)
    if kind == "bpe":
        return _bpe_vocab(n_vocab)
    raise ValueError(f"vocab {kind!r}: expected 'spm' or 'bpe'")


def _train_bpe(words: Counter, n_tokens: int, have: set[str]) -> list[tuple[str, str]]:
    """Merge the most frequent adjacent pair (ties: the lexicographically smallest)
    until n_tokens new token strings exist; words are tuples of symbols."""
    merges: list[tuple[str, str]] = []
    new = 0
    words = Counter({tuple(w): c for w, c in words.items()})
    while new < n_tokens:
        pairs: Counter = Counter()
        for w, c in words.items():
            for a, b in zip(w, w[1:]):
                pairs[(a, b)] += c
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        joined = best[0] + best[1]
        if joined not in have:
            have.add(joined)
            new += 1
        merged: Counter = Counter()
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(joined)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] += c
        words = merged
    return merges


def _spm_vocab(n_vocab: int) -> Vocab:
    words = Counter("\u2581" + w for w in CORPUS.split())
    chars = sorted({c for w in words for c in w})
    fixed = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    room = n_vocab - len(fixed) - len(chars)
    if room < 0:
        raise ValueError(f"an SPM vocabulary needs at least {len(fixed) + len(chars)} tokens")
    merges = _train_bpe(Counter({tuple(w): c for w, c in words.items()}), room, set(chars))
    pieces: list[str] = []
    for a, b in merges:
        if a + b not in pieces and a + b not in chars:
            pieces.append(a + b)
    pieces = pieces[:room]
    unused = [f"<unused{i}>" for i in range(room - len(pieces))]  # only if CORPUS ran out of merges
    tokens = fixed + pieces + chars + unused
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * (len(pieces) + len(chars)) \
        + [UNUSED] * len(unused)
    scores = [0.0] * len(fixed) + [-float(i) for i in range(len(pieces) + len(chars))] \
        + [-1e9] * len(unused)
    return Vocab("llama", tokens, types, scores, None, bos=1, eos=2, unk=0)


def gpt2_byte_chars() -> list[str]:
    """GPT-2's bytes_to_unicode: the printable character standing for each byte value."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
                 + list(range(ord("\xae"), ord("\xff") + 1)))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


# GPT-2's pre-tokenizer with Python's `re` (\p{L} -> [^\W\d_], \p{N} -> \d): used
# only to cut CORPUS into words for training; the file names the real one in
# tokenizer.ggml.pre.
_GPT2_SPLIT = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?[^\s\w]+|\s+(?!\S)|\s+""")


def _bpe_vocab(n_vocab: int) -> Vocab:
    byte_chars = gpt2_byte_chars()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    room = n_vocab - 256 - len(specials)
    if room < 0:
        raise ValueError(f"a BPE vocabulary needs at least {256 + len(specials)} tokens")
    words = Counter(tuple(byte_chars[b] for b in piece.encode())
                    for piece in _GPT2_SPLIT.findall(CORPUS))
    merges = _train_bpe(words, room, set(byte_chars))
    tokens = list(byte_chars)
    seen = set(tokens)
    kept_merges = []
    for a, b in merges:
        if a + b not in seen:
            if len(tokens) - 256 >= room:
                break
            seen.add(a + b)
            tokens.append(a + b)
        kept_merges.append(f"{a} {b}")
    unused = [f"<unused{i}>" for i in range(room - (len(tokens) - 256))]
    first_special = len(tokens) + len(unused)
    tokens += unused + specials
    types = [NORMAL] * (first_special - len(unused)) + [UNUSED] * len(unused) + [CONTROL] * 3
    ids = {s: first_special + i for i, s in enumerate(specials)}
    return Vocab("gpt2", tokens, types, None, kept_merges, bos=ids["<|endoftext|>"],
                 eos=ids["<|im_end|>"], unk=None, special=ids)


# What llama.cpp's tokenizer makes of a few texts with these vocabularies: goldens
# for the engine's tokenizer.  Recorded with llama-cpp-python 0.3.36 as
# Llama(model_path, vocab_only=True).tokenize(text.encode(), add_bos=False, special=S)
# on write_llama(arch="llama") ("spm") and write_llama(arch="qwen2") ("bpe"),
# default n_vocab 512.  Entries: (text, S, ids).  SentencePiece adds a leading
# space ("\u2581") to the text first; characters outside CORPUS's alphabet become
# <0xXX> byte tokens; with S (parse special tokens) "<|im_start|>" is one token in
# the BPE vocabulary.  test_reference checks that the ids still spell the texts.
LLAMA_CPP_TOKENIZATIONS: dict[str, list[tuple[str, bool, list[int]]]] = {
    "spm": [
        ('The river ran past the old mill.', False,
         [307, 356, 282, 300, 437, 261, 271, 342, 331, 468]),
        (' Hello world', False, [511, 350, 491, 272, 500, 264, 283, 342]),
        ('café 日本 🙂', False,
         [299, 492, 510, 511, 233, 154, 168, 233, 159, 175, 511, 243, 162, 156, 133]),
        ('12 sacks\n\n  and 300 more', False,
         [511, 450, 439, 13, 13, 511, 275, 511, 451, 469, 274, 500, 278]),
        ("the miller's daughter", False, [261, 435, 42, 504, 426]),
        ('<|im_start|>user\nhi<|im_end|>', False,
         [511, 63, 127, 495, 498, 98, 504, 505, 289, 505, 127, 65, 506, 504, 262, 13, 494, 495, 63,
          127, 495, 498, 98, 491, 268, 127, 65]),
        ('<|im_start|>user\nhi<|im_end|>', True,
         [511, 63, 127, 495, 498, 98, 504, 505, 289, 505, 127, 65, 506, 504, 262, 13, 494, 495, 63,
          127, 495, 498, 98, 491, 268, 127, 65]),
    ],
    "bpe": [
        ('The river ran past the old mill.', False,
         [296, 352, 278, 297, 427, 258, 268, 340, 328, 46]),
        (' Hello world', False, [32, 443, 267, 111, 262, 280, 340]),
        ('café 日本 🙂', False,
         [99, 97, 506, 169, 32, 230, 151, 165, 230, 156, 172, 32, 240, 159, 153, 130]),
        ('12 sacks\n\n  and 300 more', False,
         [440, 429, 10, 10, 32, 279, 32, 441, 48, 271, 111, 274]),
        ("the miller's daughter", False, [116, 256, 424, 39, 115, 416]),
        ('<|im_start|>user\nhi<|im_end|>', False,
         [60, 124, 105, 109, 95, 115, 116, 475, 124, 62, 117, 115, 259, 10, 104, 105, 60, 124, 105,
          109, 95, 101, 265, 124, 62]),
        ('<|im_start|>user\nhi<|im_end|>', True, [510, 117, 115, 259, 10, 104, 105, 511]),
    ],
}


def _write_vocab(writer: gguf.GGUFWriter, spec: LlamaSpec) -> None:
    v = make_vocab(spec.vocab, spec.n_vocab)
    writer.add_tokenizer_model(v.model)
    if v.model == "gpt2":
        writer.add_tokenizer_pre(spec.bpe_pre)
    writer.add_token_list(v.tokens)
    writer.add_token_types(v.types)
    if v.scores is not None:
        writer.add_token_scores(v.scores)
    if v.merges is not None:
        writer.add_token_merges(v.merges)
    writer.add_bos_token_id(v.bos)
    writer.add_eos_token_id(v.eos)
    if v.unk is not None:
        writer.add_unk_token_id(v.unk)
    if v.model == "gpt2":
        writer.add_pad_token_id(v.bos)
    writer.add_add_bos_token(v.model == "llama")
    writer.add_add_eos_token(False)
    if v.model == "llama":
        writer.add_add_space_prefix(True)
    if spec.chat_template:
        writer.add_chat_template(spec.chat_template)
