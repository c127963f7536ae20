"""The MXFP4 kernels (native/shaders/dequant_mxfp4.glsl through matvec_mxfp4,
matmul_mxfp4, matvec_id_mxfp4 and get_rows_mxfp4) and the native host
matvec's MXFP4 rows, against gguf.quants.dequantize, on real Vulkan.

Blocks are random bytes (every nibble value of both halves) with the E8M0
scale byte overwritten by a sane exponent (2^-10 .. 2^-3 once halved:
llama.cpp's range for unit-scale expert weights); dequantize defines what a
block means.  17-byte blocks put rows, and so blocks, at every byte
alignment: 13 blocks a row (221 bytes) walks all four.

Tolerances as tests/engine/test_kernels_kquants.py: get_rows exact (a
power of two times a small integer), the dot products within
2e-6 * sum|w||x| + 1e-6.
"""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from tests.engine.test_kernels import close_to_dot, f32
from tests.engine.test_kernels_kquants import run_get_rows, run_matvec
from vramd.engine import hostmv
from vramd.engine.ops import Weight, row_bytes, view

COLS = 13 * 32  # 13 blocks: 221-byte rows, so consecutive rows start at every byte mod 4


def mx_blocks(rng, rows, cols):
    """(uint8 [rows, row bytes], the float32 [rows, cols] they mean)."""
    n = rows * cols // 32
    b = rng.integers(0, 256, (n, 17), dtype=np.uint8)
    b[:, 0] = rng.integers(118, 126, n)  # E8M0: 2^(e - 128) per doubled E2M1 unit
    raw = b.reshape(rows, -1)
    w = dequantize(raw, Q.MXFP4).astype(np.float32)
    assert w.shape == (rows, cols) and np.all(np.isfinite(w)) and np.any(w != 0)
    return np.ascontiguousarray(raw), w


def test_row_bytes_and_quantize_roundtrip(rng):
    assert row_bytes(Q.MXFP4, 64) == 34
    x = rng.standard_normal((3, 64)).astype(np.float32)
    raw = quantize(x, Q.MXFP4)
    assert raw.shape == (3, 34)
    # the decoder the kernels are compared with decodes what gguf's quantizer makes
    assert np.max(np.abs(dequantize(raw, Q.MXFP4) - x)) < 0.5 * np.abs(x).max()


@pytest.mark.parametrize("rows,n_tokens", [(37, 1), (37, 3), (67, 5), (131, 37)])
@pytest.mark.parametrize("w_off", [0, 1, 3])
def test_matvec(ops, bufs, rng, rows, n_tokens, w_off):
    """1 and 3 tokens: matvec_mxfp4 (mv_unit, its funnel of 5 words at every
    byte offset); 5 and 37: matmul_mxfp4's tiles; the matrix 0, 1 or 3 bytes
    into its buffer.  The portable kernels, on a GPU too: matmul_cm_mxfp4's f16
    tiles are test_matmul_cm.py's (this f32 bound is not theirs)."""
    raw, w = mx_blocks(rng, rows, COLS)
    cm, ops.coopmat = ops.coopmat, False
    try:
        run_matvec(ops, bufs, rng, Q.MXFP4, raw, w, n_tokens, w_off=w_off)
    finally:
        ops.coopmat = cm


def test_matvec_aligned_x(ops, bufs, rng):
    raw, w = mx_blocks(rng, 19, 64)
    run_matvec(ops, bufs, rng, Q.MXFP4, raw, w, 2, x_off=0)


def test_get_rows(ops, bufs, rng):
    raw, table = mx_blocks(rng, 50, COLS)
    run_get_rows(ops, bufs, Q.MXFP4, raw, table, [0, 49, 7, 7, 22, 31])


@pytest.mark.parametrize("x_div", [1, 3])
def test_matvec_id(ops, bufs, rng, x_div):
    """Expert slabs of 13 rows x 221 bytes (odd: each expert's matrix at
    another byte alignment), repeated and out-of-order experts."""
    n_expert, rows = 7, 13
    raw, w = mx_blocks(rng, n_expert * rows, COLS)
    w = w.reshape(n_expert, rows, COLS)
    slot_ids = [6, 0, 3, 3, 1, 6]
    n_x = -(-len(slot_ids) // x_div)
    x = rng.standard_normal((n_x, COLS)).astype(np.float32)
    wt = bufs("weights", w=raw.reshape(-1))["w"]
    t = bufs(x=x.reshape(-1), ids=np.asarray(slot_ids, np.int32), y=4 * len(slot_ids) * rows)
    ops.matvec_id(Weight(view(wt, 0, raw.nbytes), Q.MXFP4, rows, COLS), n_expert, t["ids"], t["x"], t["y"],
                  len(slot_ids), x_div=x_div)
    ops.sync()
    y = f32(t["y"]).reshape(len(slot_ids), rows)
    for s, e in enumerate(slot_ids):
        xs, we = x[s // x_div].astype(np.float64), w[e].astype(np.float64)
        close_to_dot(y[s], we @ xs, np.abs(we) @ np.abs(xs))


@pytest.mark.parametrize("rows", [1, 13, 40])
def test_host_matvec(rng, rows):
    """The native host matvec (`--n-cpu-moe`'s expert path) on the same random blocks."""
    raw, w = mx_blocks(rng, rows, COLS)
    assert hostmv.supports(int(Q.MXFP4), COLS)
    x = rng.standard_normal((3, COLS)).astype(np.float32)
    y = hostmv.matvec(raw, int(Q.MXFP4), rows, COLS, x)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    close_to_dot(y, x64 @ w64.T, np.abs(x64) @ np.abs(w64).T)
