"""Zero-weight GGUF files shaped as the 2026 models: qwen35, qwen35moe and gpt-oss (issue 17).

Owns: `Qwen35Shape` and `GptOssShape` (hyper-parameters and every tensor of
the architecture, as llama.cpp's loader -- llama_model_qwen35 / _qwen35moe /
openai-moe -- and vramd/engine/arch read them), `PRESETS` (the real models'
geometry), `TYPES_BY_ARCH` (the weight types a bench may ask for),
`shape_for` (a preset, optionally scaled down for a small test) and
`write_arch_model`, which writes the file with its data a hole (zeros: no disk
traffic; models.extend_to_data) and a byte-level BPE vocabulary valid for both
engines (tokenizer.ggml.model "gpt2" with merges, which llama.cpp requires).

Where the geometry comes from (published config.json values):
  Qwen3.5-27B        hidden 5120, 64 layers, intermediate 17408, 24 heads / 4 KV of 256,
                     partial_rotary_factor 0.25 (64 dims, mrope_section [11, 11, 10]),
                     full_attention_interval 4, linear_num_key_heads 16, linear_num_value_heads 48,
                     linear_key/value_head_dim 128, linear_conv_kernel_dim 4, vocab 248320,
                     rope_theta 1e7, untied (THUDM/slime scripts/models/qwen3.5-27B.sh, and the
                     Qwen3.6-27B config.json quoted in several public repos).
  Qwen3.6-35B-A3B    the topology of Qwen3.5-35B-A3B (slime scripts/models/qwen36-35B-A3B.sh says
                     so): hidden 2048, 40 layers, 16 heads / 2 KV of 256, 256 experts top-8 of
                     512, a shared expert of 512, linear heads 16 key / 32 value of 128, conv 4,
                     interval 4, vocab 248320 (slime scripts/models/qwen3.5-35B-A3B.sh).
  gpt-oss-20b        hidden 2880, 24 layers, 64 heads / 8 KV of 64, 32 experts top-4 of 2880,
                     sliding_window 128 (even layers), rope_theta 150000, YaRN factor 32 over
                     4096, rms eps 1e-5, vocab 201088 (openai/gpt-oss-20b's config.json as quoted
                     in public repos, e.g. EchoCog/gpt-oss-20b docs/gpt-oss-20b-architecture.md).
Not written: Qwen3.5's MTP layer (mtp_num_hidden_layers 1; llama.cpp's converter drops it)
and vision tower; the vocabulary's text (the token count is the real one, the tokens are
bytes, merged words and fillers: a bench sends token ids).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from vramd.bench.models import WORDS, extend_to_data

# Per architecture: --type -> (matrices, expert stacks, output head).  The real files:
# Q4_K_M keeps output.weight at Q6_K; gpt-oss's MXFP4 files have MXFP4 experts and Q8_0 the rest.
TYPES_BY_ARCH = {
    "qwen35": {"Q4_K": ("Q4_K", "Q4_K", "Q6_K"), "Q8_0": ("Q8_0",) * 3, "F16": ("F16",) * 3, "F32": ("F32",) * 3},
    "gpt-oss": {"MXFP4": ("Q8_0", "MXFP4", "Q8_0"), "Q8_0": ("Q8_0",) * 3, "F16": ("F16",) * 3,
                "F32": ("F32",) * 3},
}
_SPECIALS = {"qwen35": ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
             "gpt-oss": ("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|start|>", "<|end|>",
                         "<|message|>", "<|channel|>", "<|call|>")}
_PRE = {"qwen35": "qwen2", "gpt-oss": "gpt-4o"}   # pre-tokenizers both engines know


@dataclass(frozen=True)
class Qwen35Shape:
    """qwen35 (n_expert 0) or qwen35moe.  DeltaNet: hk key heads, hv value heads, head size s."""
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int = 0
    head_dim: int = 256
    n_rot: int = 64
    sections: tuple[int, ...] = (11, 11, 10, 0)
    interval: int = 4
    d_conv: int = 4
    s: int = 128
    hk: int = 16
    hv: int = 32
    n_vocab: int = 248320
    n_expert: int = 0
    n_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0

    family = "qwen35"

    @property
    def arch(self) -> str:
        return "qwen35moe" if self.n_expert else "qwen35"

    def tensors(self) -> list[tuple[str, tuple[int, ...], str]]:
        """(name, ggml dims, role) in file order; role: vec | mat | exp | head (F32 roles: vec)."""
        e, hd, s = self.n_embd, self.head_dim, self.s
        key, val = self.hk * s, self.hv * s
        out = [("token_embd.weight", (e, self.n_vocab), "mat")]
        for i in range(self.n_layer):
            p = f"blk.{i}."
            out.append((p + "attn_norm.weight", (e,), "vec"))
            if (i + 1) % self.interval:   # Gated DeltaNet
                out += [(p + "attn_qkv.weight", (e, 2 * key + val), "mat"), (p + "attn_gate.weight", (e, val), "mat"),
                        (p + "ssm_conv1d.weight", (self.d_conv, 2 * key + val), "vec"),   # llama.cpp: f32 kernel
                        (p + "ssm_dt.bias", (self.hv,), "vec"), (p + "ssm_a", (self.hv,), "vec"),
                        (p + "ssm_alpha.weight", (e, self.hv), "mat"), (p + "ssm_beta.weight", (e, self.hv), "mat"),
                        (p + "ssm_norm.weight", (s,), "vec"), (p + "ssm_out.weight", (val, e), "mat")]
            else:                         # gated attention: per head hd query rows, then hd gate rows
                out += [(p + "attn_q.weight", (e, 2 * self.n_head * hd), "mat"), (p + "attn_q_norm.weight", (hd,), "vec"),
                        (p + "attn_k.weight", (e, self.n_head_kv * hd), "mat"), (p + "attn_k_norm.weight", (hd,), "vec"),
                        (p + "attn_v.weight", (e, self.n_head_kv * hd), "mat"),
                        (p + "attn_output.weight", (self.n_head * hd, e), "mat")]
            out.append((p + "post_attention_norm.weight", (e,), "vec"))
            if self.n_expert:
                ne, fe, fs = self.n_expert, self.n_ff_exp, self.n_ff_shexp
                out += [(p + "ffn_gate_inp.weight", (e, ne), "vec"),   # the router stays F32
                        (p + "ffn_gate_exps.weight", (e, fe, ne), "exp"), (p + "ffn_up_exps.weight", (e, fe, ne), "exp"),
                        (p + "ffn_down_exps.weight", (fe, e, ne), "exp"), (p + "ffn_gate_inp_shexp.weight", (e,), "vec"),
                        (p + "ffn_gate_shexp.weight", (e, fs), "mat"), (p + "ffn_up_shexp.weight", (e, fs), "mat"),
                        (p + "ffn_down_shexp.weight", (fs, e), "mat")]
            else:
                out += [(p + "ffn_gate.weight", (e, self.n_ff), "mat"), (p + "ffn_up.weight", (e, self.n_ff), "mat"),
                        (p + "ffn_down.weight", (self.n_ff, e), "mat")]
        return out + [("output_norm.weight", (e,), "vec"), ("output.weight", (e, self.n_vocab), "head")]

    def metadata(self, w) -> None:
        w.add_context_length(262144)
        w.add_embedding_length(self.n_embd)
        w.add_feed_forward_length(self.n_ff_exp if self.n_expert else self.n_ff)
        _heads(w, self, 1e-6, 1e7, self.n_rot)
        w.add_rope_dimension_sections(list(self.sections))
        w.add_full_attention_interval(self.interval)
        w.add_ssm_conv_kernel(self.d_conv)
        w.add_ssm_state_size(self.s)
        w.add_ssm_group_count(self.hk)
        w.add_ssm_time_step_rank(self.hv)
        w.add_ssm_inner_size(self.hv * self.s)
        if self.n_expert:
            _experts(w, self)
            w.add_expert_shared_feed_forward_length(self.n_ff_shexp)


@dataclass(frozen=True)
class GptOssShape:
    n_embd: int = 2880
    n_layer: int = 24
    n_head: int = 64
    n_head_kv: int = 8
    head_dim: int = 64
    n_expert: int = 32
    n_used: int = 4
    n_ff_exp: int = 2880
    window: int = 128
    n_vocab: int = 201088

    family = arch = "gpt-oss"

    def tensors(self) -> list[tuple[str, tuple[int, ...], str]]:
        e, ne, f = self.n_embd, self.n_expert, self.n_ff_exp
        qd, kd = self.n_head * self.head_dim, self.n_head_kv * self.head_dim
        out = [("token_embd.weight", (e, self.n_vocab), "mat")]
        for i in range(self.n_layer):
            p = f"blk.{i}."
            out += [(p + "attn_norm.weight", (e,), "vec"),
                    (p + "attn_q.weight", (e, qd), "mat"), (p + "attn_q.bias", (qd,), "vec"),
                    (p + "attn_k.weight", (e, kd), "mat"), (p + "attn_k.bias", (kd,), "vec"),
                    (p + "attn_v.weight", (e, kd), "mat"), (p + "attn_v.bias", (kd,), "vec"),
                    (p + "attn_output.weight", (qd, e), "mat"), (p + "attn_output.bias", (e,), "vec"),
                    (p + "attn_sinks.weight", (self.n_head,), "vec"), (p + "post_attention_norm.weight", (e,), "vec"),
                    (p + "ffn_gate_inp.weight", (e, ne), "vec"), (p + "ffn_gate_inp.bias", (ne,), "vec"),
                    (p + "ffn_gate_exps.weight", (e, f, ne), "exp"), (p + "ffn_gate_exps.bias", (f, ne), "vec"),
                    (p + "ffn_up_exps.weight", (e, f, ne), "exp"), (p + "ffn_up_exps.bias", (f, ne), "vec"),
                    (p + "ffn_down_exps.weight", (f, e, ne), "exp"), (p + "ffn_down_exps.bias", (e, ne), "vec")]
        return out + [("output_norm.weight", (e,), "vec"), ("output.weight", (e, self.n_vocab), "head")]

    def metadata(self, w) -> None:
        import gguf
        w.add_context_length(131072)
        w.add_embedding_length(self.n_embd)
        w.add_feed_forward_length(self.n_ff_exp)
        _heads(w, self, 1e-5, 150000.0, self.head_dim)
        _experts(w, self)
        w.add_sliding_window(self.window)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(32.0)
        w.add_rope_scaling_orig_ctx_len(4096)


def _heads(w, shape, eps: float, base: float, n_rot: int) -> None:
    w.add_block_count(shape.n_layer)
    w.add_head_count(shape.n_head)
    w.add_head_count_kv(shape.n_head_kv)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_layer_norm_rms_eps(eps)
    w.add_rope_freq_base(base)
    w.add_rope_dimension_count(n_rot)


def _experts(w, shape) -> None:
    w.add_expert_count(shape.n_expert)
    w.add_expert_used_count(shape.n_used)
    w.add_expert_feed_forward_length(shape.n_ff_exp)


PRESETS = {
    "qwen35-27b": Qwen35Shape(n_embd=5120, n_layer=64, n_head=24, n_head_kv=4, n_ff=17408, hk=16, hv=48),
    "qwen35moe-35b-a3b": Qwen35Shape(n_embd=2048, n_layer=40, n_head=16, n_head_kv=2, hk=16, hv=32,
                                     n_expert=256, n_used=8, n_ff_exp=512, n_ff_shexp=512),
    "gptoss-20b": GptOssShape(),
}


def shape_for(name: str, layers: int | None = None, vocab: int | None = None, experts: int | None = None):
    """PRESETS[name], with fewer layers / a smaller vocabulary / fewer experts for a small test."""
    from vramd.errors import UsageError
    shape = PRESETS[name]
    if experts is not None and not shape.n_expert:
        raise UsageError(f"--experts: {name} has no experts")
    if experts is not None and experts < shape.n_used:
        raise UsageError(f"--experts {experts}: {name} routes to {shape.n_used} experts a token")
    return replace(shape, **{k: v for k, v in (("n_layer", layers), ("n_vocab", vocab), ("n_expert", experts))
                            if v is not None})


def write_arch_model(path: str | os.PathLike, shape, wtype: str) -> Path:
    """Write `shape` as a GGUF of --type `wtype` (TYPES_BY_ARCH) whose data is a hole."""
    import gguf
    from vramd.errors import UsageError
    kinds = TYPES_BY_ARCH[shape.family]
    if wtype not in kinds:
        raise UsageError(f"--type {wtype}: a {shape.family} bench file is one of {', '.join(kinds)}")
    mat, exp, head = kinds[wtype]
    by_role = {"vec": "F32", "mat": mat, "exp": exp, "head": head}
    path = Path(path)
    w = gguf.GGUFWriter(str(path), shape.arch)
    w.add_name(f"bench-{shape.arch}")
    if exp == "MXFP4":
        w.add_file_type(gguf.LlamaFileType.MOSTLY_MXFP4_MOE)
    shape.metadata(w)
    w.add_vocab_size(shape.n_vocab)
    _vocabulary(w, shape)
    tensors = []
    for name, dims, role in shape.tensors():
        qt = gguf.GGMLQuantizationType[by_role[role]]
        block, size = gguf.GGML_QUANT_SIZES[qt]
        if dims[0] % block:
            raise ValueError(f"{name}: row length {dims[0]} is not a multiple of {qt.name}'s block {block}")
        nbytes = int(np.prod(dims)) // block * size
        w.add_tensor_info(name, tuple(reversed(dims[1:])) + (dims[0] // block * size,), np.dtype(np.uint8), nbytes,
                          raw_dtype=qt)
        tensors.append(nbytes)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    extend_to_data(path, tensors)
    return path


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (byte-level BPE's base alphabet)."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def _vocabulary(w, shape) -> None:
    """n_vocab tokens: the 256 byte tokens, the words of models.WORDS built by merges ("Ġ" + word,
    a character at a time), the family's special tokens (control), then fillers up to n_vocab."""
    chars = _byte_chars()
    tokens, merges, seen = list(chars), [], set(chars)
    space = chars[ord(" ")]
    for word in WORDS:
        piece = space + word
        for end in range(2, len(piece) + 1):
            if piece[:end] not in seen:
                merges.append(f"{piece[:end - 1]} {piece[end - 1]}")
                tokens.append(piece[:end])
                seen.add(piece[:end])
    specials = _SPECIALS[shape.family]
    if len(tokens) + len(specials) > shape.n_vocab:
        raise ValueError(f"a vocabulary of {shape.n_vocab} is smaller than the {len(tokens) + len(specials)} "
                         f"tokens the bench vocabulary needs")
    fill = shape.n_vocab - len(tokens) - len(specials)
    types = [1] * (len(tokens) + fill) + [3] * len(specials)
    first = len(tokens) + fill
    tokens += [f"{space}w{i}" for i in range(fill)] + list(specials)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(_PRE[shape.family])
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(first)
    w.add_eos_token_id(first + specials.index("<|im_end|>" if shape.family == "qwen35" else "<|return|>"))
    w.add_pad_token_id(first)
    w.add_add_bos_token(False)


def scale_options(f):
    """The benches' --layers / --vocab / --experts: a scaled-down 2026 shape (a small test)."""
    import click
    f = click.option("--experts", type=click.IntRange(min=1), default=None,
                     help="2026 MoE shapes: fewer experts than the model's (a small test).")(f)
    f = click.option("--vocab", type=click.IntRange(min=512), default=None,
                     help="2026 shapes: a smaller vocabulary, the embedding and output sized to it.")(f)
    return click.option("--layers", type=click.IntRange(min=1), default=None,
                        help=f"2026 shapes ({', '.join(PRESETS)}): fewer layers than the model's.")(f)


def synthetic(directory: str | os.PathLike, shape: str, wtype: str, layers=None, vocab=None, experts=None):
    """The path of `shape`'s zero-weight file written in `directory` when it is a 2026 shape, else
    None (the older llama shapes; the scaling options are refused there rather than ignored)."""
    from vramd.errors import UsageError
    if shape not in PRESETS:
        given = [o for o, v in (("--layers", layers), ("--vocab", vocab), ("--experts", experts)) if v is not None]
        if given:
            raise UsageError(f"{'/'.join(given)}: only for the 2026 shapes ({', '.join(PRESETS)}), not {shape}")
        return None
    s = shape_for(shape, layers, vocab, experts)
    scaled = "".join(f"-{k}{v}" for k, v in (("L", layers), ("V", vocab), ("E", experts)) if v is not None)
    return str(write_arch_model(Path(directory) / f"{shape}{scaled}-{wtype}.gguf", s, wtype))
