"""Small GGUF files for tests, and malformed variants of them.

Owns: `write_model`, which builds a small llama-shaped (or gemma3-shaped)
model with `gguf.GGUFWriter`, deterministic from a seed, in any mix of F32,
F16, Q8_0, Q4_0, Q5_0, Q4_K and Q6_K; and `GGUFImage`, which splits the bytes
of a valid file into its parts (located with the reference `gguf.GGUFReader`,
not with the code under test) so that a test can edit, drop, duplicate or
insert metadata entries and tensor infos and reassemble the bytes.

Nothing here is committed as a binary: every test builds its own files.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

DEFAULT_WEIGHT_TYPES = (Q.F16, Q.Q8_0, Q.Q4_0)
# Byte offsets of the f16 scale fields in one block of the K-quants we make from
# random bytes: set to sane values so `gguf.quants.dequantize` gives finite numbers.
_K_QUANT_SCALE_OFFSETS = {Q.Q4_K: (0, 2), Q.Q6_K: (208,)}


@dataclass(frozen=True)
class ModelShape:
    n_vocab: int = 64
    n_embd: int = 64
    n_ff: int = 128
    n_layer: int = 1
    n_head: int = 4


def write_model(path: str | Path, seed: int = 0, *, arch: str = "llama",
                weight_types: Sequence[Q] = DEFAULT_WEIGHT_TYPES,
                shape: ModelShape = ModelShape(), alignment: int | None = None) -> Path:
    """Write a small model: embeddings, one or more blocks, output.  Norms are
    F32; the matrices take `weight_types` in turn.  Same seed, same bytes."""
    path = Path(path)
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_name(f"test-{arch}-{seed}")
    writer.add_context_length(256)
    writer.add_embedding_length(shape.n_embd)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_block_count(shape.n_layer)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    _add_vocabulary(writer, shape.n_vocab)

    types = iter(_cycle(weight_types))
    for name, rows, cols in _matrices(shape):
        _add_matrix(writer, name, rng, rows, cols, next(types))
    for name in _norms(shape):
        writer.add_tensor(name, rng.standard_normal(shape.n_embd).astype(np.float32))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _cycle(items: Sequence[Q]):
    while True:
        yield from items


def _matrices(shape: ModelShape) -> list[tuple[str, int, int]]:
    """(name, rows, row length) of every weight matrix; row length is ggml's ne[0]."""
    e, f = shape.n_embd, shape.n_ff
    out = [("token_embd.weight", shape.n_vocab, e)]
    for i in range(shape.n_layer):
        out += [(f"blk.{i}.attn_q.weight", e, e), (f"blk.{i}.attn_k.weight", e, e),
                (f"blk.{i}.attn_v.weight", e, e), (f"blk.{i}.attn_output.weight", e, e),
                (f"blk.{i}.ffn_gate.weight", f, e), (f"blk.{i}.ffn_up.weight", f, e),
                (f"blk.{i}.ffn_down.weight", e, f)]
    out.append(("output.weight", shape.n_vocab, e))
    return out


def _norms(shape: ModelShape) -> list[str]:
    out = []
    for i in range(shape.n_layer):
        out += [f"blk.{i}.attn_norm.weight", f"blk.{i}.ffn_norm.weight"]
    return out + ["output_norm.weight"]


def _add_vocabulary(writer: gguf.GGUFWriter, n_vocab: int) -> None:
    specials = ["<unk>", "<s>", "</s>"]
    pieces = specials + [f"<0x{b:02X}>" for b in range(min(16, n_vocab - 3))]
    pieces += [f"\u2581tok{i}" for i in range(n_vocab - len(pieces))]
    types = [2, 3, 3] + [6] * min(16, n_vocab - 3) + [1] * (n_vocab - 3 - min(16, n_vocab - 3))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces)
    writer.add_token_scores([-float(i) for i in range(n_vocab)])
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)


def _add_matrix(writer: gguf.GGUFWriter, name: str, rng: np.random.Generator,
                rows: int, cols: int, qtype: Q) -> None:
    block_size = gguf.GGML_QUANT_SIZES[qtype][0]
    if cols % block_size:
        raise ValueError(f"{name}: row length {cols} is not a multiple of {qtype.name}'s block {block_size}")
    values = rng.standard_normal((rows, cols)).astype(np.float32)
    if qtype == Q.F32:
        writer.add_tensor(name, values)
    elif qtype == Q.F16:
        writer.add_tensor(name, values.astype(np.float16))
    elif qtype in _K_QUANT_SCALE_OFFSETS:
        writer.add_tensor(name, _random_k_blocks(rng, rows, cols, qtype), raw_dtype=qtype)
    else:
        writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)


def _random_k_blocks(rng: np.random.Generator, rows: int, cols: int, qtype: Q) -> np.ndarray:
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, cols // block_size, block_bytes), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    for off in _K_QUANT_SCALE_OFFSETS[qtype]:
        blocks[:, :, off:off + 2] = scale
    return blocks.reshape(rows, -1)


# --- raw encoding, independent of the code under test ----------------------------

_SCALAR_FORMATS = {V.UINT8: "<B", V.INT8: "<b", V.UINT16: "<H", V.INT16: "<h",
                   V.UINT32: "<I", V.INT32: "<i", V.FLOAT32: "<f", V.BOOL: "<B",
                   V.UINT64: "<Q", V.INT64: "<q", V.FLOAT64: "<d"}


def enc_string(s: str | bytes) -> bytes:
    data = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(data)) + data


def enc_value(vtype: V, value: Any, elem_type: V | None = None) -> bytes:
    """A value without its type tag; arrays need `elem_type`."""
    if vtype == V.STRING:
        return enc_string(value)
    if vtype == V.ARRAY:
        assert elem_type is not None
        body = b"".join(enc_value(elem_type, v) for v in value)
        return struct.pack("<IQ", elem_type, len(value)) + body
    return struct.pack(_SCALAR_FORMATS[vtype], value)


def enc_kv(key: str | bytes, vtype: V, value: Any, elem_type: V | None = None) -> bytes:
    return enc_string(key) + struct.pack("<I", vtype) + enc_value(vtype, value, elem_type)


def enc_tensor_info(name: str | bytes, dims: Sequence[int], raw_type: int, offset: int,
                    n_dims: int | None = None) -> bytes:
    """`n_dims` may disagree with len(dims), to make a lying count."""
    n = len(dims) if n_dims is None else n_dims
    return (enc_string(name) + struct.pack("<I", n)
            + b"".join(struct.pack("<Q", d) for d in dims)
            + struct.pack("<IQ", raw_type, offset))


# --- the parts of a valid file -----------------------------------------------------

@dataclass
class TensorEntry:
    name: str
    dims: list[int]
    raw_type: int
    offset: int             # relative to the data section
    raw: bytes | None = None  # when set, written as is instead of re-encoding


@dataclass
class GGUFImage:
    """A valid GGUF file taken apart.  `kvs` holds (key, raw bytes of the
    whole entry); edit the lists, then `build()` reassembles a file with the
    counts in the header matching the lists (unless overridden)."""

    magic: bytes
    version: int
    kvs: list[tuple[str, bytes]]
    tensors: list[TensorEntry]
    data: bytes
    alignment: int
    tensor_count: int | None = None  # header overrides
    kv_count: int | None = None

    @classmethod
    def from_file(cls, path: str | Path) -> "GGUFImage":
        raw = Path(path).read_bytes()
        reader = gguf.GGUFReader(str(path))
        kvs = []
        for name, f in reader.fields.items():
            if name.startswith("GGUF."):
                continue
            size = sum(int(p.nbytes) for p in f.parts)
            kvs.append((name, raw[f.offset:f.offset + size]))
        tensors = [TensorEntry(t.name, [int(d) for d in t.shape], int(t.tensor_type),
                               int(t.data_offset - reader.data_offset)) for t in reader.tensors]
        image = cls(magic=raw[:4], version=int(struct.unpack_from("<I", raw, 4)[0]), kvs=kvs,
                    tensors=tensors, data=raw[reader.data_offset:], alignment=int(reader.alignment))
        del reader  # closes its memmap
        return image

    def build(self) -> bytes:
        tcount = len(self.tensors) if self.tensor_count is None else self.tensor_count
        kcount = len(self.kvs) if self.kv_count is None else self.kv_count
        head = self.magic + struct.pack("<IQQ", self.version, tcount, kcount)
        head += b"".join(raw for _, raw in self.kvs)
        head += b"".join(t.raw if t.raw is not None else
                         enc_tensor_info(t.name, t.dims, t.raw_type, t.offset)
                         for t in self.tensors)
        pad = -len(head) % self.alignment
        return head + b"\0" * pad + self.data

    def write(self, path: str | Path) -> Path:
        Path(path).write_bytes(self.build())
        return Path(path)

    # edits used by many tests
    def kv_index(self, key: str) -> int:
        return next(i for i, (k, _) in enumerate(self.kvs) if k == key)

    def set_kv(self, key: str, vtype: V, value: Any, elem_type: V | None = None) -> "GGUFImage":
        """Replace the entry for `key`, or append one."""
        entry = (key, enc_kv(key, vtype, value, elem_type))
        try:
            self.kvs[self.kv_index(key)] = entry
        except StopIteration:
            self.kvs.append(entry)
        return self

    def set_kv_raw(self, key: str, raw: bytes) -> "GGUFImage":
        """Replace the entry for `key` (or append) with bytes made by hand."""
        try:
            self.kvs[self.kv_index(key)] = (key, raw)
        except StopIteration:
            self.kvs.append((key, raw))
        return self

    def drop_kv(self, key: str) -> "GGUFImage":
        del self.kvs[self.kv_index(key)]
        return self

    def tensor(self, name: str) -> TensorEntry:
        return next(t for t in self.tensors if t.name == name)


def patch(data: bytes, offset: int, fmt: str, value: Any) -> bytes:
    """`data` with one packed value overwritten in place."""
    out = bytearray(data)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)
