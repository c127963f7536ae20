"""Synthetic llama-shaped GGUF models for benchmarks and the demo.

Owns: `LlamaShape` (the hyper-parameters; `for_bytes` picks a shape of a
given size, `preset` names the 8B class), and `write_model`, which writes a
complete llama GGUF — every tensor the engine reads, with a small
SentencePiece vocabulary (byte fallback) so text goes in and out — whose
weights are either a hole in a sparse file (zeros: nothing is written or
read from a disk, for speed benchmarks) or seeded random values (for the
demo, where two models must say different things).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

WORDS = ("the of and to in is you that it he was for on are as with his they at be this have from or one had by "
         "word but not what all were we when your can said there use an each which she do how their if will up "
         "other about out many then them these so some her would make like him into time has look two more write "
         "go see number no way could people my than first water been call who oil its now find long down day did "
         "get come made may part GPU model cache token memory share").split()

TYPES = {"F16": 1, "F32": 0, "Q8_0": 8, "Q4_0": 2, "Q4_K": 12}
_BLOCK = {"F16": (1, 2), "F32": (1, 4), "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_K": (256, 144)}
# Types gguf.quants can quantize, so "random" fill works; the others (Q4_K:
# gguf 0.19 raises NotImplementedError) are written as zeros only (an
# all-zero block is a valid block of every type: scales 0, value 0).
_RANDOM_OK = ("F16", "F32", "Q8_0", "Q4_0")


@dataclass(frozen=True)
class LlamaShape:
    n_embd: int = 4096
    n_ff: int = 14336
    n_head: int = 32
    n_head_kv: int = 8
    n_layer: int = 32
    n_vocab: int = 32000

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def matrices(self) -> list[tuple[str, int, int]]:
        """(name, rows, cols) of every matrix, cols = ggml ne[0]."""
        e, f, kv = self.n_embd, self.n_ff, self.n_head_kv * self.head_dim
        out = [("token_embd.weight", self.n_vocab, e)]
        for i in range(self.n_layer):
            p = f"blk.{i}."
            out += [(p + "attn_q.weight", e, e), (p + "attn_k.weight", kv, e), (p + "attn_v.weight", kv, e),
                    (p + "attn_output.weight", e, e), (p + "ffn_gate.weight", f, e),
                    (p + "ffn_up.weight", f, e), (p + "ffn_down.weight", e, f)]
        return out + [("output.weight", self.n_vocab, e)]

    def norms(self) -> list[str]:
        out = [n for i in range(self.n_layer) for n in (f"blk.{i}.attn_norm.weight", f"blk.{i}.ffn_norm.weight")]
        return out + ["output_norm.weight"]

    def weight_bytes(self, wtype: str = "F16") -> int:
        per, size = _BLOCK[wtype]
        return sum(r * c // per * size for _, r, c in self.matrices()) + 4 * self.n_embd * len(self.norms())

    @staticmethod
    def preset(name: str) -> "LlamaShape":
        if name in ("8b", "llama3-8b"):
            return LlamaShape(n_vocab=128256)
        if name == "7b":
            return LlamaShape(n_ff=11008, n_head_kv=32, n_vocab=32000)
        raise ValueError(f"unknown shape preset {name!r} (8b, 7b)")

    @staticmethod
    def for_bytes(nbytes: int, wtype: str = "F16") -> "LlamaShape":
        """A shape of about `nbytes` of weights: 8B-class layers when big, narrow ones when small."""
        base = LlamaShape(n_layer=1) if nbytes >= 2 << 30 else \
            LlamaShape(n_embd=512, n_ff=1536, n_head=8, n_head_kv=4, n_layer=1, n_vocab=1024)
        fixed = replace(base, n_layer=0).weight_bytes(wtype)
        per_layer = base.weight_bytes(wtype) - fixed
        return replace(base, n_layer=max(1, round((nbytes - fixed) / per_layer)))


def _vocabulary(n_vocab: int) -> tuple[list[str], list[float], list[int]]:
    """A small SentencePiece vocabulary: <unk> <s> </s>, the 256 byte tokens,
    single characters, then every prefix of "▁word" for the words above (so
    the merge algorithm can build whole words), padded with ▁w<i>."""
    tokens, scores, types = ["<unk>", "<s>", "</s>"], [0.0, 0.0, 0.0], [2, 3, 3]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    scores += [0.0] * 256
    types += [6] * 256
    pieces: dict[str, float] = {}
    for ch in "\u2581abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'-":
        pieces.setdefault(ch, -10.0)
    for rank, word in enumerate(WORDS):
        full = "\u2581" + word
        for end in range(2, len(full) + 1):
            # Longer pieces score higher: merges build whole words first.
            pieces.setdefault(full[:end], float(end) - rank * 1e-3)
    i = 0
    for piece, score in pieces.items():
        tokens.append(piece)
        scores.append(score)
        types.append(1)
    while len(tokens) < n_vocab:
        tokens.append(f"\u2581w{i}")
        scores.append(-20.0 - i)
        types.append(1)
        i += 1
    return tokens[:n_vocab], scores[:n_vocab], types[:n_vocab]


def write_model(path: str | os.PathLike, shape: LlamaShape, *, wtype: str = "F16", fill: str = "zeros",
                seed: int = 0, name: str = "synthetic") -> Path:
    """Write a llama GGUF of `shape`; `fill` "zeros" (sparse, instant) or "random" (seeded)."""
    import gguf
    if fill == "random" and wtype not in _RANDOM_OK:
        raise ValueError(f"random {wtype} weights: gguf cannot quantize {wtype}; use fill='zeros' "
                         f"(random works for {', '.join(_RANDOM_OK)})")
    path = Path(path)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.add_context_length(8192)
    w.add_embedding_length(shape.n_embd)
    w.add_feed_forward_length(shape.n_ff)
    w.add_block_count(shape.n_layer)
    w.add_head_count(shape.n_head)
    w.add_head_count_kv(shape.n_head_kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("llama")
    tokens, scores, types = _vocabulary(shape.n_vocab)
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    qtype = gguf.GGMLQuantizationType(TYPES[wtype])
    per, size = _BLOCK[wtype]
    rng = np.random.default_rng(seed)
    tensors = []
    for tname, rows, cols in shape.matrices():
        nbytes = rows * cols // per * size
        tensors.append((tname, (cols, rows), nbytes, qtype, lambda r=rows, c=cols: _random_matrix(rng, r, c, wtype)))
    for tname in shape.norms():
        tensors.append((tname, (shape.n_embd,), 4 * shape.n_embd, gguf.GGMLQuantizationType.F32,
                        lambda: (1.0 + 0.1 * rng.standard_normal(shape.n_embd)).astype(np.float32)))
    for tname, dims, nbytes, t, _make in tensors:
        w.add_tensor_info(tname, _byte_shape(dims, t, nbytes), np.dtype(np.uint8), nbytes, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    offsets = extend_to_data(path, [t[2] for t in tensors])
    if fill == "random":
        with open(path, "r+b") as f:
            for (_n, _d, nbytes, _t, make), off in zip(tensors, offsets):
                f.seek(off)
                f.write(np.ascontiguousarray(make()).tobytes()[:nbytes])
    elif fill != "zeros":
        raise ValueError(f"fill {fill!r}: zeros or random")
    return path


def extend_to_data(path: Path, sizes: list[int], align: int = 32) -> list[int]:
    """Extend a GGUF whose header is written to its full size, the tensor data
    a hole (zeros, no disk); return each tensor's data offset (gguf's layout:
    every tensor aligned to `align` after the aligned end of the header)."""
    at = -(-os.path.getsize(path) // align) * align
    offsets = []
    for nbytes in sizes:
        offsets.append(at)
        at = -(-(at + nbytes) // align) * align
    os.truncate(path, offsets[-1] + sizes[-1])
    return offsets


def _byte_shape(dims, qtype, nbytes) -> tuple[int, ...]:
    """The byte-array shape gguf's writer takes for a raw tensor of ggml dims (ne0[, ne1])."""
    import gguf
    if len(dims) == 1:
        return (nbytes,)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return (dims[1], dims[0] // block * size)


def _random_matrix(rng, rows: int, cols: int, wtype: str) -> np.ndarray:
    """Weights of a well-conditioned scale (1/sqrt(cols)), quantized as `wtype`."""
    import gguf
    x = (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
    if wtype == "F32":
        return x
    if wtype == "F16":
        return x.astype(np.float16)
    return gguf.quants.quantize(x, gguf.GGMLQuantizationType(TYPES[wtype]))


@dataclass(frozen=True)
class MoEShape:
    """A qwen3moe shape; the default is Qwen3-30B-A3B's (48 layers, 128 experts, top-8, hidden 2048)."""

    n_embd: int = 2048
    n_head: int = 32
    n_head_kv: int = 4
    head_dim: int = 128
    n_layer: int = 48
    n_expert: int = 128
    n_used: int = 8
    n_ff_exp: int = 768
    n_vocab: int = 151936

    def matrices(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, ggml dims) of every matrix (stacked expert tensors have 3 dims)."""
        e, q, kv = self.n_embd, self.n_head * self.head_dim, self.n_head_kv * self.head_dim
        out = [("token_embd.weight", (e, self.n_vocab))]
        for i in range(self.n_layer):
            p = f"blk.{i}."
            out += [(p + "attn_q.weight", (e, q)), (p + "attn_k.weight", (e, kv)), (p + "attn_v.weight", (e, kv)),
                    (p + "attn_output.weight", (q, e)), (p + "ffn_gate_inp.weight", (e, self.n_expert)),
                    (p + "ffn_gate_exps.weight", (e, self.n_ff_exp, self.n_expert)),
                    (p + "ffn_up_exps.weight", (e, self.n_ff_exp, self.n_expert)),
                    (p + "ffn_down_exps.weight", (self.n_ff_exp, e, self.n_expert))]
        return out + [("output.weight", (e, self.n_vocab))]

    def vectors(self) -> list[tuple[str, int]]:
        out = []
        for i in range(self.n_layer):
            p = f"blk.{i}."
            out += [(p + "attn_norm.weight", self.n_embd), (p + "ffn_norm.weight", self.n_embd),
                    (p + "attn_q_norm.weight", self.head_dim), (p + "attn_k_norm.weight", self.head_dim)]
        return out + [("output_norm.weight", self.n_embd)]


def write_moe_model(path: str | os.PathLike, shape: MoEShape, *, wtype: str = "Q8_0") -> Path:
    """A qwen3moe GGUF of `shape` whose data is a hole (zeros; the router then
    picks experts 0..k-1, which costs what any other choice costs).  The
    router stays F32, as llama-quantize leaves it."""
    import gguf
    path = Path(path)
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_name("bench-moe")
    w.add_context_length(8192)
    w.add_embedding_length(shape.n_embd)
    w.add_block_count(shape.n_layer)
    w.add_head_count(shape.n_head)
    w.add_head_count_kv(shape.n_head_kv)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1000000.0)
    w.add_expert_count(shape.n_expert)
    w.add_expert_used_count(shape.n_used)
    w.add_expert_feed_forward_length(shape.n_ff_exp)
    w.add_feed_forward_length(shape.n_ff_exp)
    tensors = []
    for name, dims in shape.matrices():
        t = "F32" if "ffn_gate_inp" in name else wtype
        per, size = _BLOCK[t]
        nbytes = int(np.prod(dims)) // per * size
        tensors.append((name, dims, nbytes, gguf.GGMLQuantizationType(TYPES[t])))
    for name, n in shape.vectors():
        tensors.append((name, (n,), 4 * n, gguf.GGMLQuantizationType.F32))
    for name, dims, nbytes, qt in tensors:
        if len(dims) == 1:
            byte_shape = (nbytes,)
        else:
            block, size = gguf.GGML_QUANT_SIZES[qt]
            byte_shape = tuple(reversed(dims[1:])) + (dims[0] // block * size,)
        w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    extend_to_data(path, [t[2] for t in tensors])
    return path
