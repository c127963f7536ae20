"""Validation of untrusted GGUF model files.

Owns: reading a GGUF file's header (magic, version, metadata key/values and
tensor infos) with strict bounds, checking it against the malformations that
have broken GGUF readers before (brief §9: huge counts and lengths, nested
arrays, bad dimensions, size overflows, bad alignment, duplicates, tensor data
out of bounds / misaligned / overlapping, tokenizer arrays), and handing back
a `ModelFile`: a parsed, trustworthy description from which a loader reads
tensor data straight out of the file (mmap or pread) without parsing again.

Does not own: reading tensor data (vramd.model.loader) or tokenizing.

Why a parser of our own and not `gguf.GGUFReader`: that reader trusts every
count it reads (it hung on an array length of 2^63 and recursed on nested
arrays), raises assorted non-vramd exceptions, and builds one numpy view per
array element (slow on a 262144-token vocabulary).  The header format is
small; this module parses it with a bound on every read and takes the
format's constants (value types, tensor types, block sizes) from `gguf`.

Entry points: `validate_gguf(path)`, and `validate_gguf_bytes(data)` for
fuzzers.  Every rejection is a `vramd.errors.ModelError` whose message is one
line: `<path>: <problem>`.  Nothing is allocated from a count before that count has
been checked against the bytes the file can still hold.
"""

from __future__ import annotations

import os
import stat
import struct
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from vramd.engine.arch import ARCHITECTURES
from vramd.engine.arch.hparams import MAX_BY_KEY, MAX_HPARAM, REQUIRED_KEYS
from vramd.errors import ModelError

GGUF_MAGIC = b"GGUF"
# Version 1 used 32-bit counts; 2 and 3 share today's layout (3 added big-endian files).
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# Bounds.  Each is far above what real models use and far below what would
# let a hostile file make us allocate or loop without end.
# Metadata + tensor infos.  Gemma 3's 262k-token vocabulary is 6.5 MB; the cap also bounds the
# Python objects made from the header (a 4-byte float becomes a 24-byte object).
MAX_HEADER_BYTES = 64 << 20
MAX_TENSORS = 1 << 16
MAX_KV = 1 << 16
MAX_KEY_BYTES = 1024
MAX_TENSOR_NAME_BYTES = 256
MAX_STRING_BYTES = 16 << 20         # chat templates are the longest strings, ~100 KiB
MAX_ARRAY_ELEMENTS = 1 << 24
MAX_ARRAY_NESTING = 2               # an array of arrays of scalars, no deeper
MAX_DIMS = 4                        # GGML_MAX_DIMS
MAX_ALIGNMENT = 1 << 16
MAX_TOKEN_PIECE_BYTES = 1024        # CVE-2025-49847: pieces that overflow a caller's buffer
INT64_MAX = (1 << 63) - 1

_V = GGUFValueType
# struct format of each fixed-size value type (all little-endian: big-endian files are refused).
_SCALAR_FORMATS: dict[GGUFValueType, str] = {
    _V.UINT8: "<B", _V.INT8: "<b", _V.UINT16: "<H", _V.INT16: "<h",
    _V.UINT32: "<I", _V.INT32: "<i", _V.FLOAT32: "<f", _V.BOOL: "<B",
    _V.UINT64: "<Q", _V.INT64: "<q", _V.FLOAT64: "<d",
}
_NUMPY_DTYPES: dict[GGUFValueType, str] = {
    _V.UINT8: "<u1", _V.INT8: "<i1", _V.UINT16: "<u2", _V.INT16: "<i2",
    _V.UINT32: "<u4", _V.INT32: "<i4", _V.FLOAT32: "<f4", _V.BOOL: "<u1",
    _V.UINT64: "<u8", _V.INT64: "<i8", _V.FLOAT64: "<f8",
}
_INTEGER_TYPES = frozenset({_V.UINT8, _V.INT8, _V.UINT16, _V.INT16, _V.UINT32,
                            _V.INT32, _V.UINT64, _V.INT64})
# The fewest bytes one element of each type occupies: what bounds a count.
_MIN_VALUE_BYTES: dict[GGUFValueType, int] = {
    **{t: struct.calcsize(f) for t, f in _SCALAR_FORMATS.items()},
    _V.STRING: 8,           # the length, for an empty string
    _V.ARRAY: 12,           # element type + count, for an empty array
}
# key length + 1-byte key + value type + 1-byte value
_MIN_KV_BYTES = 8 + 1 + 4 + 1
# name length + 1-byte name + n_dims + one dimension + type + offset
_MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 8 + 4 + 8

# Tensor types vramd knows the block layout of: {raw type: (block size, bytes per block)}.
_TYPE_SIZES: dict[int, tuple[int, int]] = {int(t): s for t, s in GGML_QUANT_SIZES.items()}

# Keys an architecture cannot be run without, beyond general.architecture, and
# their bounds: the engine's one metadata reader (vramd/engine/arch/hparams.py)
# says which, for every architecture its registry runs, so that a loader sizing
# buffers from them never multiplies absurd numbers.
REQUIRED_KEYS_BY_ARCH: dict[str, tuple[str, ...]] = {arch: REQUIRED_KEYS for arch in ARCHITECTURES}
_REQUIRED_KEY_MAX = {key: MAX_BY_KEY.get(key, MAX_HPARAM) for key in REQUIRED_KEYS}

TOKENS_KEY = "tokenizer.ggml.tokens"
# Arrays that run parallel to the token list: {key: element type}.
_PER_TOKEN_ARRAYS = {"tokenizer.ggml.scores": _V.FLOAT32,
                     "tokenizer.ggml.token_type": _V.INT32}
_TOKEN_TYPE_RANGE = range(0, 7)     # llama.cpp's UNDEFINED..BYTE
MERGES_KEY = "tokenizer.ggml.merges"


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as validated: its data lies at [offset, offset + nbytes) of the file."""

    name: str
    type: GGMLQuantizationType
    shape: tuple[int, ...]      # ggml order: shape[0] is the row length (fastest-varying)
    n_elements: int
    offset: int                 # absolute, in the file
    nbytes: int

    @property
    def numpy_shape(self) -> tuple[int, ...]:
        """The shape in numpy (row-major) order, for unquantized types."""
        return tuple(reversed(self.shape))


@dataclass(frozen=True)
class ModelFile:
    """A validated GGUF file.  `identity` lets a loader notice that the file
    changed between validation and reading (compare with os.fstat).
    `warnings` name problems that were repaired rather than refused, as
    llama.cpp does (today: special token ids outside the vocabulary, which are
    dropped from `metadata`); a daemon logs them."""

    path: str
    version: int
    alignment: int
    architecture: str
    metadata: dict[str, Any]        # plain Python values: int, float, bool, str, lists
    tensors: tuple[TensorInfo, ...]  # in file order
    data_offset: int                # start of the tensor data section
    file_size: int
    warnings: tuple[str, ...]
    identity: tuple[int, int, int, int] = field(repr=False)  # st_dev, st_ino, st_size, st_mtime_ns

    def tensor(self, name: str) -> TensorInfo:
        for t in self.tensors:
            if t.name == name:
                return t
        raise ModelError(f"{self.path}: no tensor named {name!r}")

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def validate_gguf(path: str | os.PathLike[str]) -> ModelFile:
    """Validate the GGUF file at `path` and describe it; raise ModelError if it is malformed."""
    label = os.fspath(path)
    fd = _open_regular_file(label)
    try:
        st = os.fstat(fd)

        def read_at(offset: int, n: int) -> bytes:
            try:
                return os.pread(fd, n, offset)
            except OSError as e:
                raise ModelError(f"{label}: read error at offset {offset}: {e.strerror}") from None

        model = _parse(_BoundedSource(read_at, st.st_size, label))
        return ModelFile(identity=(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns), **model)
    finally:
        os.close(fd)


def validate_gguf_bytes(data: bytes, label: str = "<memory>") -> ModelFile:
    """The same checks on a file's bytes held in memory (for fuzzers and tests).
    Offsets in the result are offsets into `data`; `identity` is all zeros but the size."""
    view = bytes(data)
    model = _parse(_BoundedSource(lambda offset, n: view[offset:offset + n], len(view), label))
    return ModelFile(identity=(0, 0, len(view), 0), **model)


# --- opening -----------------------------------------------------------------

def _open_regular_file(label: str) -> int:
    # O_NONBLOCK: opening a FIFO planted at the path must not hang us.
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
    try:
        fd = os.open(label, flags)
    except FileNotFoundError:
        raise ModelError(f"{label}: no such file") from None
    except OSError as e:
        raise ModelError(f"{label}: cannot open: {e.strerror}") from None
    except ValueError:  # a NUL byte in the path
        raise ModelError(f"{label!r}: not a valid path") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "is a directory" if stat.S_ISDIR(mode) else "is not a regular file"
        raise ModelError(f"{label}: {kind}")
    return fd


# --- bounded reading ---------------------------------------------------------

class _BoundedSource:
    """Sequential reads of the header that never go past the end of the file
    nor past MAX_HEADER_BYTES.  Reads with pread into a growing buffer rather
    than mmap, so a file truncated under us is an error, not a SIGBUS."""

    def __init__(self, read_at: Callable[[int, int], bytes], size: int, label: str):
        self.read_at = read_at      # (offset, n) -> up to n bytes; b"" at the end
        self.size = size
        self.label = label
        self.buf = b""
        self.pos = 0

    def fail(self, problem: str) -> ModelError:
        return ModelError(f"{self.label}: {problem}")

    @property
    def remaining(self) -> int:
        return self.size - self.pos

    def need(self, n: int, what: str) -> None:
        """Make [pos, pos + n) readable from self.buf, or fail."""
        end = self.pos + n
        if end <= len(self.buf):
            return
        if end > self.size:
            raise self.fail(f"truncated: {what} at offset {self.pos} needs {n} bytes, "
                            f"file ends at {self.size}")
        if end > MAX_HEADER_BYTES:
            raise self.fail(f"header larger than {MAX_HEADER_BYTES} bytes (at {what})")
        # Grow geometrically so a header of many small values costs few reads.
        target = min(self.size, MAX_HEADER_BYTES, max(end, 2 * len(self.buf), 1 << 20))
        chunks = [self.buf]
        have = len(self.buf)
        while have < end:
            chunk = self.read_at(have, target - have)
            if not chunk:
                raise self.fail(f"truncated: file shrank while reading (at offset {have})")
            chunks.append(chunk)
            have += len(chunk)
        self.buf = b"".join(chunks)

    def unpack(self, fmt: str, size: int, what: str) -> Any:
        self.need(size, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def u32(self, what: str) -> int:
        return self.unpack("<I", 4, what)

    def u64(self, what: str) -> int:
        return self.unpack("<Q", 8, what)

    def check_string_length(self, n: int, what: str, max_bytes: int) -> None:
        # CVE-2024-23496: a length is checked before anything is read or allocated from it.
        if n > max_bytes:
            raise self.fail(f"{what}: string length {n} exceeds the limit {max_bytes}")
        if n > self.remaining:
            raise self.fail(f"{what}: string length {n} beyond end of file "
                            f"({self.remaining} bytes left at offset {self.pos})")

    def raw_string(self, what: str, max_bytes: int) -> bytes:
        n = self.u64(f"{what} length")
        self.check_string_length(n, what, max_bytes)
        self.need(n, what)
        data = self.buf[self.pos:self.pos + n]
        self.pos += n
        return data

    def text(self, what: str, max_bytes: int) -> str:
        return self.decode(self.raw_string(what, max_bytes), what)

    def decode(self, data: bytes, what: str) -> str:
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not valid UTF-8 (byte {e.start})") from None

    def numbers(self, vtype: GGUFValueType, count: int, what: str) -> list:
        dtype = np.dtype(_NUMPY_DTYPES[vtype])
        nbytes = count * dtype.itemsize
        self.need(nbytes, what)
        values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
        self.pos += nbytes
        if vtype == _V.BOOL and count and int(values.max()) > 1:
            raise self.fail(f"{what}: bool array holds a value other than 0 or 1")
        result = values.tolist()
        return [bool(v) for v in result] if vtype == _V.BOOL else result


# --- the header ----------------------------------------------------------------

def _parse(src: _BoundedSource) -> dict[str, Any]:
    version = _read_preamble(src)
    tensor_count, kv_count = _read_counts(src)
    metadata, types = _read_metadata(src, kv_count)
    alignment = _check_alignment(src, metadata, types)
    architecture = _check_required_keys(src, metadata, types)
    warnings = _check_tokenizer(src, metadata, types)
    raw_infos = _read_tensor_infos(src, tensor_count)
    data_offset = _align_up(src.pos, alignment)
    tensors = _check_tensors(src, raw_infos, alignment, data_offset)
    return dict(path=src.label, version=version, alignment=alignment, architecture=architecture,
                metadata=metadata, tensors=tuple(tensors), data_offset=data_offset,
                file_size=src.size, warnings=tuple(warnings))


def _read_preamble(src: _BoundedSource) -> int:
    if src.size == 0:
        raise src.fail("empty file")
    src.need(4, "magic")
    magic = src.buf[:4]
    if magic != GGUF_MAGIC:
        raise src.fail(f"not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    src.pos = 4
    version = src.u32("version")
    if version & 0xFFFF == 0 and int.from_bytes(version.to_bytes(4, "little"), "big") in SUPPORTED_VERSIONS:
        raise src.fail("big-endian GGUF files are not supported")
    if version not in SUPPORTED_VERSIONS:
        raise src.fail(f"unsupported GGUF version {version} (supported: "
                       f"{', '.join(map(str, SUPPORTED_VERSIONS))})")
    return version


def _read_counts(src: _BoundedSource) -> tuple[int, int]:
    tensor_count = src.u64("tensor count")
    kv_count = src.u64("metadata count")
    # The counts are checked against what the rest of the file could hold
    # before anything is sized from them (CVE-2024-21836, CVE-2024-23605).
    if kv_count > MAX_KV:
        raise src.fail(f"metadata count {kv_count} exceeds the limit {MAX_KV}")
    if tensor_count > MAX_TENSORS:
        raise src.fail(f"tensor count {tensor_count} exceeds the limit {MAX_TENSORS}")
    kv_min = kv_count * _MIN_KV_BYTES
    if kv_min > src.remaining:
        raise src.fail(f"metadata count {kv_count} needs at least {kv_min} bytes, "
                       f"the file has {src.remaining} left")
    ti_min = tensor_count * _MIN_TENSOR_INFO_BYTES
    if kv_min + ti_min > src.remaining:
        raise src.fail(f"tensor count {tensor_count} needs at least {ti_min} bytes of tensor "
                       f"infos, the file has {src.remaining - kv_min} left")
    return tensor_count, kv_count


def _value_type(src: _BoundedSource, raw: int, what: str) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise src.fail(f"{what}: unknown value type {raw}") from None


def _read_metadata(src: _BoundedSource, kv_count: int
                   ) -> tuple[dict[str, Any], dict[str, tuple[GGUFValueType, ...]]]:
    """Returns the values and, per key, its type path (e.g. (ARRAY, STRING))."""
    metadata: dict[str, Any] = {}
    types: dict[str, tuple[GGUFValueType, ...]] = {}
    for index in range(kv_count):
        start = src.pos
        key = src.text(f"metadata key #{index}", MAX_KEY_BYTES)
        if not key:
            raise src.fail(f"metadata key #{index} at offset {start} is empty")
        what = f"metadata {key!r}"
        if key in metadata:
            raise src.fail(f"duplicate metadata key {key!r} (second at offset {start})")
        vtype = _value_type(src, src.u32(f"{what} type"), what)
        metadata[key], types[key] = _read_value(src, vtype, what, depth=0)
    return metadata, types


def _read_value(src: _BoundedSource, vtype: GGUFValueType, what: str, depth: int
                ) -> tuple[Any, tuple[GGUFValueType, ...]]:
    if vtype == _V.STRING:
        return src.text(what, MAX_STRING_BYTES), (vtype,)
    if vtype == _V.ARRAY:
        return _read_array(src, what, depth + 1)
    value = src.unpack(_SCALAR_FORMATS[vtype], _MIN_VALUE_BYTES[vtype], what)
    if vtype == _V.BOOL:
        if value > 1:
            raise src.fail(f"{what}: bool value {value} is neither 0 nor 1")
        value = bool(value)
    return value, (vtype,)


def _read_array(src: _BoundedSource, what: str, depth: int
                ) -> tuple[list, tuple[GGUFValueType, ...]]:
    etype = _value_type(src, src.u32(f"{what} element type"), what)
    if etype == _V.ARRAY and depth >= MAX_ARRAY_NESTING:
        raise src.fail(f"{what}: arrays nested deeper than {MAX_ARRAY_NESTING} levels")
    count = src.u64(f"{what} element count")
    if count > MAX_ARRAY_ELEMENTS:
        raise src.fail(f"{what}: array of {count} elements exceeds the limit {MAX_ARRAY_ELEMENTS}")
    least = count * _MIN_VALUE_BYTES[etype]
    if least > src.remaining:
        raise src.fail(f"{what}: array of {count} {etype.name} elements needs at least "
                       f"{least} bytes, the file has {src.remaining} left")
    if etype in _NUMPY_DTYPES:
        return src.numbers(etype, count, what), (_V.ARRAY, etype)
    if etype == _V.STRING:
        # Token lists hold up to ~10^6 strings: read them without per-item method calls.
        return _read_string_array(src, count, what), (_V.ARRAY, _V.STRING)
    items, sub = [], (etype,)
    for i in range(count):
        item, sub = _read_array(src, f"{what}[{i}]", depth + 1)
        items.append(item)
    return items, (_V.ARRAY, *sub)


def _read_string_array(src: _BoundedSource, count: int, what: str) -> list[str]:
    items: list[str] = []
    unpack_from = struct.unpack_from
    for i in range(count):
        if src.pos + 8 > len(src.buf):
            src.need(8, f"{what}[{i}] length")
        (n,) = unpack_from("<Q", src.buf, src.pos)
        src.pos += 8
        if n > MAX_STRING_BYTES or n > src.remaining:
            src.check_string_length(n, f"{what}[{i}]", MAX_STRING_BYTES)
        if src.pos + n > len(src.buf):
            src.need(n, f"{what}[{i}]")
        data = src.buf[src.pos:src.pos + n]
        src.pos += n
        try:
            items.append(data.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise src.fail(f"{what}[{i}] is not valid UTF-8 (byte {e.start})") from None
    return items


# --- metadata checks -----------------------------------------------------------

def _type_name(path: tuple[GGUFValueType, ...]) -> str:
    return " of ".join(t.name for t in path)


def _check_alignment(src: _BoundedSource, metadata: dict[str, Any],
                     types: dict[str, tuple[GGUFValueType, ...]]) -> int:
    key = "general.alignment"
    if key not in metadata:
        return DEFAULT_ALIGNMENT
    if types[key] != (_V.UINT32,):
        raise src.fail(f"{key} must be a UINT32, got {_type_name(types[key])}")
    value = metadata[key]
    if value == 0 or value & (value - 1):
        raise src.fail(f"{key} {value} is not a power of two")
    if value > MAX_ALIGNMENT:
        raise src.fail(f"{key} {value} exceeds the limit {MAX_ALIGNMENT}")
    return value


def _check_required_keys(src: _BoundedSource, metadata: dict[str, Any],
                         types: dict[str, tuple[GGUFValueType, ...]]) -> str:
    key = "general.architecture"
    if key not in metadata:
        raise src.fail(f"missing required key {key}")
    if types[key] != (_V.STRING,) or not metadata[key]:
        raise src.fail(f"{key} must be a non-empty string")
    arch = metadata[key]
    for suffix in REQUIRED_KEYS_BY_ARCH.get(arch, ()):
        name = f"{arch}.{suffix}"
        if name not in metadata:
            raise src.fail(f"missing required key {name} (architecture {arch})")
        if types[name][0] not in _INTEGER_TYPES:
            raise src.fail(f"{name} must be an integer, got {_type_name(types[name])}")
        value, limit = metadata[name], _REQUIRED_KEY_MAX[suffix]
        if not 1 <= value <= limit:
            raise src.fail(f"{name} is {value}, expected 1..{limit}")
    return arch


def _check_tokenizer(src: _BoundedSource, metadata: dict[str, Any],
                     types: dict[str, tuple[GGUFValueType, ...]]) -> list[str]:
    """Refuses malformed tokenizer arrays; returns warnings for what it repaired."""
    def require_array_of(key: str, etype: GGUFValueType) -> None:
        if types[key] != (_V.ARRAY, etype):
            raise src.fail(f"{key} must be an ARRAY of {etype.name}, got {_type_name(types[key])}")

    tokens = metadata.get(TOKENS_KEY)
    if MERGES_KEY in metadata:
        require_array_of(MERGES_KEY, _V.STRING)
    if tokens is None:
        present = [k for k in _PER_TOKEN_ARRAYS if k in metadata]
        if present:
            raise src.fail(f"{present[0]} present without {TOKENS_KEY}")
        return []
    require_array_of(TOKENS_KEY, _V.STRING)
    longest = max(tokens, key=len, default="")
    # len() counts code points; only strings that long can exceed the byte limit.
    if len(longest) * 4 > MAX_TOKEN_PIECE_BYTES:
        for i, piece in enumerate(tokens):
            if len(piece) * 4 > MAX_TOKEN_PIECE_BYTES and len(piece.encode()) > MAX_TOKEN_PIECE_BYTES:
                raise src.fail(f"{TOKENS_KEY}[{i}]: token piece of {len(piece.encode())} bytes "
                               f"exceeds the limit {MAX_TOKEN_PIECE_BYTES}")
    n_vocab = len(tokens)
    for key, etype in _PER_TOKEN_ARRAYS.items():
        if key in metadata:
            require_array_of(key, etype)
            if len(metadata[key]) != n_vocab:
                raise src.fail(f"{key} has {len(metadata[key])} entries but {TOKENS_KEY} "
                               f"has {n_vocab}")
    token_types = metadata.get("tokenizer.ggml.token_type", ())
    if token_types and not (min(token_types) in _TOKEN_TYPE_RANGE
                            and max(token_types) in _TOKEN_TYPE_RANGE):
        bad = next(t for t in token_types if t not in _TOKEN_TYPE_RANGE)
        raise src.fail(f"tokenizer.ggml.token_type holds unknown token type {bad}")
    # Special token ids index the vocabulary: an id outside it would be an
    # out-of-bounds read later.  Real files have carried such ids, and llama.cpp
    # ignores them with a warning, so they are dropped rather than refused.
    warnings = []
    for key in [k for k in metadata if k.startswith("tokenizer.ggml.") and k.endswith("_token_id")]:
        if types[key][0] not in _INTEGER_TYPES:
            raise src.fail(f"{key} must be an integer, got {_type_name(types[key])}")
        if not 0 <= metadata[key] < n_vocab:
            warnings.append(f"{src.label}: {key} {metadata[key]} is outside the vocabulary "
                            f"(0..{n_vocab - 1}); ignored")
            del metadata[key]
    return warnings


# --- tensor infos ----------------------------------------------------------------

@dataclass
class _RawTensorInfo:
    name: str
    dims: tuple[int, ...]
    raw_type: int
    rel_offset: int
    info_offset: int


def _read_tensor_infos(src: _BoundedSource, tensor_count: int) -> list[_RawTensorInfo]:
    infos: list[_RawTensorInfo] = []
    seen: set[str] = set()
    for index in range(tensor_count):
        start = src.pos
        name = src.text(f"tensor name #{index}", MAX_TENSOR_NAME_BYTES)
        if not name:
            raise src.fail(f"tensor #{index} at offset {start} has an empty name")
        if name in seen:
            raise src.fail(f"duplicate tensor name {name!r} (second at offset {start})")
        seen.add(name)
        what = f"tensor {name!r}"
        n_dims = src.u32(f"{what} dimension count")
        if not 1 <= n_dims <= MAX_DIMS:
            raise src.fail(f"{what} has {n_dims} dimensions (expected 1..{MAX_DIMS})")
        dims = tuple(src.u64(f"{what} dimension {d}") for d in range(n_dims))
        raw_type = src.u32(f"{what} type")
        rel_offset = src.u64(f"{what} data offset")
        infos.append(_RawTensorInfo(name, dims, raw_type, rel_offset, start))
    return infos


def _align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def _tensor_type(src: _BoundedSource, info: _RawTensorInfo) -> GGMLQuantizationType:
    raw = info.raw_type
    if raw not in _TYPE_SIZES:
        as_int32 = f" ({raw - (1 << 32)} as int32)" if raw >= 1 << 31 else ""
        raise src.fail(f"tensor {info.name!r} has unknown type {raw}{as_int32}")
    return GGMLQuantizationType(raw)


def _tensor_size(src: _BoundedSource, info: _RawTensorInfo, ttype: GGMLQuantizationType
                 ) -> tuple[int, int]:
    """(element count, byte size), each proven to fit in an int64."""
    what = f"tensor {info.name!r}"
    for d, n in enumerate(info.dims):
        if n == 0 or n > INT64_MAX:
            shown = f"{n} ({n - (1 << 64)} as int64)" if n > INT64_MAX else str(n)
            raise src.fail(f"{what} dimension {d} is {shown}, must be at least 1")
    # Python integers do not wrap: compare the exact products with what a C reader could hold.
    n_elements = 1
    for n in info.dims:
        n_elements *= n
    shape = "x".join(map(str, info.dims))
    if n_elements > INT64_MAX:
        raise src.fail(f"{what} element count of shape {shape} overflows 64 bits")
    block_size, block_bytes = _TYPE_SIZES[int(ttype)]
    if info.dims[0] % block_size:
        raise src.fail(f"{what} row length {info.dims[0]} is not a multiple of "
                       f"{ttype.name}'s block size {block_size}")
    nbytes = n_elements // block_size * block_bytes
    if nbytes > INT64_MAX:
        raise src.fail(f"{what} byte size of shape {shape} in {ttype.name} overflows 64 bits")
    return n_elements, nbytes


def _check_tensors(src: _BoundedSource, infos: list[_RawTensorInfo], alignment: int,
                   data_offset: int) -> list[TensorInfo]:
    tensors: list[TensorInfo] = []
    for info in infos:
        ttype = _tensor_type(src, info)
        n_elements, nbytes = _tensor_size(src, info, ttype)
        if info.rel_offset % alignment:
            raise src.fail(f"tensor {info.name!r} data offset {info.rel_offset} is not a "
                           f"multiple of the alignment {alignment}")
        tensors.append(TensorInfo(info.name, ttype, info.dims, n_elements,
                                  data_offset + info.rel_offset, nbytes))
    # CVE-2025-53630 / CVE-2026-27940: readers that add up padded sizes in 64 bits wrap.
    total = sum(_align_up(t.nbytes, alignment) for t in tensors)
    if total > INT64_MAX:
        raise src.fail(f"total tensor data size {total} overflows 64 bits")
    for t in tensors:
        end = t.offset + t.nbytes
        if end > src.size:
            raise src.fail(f"tensor {t.name!r} data [{t.offset}..{end}) beyond end of file "
                           f"(size {src.size})")
    by_offset = sorted(tensors, key=lambda t: (t.offset, t.nbytes))
    for before, after in zip(by_offset, by_offset[1:]):
        if after.offset < before.offset + before.nbytes:
            raise src.fail(f"tensor {after.name!r} data [{after.offset}..{after.offset + after.nbytes}) "
                           f"overlaps tensor {before.name!r} data "
                           f"[{before.offset}..{before.offset + before.nbytes})")
    return tensors
