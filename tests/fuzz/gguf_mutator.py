"""A structure-aware mutator for GGUF files, used by tests/fuzz/fuzz_gguf.py
beside libFuzzer's byte-level mutations.

Byte flips rarely get past the parser's bounds to the checks behind it
(engine hyper-parameters, vocabularies, projector shapes): a changed
dimension makes the tensor overlap its neighbour, a retyped value shifts
every byte after it.  This mutator takes a file apart (leniently: anything
it cannot read is left to the byte mutations), changes one thing as a
file's author could — a value's type or value, a key's name, a tensor's
shape, type, name or offset, an entry added, dropped or repeated — and
puts it back together with consistent counts and, most of the time, a
valid data layout, so that the change reaches the check that owns it.

Deterministic: `mutate(data, max_size, seed)` gives the same bytes for the same arguments.
"""

from __future__ import annotations

import random
import struct
from dataclasses import dataclass, field

# GGUF value types (gguf.GGUFValueType), spelled out so this module imports nothing of the code under test.
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
_FMT = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<B",
        U64: "<Q", I64: "<q", F64: "<d"}
_INT_TYPES = (U8, I8, U16, I16, U32, I32, U64, I64)
_SIZE = {t: struct.calcsize(f) for t, f in _FMT.items()}

INTERESTING_INTS = [0, 1, 2, 3, 4, 7, 8, 16, 31, 32, 33, 62, 63, 64, 127, 128, 255, 256, 1023, 1024, 4095,
                    4096, 4097, 65535, 65536, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, 1 << 53,
                    1 << 62, (1 << 63) - 1, 1 << 63, (1 << 64) - 1, -1, -2, -(1 << 31), -(1 << 63)]
INTERESTING_FLOATS = [0.0, -0.0, 1e-6, 1e-5, 0.5, 1.0, 2.0, 30.0, 1e4, 1e6, 1e38, -1.0,
                      float("nan"), float("inf"), float("-inf")]
ARCHES = ["llama", "qwen2", "gemma3", "qwen3moe", "qwen2moe", "clip", "mystery"]
STRINGS = ["", "a", "llama", "gpt2", "none", "linear", "yarn", "mlp", "gemma3", "ldp", "qwen2", "llama3",
           "default", "<s>", "</s>", "<unk>", "<0x41>", "<0xZZ>", "\u2581", "a b", " ", "\u0120 a",
           "{{ x }}", "{% for m in messages %}{{ m['content'] }}{% endfor %}",
           "{{ " + "(" * 400 + "1" + ")" * 400 + " }}", "{% if %}", "{{ raise_exception('x') }}",
           "\ud7ff", "x" * 1100, "\xe9" * 600]
# Keys vramd reads; "{a}" is the file's architecture.
KEYS = ["general.architecture", "general.alignment", "general.name",
        "{a}.block_count", "{a}.embedding_length", "{a}.feed_forward_length", "{a}.context_length",
        "{a}.attention.head_count", "{a}.attention.head_count_kv", "{a}.attention.key_length",
        "{a}.attention.value_length", "{a}.attention.layer_norm_rms_epsilon",
        "{a}.attention.sliding_window", "{a}.rope.dimension_count", "{a}.rope.freq_base",
        "{a}.rope.scaling.type", "{a}.rope.scaling.factor", "{a}.rope.scale_linear",
        "{a}.final_logit_softcapping", "{a}.expert_count", "{a}.expert_used_count",
        "{a}.expert_feed_forward_length", "{a}.expert_shared_feed_forward_length",
        "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.scores",
        "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.unknown_token_id",
        "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token",
        "tokenizer.ggml.add_space_prefix", "tokenizer.chat_template",
        "clip.has_vision_encoder", "clip.projector_type", "clip.vision.projector_type", "clip.use_gelu",
        "clip.use_silu", "clip.vision.image_size", "clip.vision.patch_size", "clip.vision.embedding_length",
        "clip.vision.attention.head_count", "clip.vision.block_count", "clip.vision.feed_forward_length",
        "clip.vision.attention.layer_norm_epsilon", "clip.vision.projection_dim",
        "clip.vision.image_mean", "clip.vision.image_std", "clip.vision.feature_layer",
        "clip.vision.projector.scale_factor"]
TENSOR_NAMES = ["token_embd.weight", "output.weight", "output_norm.weight", "blk.0.attn_q.weight",
                "blk.0.attn_k.weight", "blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight",
                "blk.0.ffn_down_exps.weight", "blk.1.ffn_gate_exps.weight", "blk.7.ffn_up_exps.weight",
                "v.patch_embd.weight", "v.position_embd.weight", "v.class_embd", "v.blk.0.ffn_down.weight",
                "v.blk.0.ffn_up.weight", "mm.0.weight", "mm.2.weight", "mm.input_projection.weight",
                "mm.soft_emb_norm.weight", "v.pre_ln.bias", "v.post_ln.weight"]
# ggml types: (id, block size, bytes per block) for those with a layout, plus ids that have none.
TENSOR_TYPES = [(0, 1, 4), (1, 1, 2), (2, 32, 18), (3, 32, 20), (6, 32, 22), (7, 32, 24), (8, 32, 34),
                (12, 256, 144), (14, 256, 210), (24, 1, 1), (26, 1, 4), (28, 1, 8), (30, 1, 2)]
BAD_TENSOR_TYPES = [4, 5, 39, 40, 1000, (1 << 31), (1 << 32) - 1]


@dataclass
class KV:
    key: bytes
    vtype: int
    raw: bytes          # the encoded value (after the type tag)


@dataclass
class Tensor:
    name: bytes
    dims: list[int]
    ttype: int
    offset: int


@dataclass
class Image:
    version: int
    kvs: list[KV] = field(default_factory=list)
    tensors: list[Tensor] = field(default_factory=list)
    data: bytes = b""


# --- lenient parsing ---------------------------------------------------------------

class _Stop(Exception):
    pass


def _take(data: bytes, pos: int, n: int) -> bytes:
    if n < 0 or pos + n > len(data):
        raise _Stop
    return data[pos:pos + n]


def _u(data: bytes, pos: int, fmt: str) -> int:
    return struct.unpack(fmt, _take(data, pos, struct.calcsize(fmt)))[0]


def _value_end(data: bytes, pos: int, vtype: int, depth: int = 0) -> int:
    if vtype in _SIZE:
        return pos + _SIZE[vtype]
    if vtype == STR:
        return pos + 8 + _u(data, pos, "<Q")
    if vtype == ARR and depth < 3:
        etype, count = _u(data, pos, "<I"), _u(data, pos + 4, "<Q")
        pos += 12
        if etype in _SIZE:
            return pos + count * _SIZE[etype]
        if count > len(data):
            raise _Stop
        for _ in range(count):
            pos = _value_end(data, pos, etype, depth + 1)
            if pos > len(data):
                raise _Stop
        return pos
    raise _Stop


def parse(data: bytes) -> Image | None:
    try:
        if _take(data, 0, 4) != b"GGUF":
            return None
        version, n_tensors, n_kv = _u(data, 4, "<I"), _u(data, 8, "<Q"), _u(data, 16, "<Q")
        if n_tensors > 4096 or n_kv > 4096:
            return None
        image, pos = Image(version), 24
        for _ in range(n_kv):
            n = _u(data, pos, "<Q")
            key = _take(data, pos + 8, n)
            vtype = _u(data, pos + 8 + n, "<I")
            start = pos + 12 + n
            pos = _value_end(data, start, vtype)
            image.kvs.append(KV(key, vtype, _take(data, start, pos - start)))
        for _ in range(n_tensors):
            n = _u(data, pos, "<Q")
            name = _take(data, pos + 8, n)
            pos += 8 + n
            n_dims = _u(data, pos, "<I")
            if n_dims > 8:
                return None
            dims = [_u(data, pos + 4 + 8 * i, "<Q") for i in range(n_dims)]
            pos += 4 + 8 * n_dims
            image.tensors.append(Tensor(name, dims, _u(data, pos, "<I"), _u(data, pos + 4, "<Q")))
            pos += 12
        image.data = data[_align(pos, _alignment(image)):]
        return image
    except (_Stop, struct.error):
        return None


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _alignment(image: Image) -> int:
    for kv in image.kvs:
        if kv.key == b"general.alignment" and kv.vtype == U32 and len(kv.raw) == 4:
            a = struct.unpack("<I", kv.raw)[0]
            if a and not a & (a - 1) and a <= 1 << 16:
                return a
    return 32


def _string(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def build(image: Image) -> bytes:
    out = [b"GGUF", struct.pack("<IQQ", image.version, len(image.tensors), len(image.kvs))]
    for kv in image.kvs:
        out += [_string(kv.key), struct.pack("<I", kv.vtype), kv.raw]
    for t in image.tensors:
        out += [_string(t.name), struct.pack("<I", len(t.dims)),
                b"".join(struct.pack("<Q", d & ((1 << 64) - 1)) for d in t.dims),
                struct.pack("<IQ", t.ttype & 0xFFFFFFFF, t.offset & ((1 << 64) - 1))]
    head = b"".join(out)
    return head + b"\0" * (-len(head) % _alignment(image)) + image.data


def _nbytes(t: Tensor) -> int | None:
    layout = next(((b, s) for i, b, s in TENSOR_TYPES if i == t.ttype), None)
    if layout is None or not t.dims or min(t.dims) < 1:
        return None
    n = 1
    for d in t.dims:
        n *= d
    return n // layout[0] * layout[1]


def relayout(image: Image, max_data: int) -> bool:
    """Give every tensor an aligned offset of its own and enough data; False if it would not fit."""
    a, pos = _alignment(image), 0
    for t in image.tensors:
        n = _nbytes(t)
        if n is None:
            n = 0
        t.offset = pos
        pos = _align(pos + n, a)
        if pos > max_data:
            return False
    if len(image.data) < pos:
        image.data += bytes(pos - len(image.data))
    else:
        image.data = image.data[:pos]
    return True


# --- values -------------------------------------------------------------------------------

def _scalar(rng: random.Random, vtype: int) -> bytes:
    if vtype == BOOL:
        return bytes([rng.choice([0, 1, 1, 2])])
    if vtype in (F32, F64):
        return struct.pack(_FMT[vtype], rng.choice(INTERESTING_FLOATS))
    bits = 8 * _SIZE[vtype]
    value = rng.choice(INTERESTING_INTS + [rng.randrange(0, 1 << bits)])
    return (value & ((1 << bits) - 1)).to_bytes(_SIZE[vtype], "little")


def _random_string(rng: random.Random) -> bytes:
    if rng.random() < 0.1:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(8)))
    return rng.choice(STRINGS).encode("utf-8", "surrogatepass")


def _value(rng: random.Random, vtype: int, depth: int = 0) -> bytes:
    if vtype == STR:
        return _string(_random_string(rng))
    if vtype == ARR:
        etype = rng.choice([U8, I32, U32, F32, STR, STR, ARR] if depth < 2 else [I32, F32, STR])
        count = rng.choice([0, 1, 2, 3, 3, 4, 13, 17])
        return struct.pack("<IQ", etype, count) + b"".join(_value(rng, etype, depth + 1) for _ in range(count))
    return _scalar(rng, vtype)


def _arch(image: Image) -> str:
    for kv in image.kvs:
        if kv.key == b"general.architecture" and kv.vtype == STR:
            return kv.raw[8:].decode("utf-8", "replace")
    return "llama"


def _known_key(rng: random.Random, image: Image) -> bytes:
    arch = _arch(image) if rng.random() < 0.8 else rng.choice(ARCHES)
    return rng.choice(KEYS).format(a=arch).encode()


# --- mutations ------------------------------------------------------------------------------

def _mutate_kv(rng: random.Random, image: Image) -> None:
    if not image.kvs:
        image.kvs.append(KV(_known_key(rng, image), U32, _scalar(rng, U32)))
        return
    i = rng.randrange(len(image.kvs))
    kv = image.kvs[i]
    what = rng.randrange(9)
    if what <= 2:                       # same type, another value
        kv.raw = _value(rng, kv.vtype) if kv.vtype in _SIZE or kv.vtype in (STR, ARR) else kv.raw
    elif what == 3:                     # another type
        kv.vtype = rng.choice(list(_FMT) + [STR, ARR])
        kv.raw = _value(rng, kv.vtype)
    elif what == 4:                     # array: retype its elements, or change one
        if kv.vtype == ARR and len(kv.raw) >= 12:
            etype, count = struct.unpack_from("<IQ", kv.raw)
            new = rng.choice(list(_FMT) + [STR, ARR])
            count = min(count, 64)
            kv.raw = struct.pack("<IQ", new, count) + b"".join(_value(rng, new, 1) for _ in range(count))
        else:
            kv.raw = _value(rng, ARR)
    elif what == 5:
        kv.key = _known_key(rng, image)
    elif what == 6:
        image.kvs.insert(rng.randrange(len(image.kvs) + 1),
                         KV(_known_key(rng, image), (t := rng.choice(list(_FMT) + [STR, ARR])), _value(rng, t)))
    elif what == 7:
        del image.kvs[i]
    else:
        image.kvs.insert(rng.randrange(len(image.kvs) + 1), KV(kv.key, kv.vtype, kv.raw))


def _dim(rng: random.Random, old: int) -> int:
    return rng.choice([1, 2, 3, 4, 8, 16, 32, 64, 256, old * 2, max(old // 2, 1), old + 1, 0,
                       (1 << 64) - 1, 1 << 32, 1 << 62])


def _mutate_tensor(rng: random.Random, image: Image) -> None:
    if not image.tensors:
        image.tensors.append(Tensor(rng.choice(TENSOR_NAMES).encode(), [8], 0, 0))
        return
    i = rng.randrange(len(image.tensors))
    t = image.tensors[i]
    what = rng.randrange(8)
    if what <= 1 and t.dims:
        j = rng.randrange(len(t.dims))
        t.dims[j] = _dim(rng, t.dims[j])
    elif what == 2:
        if rng.random() < 0.5 and len(t.dims) > 1:
            t.dims.pop(rng.randrange(len(t.dims)))
        else:
            t.dims.insert(rng.randrange(len(t.dims) + 1), rng.choice([1, 2, 4, 8]))
    elif what == 3:
        t.ttype = rng.choice([x[0] for x in TENSOR_TYPES] + BAD_TENSOR_TYPES[:2] * (rng.random() < 0.2))
    elif what == 4:
        t.name = rng.choice(TENSOR_NAMES + [n.name.decode("utf-8", "replace") for n in image.tensors]).encode()
    elif what == 5:
        del image.tensors[i]
    elif what == 6:
        image.tensors.insert(rng.randrange(len(image.tensors) + 1),
                             Tensor(rng.choice(TENSOR_NAMES).encode(), list(t.dims), t.ttype, t.offset))
    else:
        t.offset = rng.choice([t.offset + 1, t.offset + 32, t.offset - 32, 0, (1 << 64) - 32, 1 << 40])


def mutate(data: bytes, max_size: int, seed: int) -> bytes | None:
    """A structural mutation of `data`, or None when it cannot be parsed (or the result is too big)."""
    image = parse(data)
    if image is None:
        return None
    rng = random.Random(seed)
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        if rng.random() < 0.6:
            _mutate_kv(rng, image)
        else:
            _mutate_tensor(rng, image)
    head = len(build(Image(image.version, image.kvs, image.tensors, b"")))
    if rng.random() < 0.85 and not relayout(image, max_size - head - 64):
        return None
    out = build(image)
    return out if len(out) <= max_size else None
