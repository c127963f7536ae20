"""Weight types and quantization for the synthetic GGUF writers.

Owns `WEIGHT_TYPES` (the types a writer can store, by name), `ENGINE_WEIGHT_TYPES`,
`FILE_TYPES` (general.file_type per type), `add_tensor` (one float32 tensor
into a GGUFWriter as a given type), `write_tensors` (them all, then the file)
and `quantize_k` (Q4_K, Q5_K, Q6_K blocks, which gguf.quants cannot make).  Q4_1, Q5_0, Q5_1, Q8_0, BF16 come from
gguf.quants.quantize.  Whatever is written, gguf.quants.dequantize of the
bytes defines the values a test compares with.
"""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

# The types issue 5's engine runs, then more for the next issue's work: Q4_1, Q5_0
# and Q5_1 quantized by gguf.quants, Q4_K, Q5_K and Q6_K by quantize_k() below (gguf
# has no quantizer for them).  K-quants need n_embd and n_ff multiples of 256.
WEIGHT_TYPES = {"F32": Q.F32, "F16": Q.F16, "BF16": Q.BF16, "Q8_0": Q.Q8_0, "Q4_0": Q.Q4_0,
                "Q4_1": Q.Q4_1, "Q5_0": Q.Q5_0, "Q5_1": Q.Q5_1, "Q4_K": Q.Q4_K, "Q5_K": Q.Q5_K,
                "Q6_K": Q.Q6_K}
ENGINE_WEIGHT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0")
FT = gguf.LlamaFileType
FILE_TYPES = {Q.F32: FT.ALL_F32, Q.F16: FT.MOSTLY_F16, Q.BF16: FT.MOSTLY_BF16,
               Q.Q8_0: FT.MOSTLY_Q8_0, Q.Q4_0: FT.MOSTLY_Q4_0, Q.Q4_1: FT.MOSTLY_Q4_1,
               Q.Q5_0: FT.MOSTLY_Q5_0, Q.Q5_1: FT.MOSTLY_Q5_1, Q.Q4_K: FT.MOSTLY_Q4_K_S,
               Q.Q5_K: FT.MOSTLY_Q5_K_S, Q.Q6_K: FT.MOSTLY_Q6_K}


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


def write_tensors(writer: gguf.GGUFWriter, weights: dict[str, np.ndarray], type_of) -> None:
    """Add every tensor of `weights` as type_of(name, value), write the file, close it."""
    for name, value in weights.items():
        add_tensor(writer, name, value, type_of(name, value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


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
