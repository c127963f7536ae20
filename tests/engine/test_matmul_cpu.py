"""matmul_c_<type> (CPU devices' prefill kernel: matvec.glsl MV_ROWLANE with MC_NT 4),
against numpy's dequantized reference and against the portable matmul_<type>.

A work group is 256 rows (16 invocations x 16 rows each, rows k * 16 + lane) x 4 tokens
(work-group z), each quant unit decoded once for the 4 tokens: the tile edges are
rows 255 / 256 / 257 (a partial last group, a lane whose later rows are past the end)
and token counts 4 / 5 / 7 / 9 (the last 4-token group partial: its missing tokens
re-read the last one and are not stored).  x one float off 16 bytes (read float by
float) or aligned with a stride that is not a multiple of 4 floats; weights 2 bytes
into their tensor (every block's words straddle uint32 words).
"""
from types import SimpleNamespace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from vramd.engine import linear
from vramd.engine.ops import Weight, view
from tests.engine.test_kernels import weights
from tests.engine.test_kernels_kquants import SIMPLE, TYPES as K_TYPES, blocks, close_to_dot

TYPES = [Q.Q8_0, Q.Q4_0] + K_TYPES


def make(rng, qtype, rows):
    if qtype in (Q.Q8_0, Q.Q4_0):
        return weights(rng, qtype, rows, 13 * 32)
    return blocks(rng, qtype, rows, 13 * 32 if qtype in SIMPLE else 2 * 256)


def run(ops, bufs, qtype, raw, x, x_pad, x_off, w_off, cpu):
    n_tokens, cols = x.shape
    rows = raw.shape[0]
    xs = np.concatenate([np.full((n_tokens, x_pad), 7, np.float32), x], axis=1) if x_pad else x
    stride = cols + x_pad
    xpad = np.concatenate([np.full(x_off, 7, np.float32), xs.reshape(-1)])
    wpad = np.concatenate([np.full(w_off, 0xAB, np.uint8), raw.reshape(-1).view(np.uint8)])
    wt = bufs("weights", w=wpad)["w"]
    t = bufs(x=xpad, y=np.full(n_tokens * rows, -3, np.float32))
    was, ops.cpu = ops.cpu, cpu
    cm, ops.coopmat = ops.coopmat, False
    try:
        ops.matvec(Weight(view(wt, w_off), qtype, rows, cols), view(t["x"], 4 * (x_off + x_pad)), t["y"],
                   n_tokens, x_stride=stride)
        ops.sync()
    finally:
        ops.cpu, ops.coopmat = was, cm
    return t["y"].read(np.float32).reshape(n_tokens, rows)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [5, 255, 257])
@pytest.mark.parametrize("n_tokens", [4, 7, 9])
@pytest.mark.parametrize("x_off,x_pad,w_off", [(1, 0, 2), (0, 3, 0)], ids=["x-unaligned-w+2", "x-stride-odd"])
def test_matmul_c(ops, bufs, rng, qtype, rows, n_tokens, x_off, x_pad, w_off):
    raw, w = make(rng, qtype, rows)
    x = rng.standard_normal((n_tokens, w.shape[1])).astype(np.float32)
    sel = linear.select(SimpleNamespace(suffix=qtype.name.lower(), cols=w.shape[1], row_bytes=raw.nbytes // rows),
                        n_tokens, 0, cpu=True)
    tail = "_any" if qtype in (Q.Q8_0, Q.Q5_0) else ""  # 13 * 32 columns: not 4-block units (test_matmul_c_w2)
    assert (sel.name, sel.rows_per_group, sel.tokens_per_group) == ("matmul_c_" + qtype.name.lower() + tail, 256, 4)
    y = run(ops, bufs, qtype, raw, x, x_pad, x_off, w_off, cpu=True)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    close_to_dot(y, x64 @ w64.T, np.abs(x64) @ np.abs(w64).T)
    # the portable kernel on the same data: the same sums up to f32 rounding
    y_portable = run(ops, bufs, qtype, raw, x, x_pad, x_off, w_off, cpu=False)
    close_to_dot(y, y_portable, 2 * np.abs(x64) @ np.abs(w64).T)


def test_matmul_c_full_tile(ops, bufs, rng):
    """256 rows x 8 tokens: exactly two whole 4-token groups of one whole row group."""
    raw, w = make(rng, Q.Q4_K, 256)
    x = rng.standard_normal((8, w.shape[1])).astype(np.float32)
    y = run(ops, bufs, Q.Q4_K, raw, x, 0, 0, 0, cpu=True)
    assert "matmul_c_q4_k" in ops._kernels
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    close_to_dot(y, x64 @ w64.T, np.abs(x64) @ np.abs(w64).T)




@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q5_0], ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [5, 255, 257])
@pytest.mark.parametrize("cols,w_off,form", [(640, 0, ""), (5 * 128, 2, "_any"), (13 * 32, 0, "_any"), (128, 8, "")],
                         ids=["4-block-units", "w+2", "cols-not-128", "one-unit-w+8"])
@pytest.mark.parametrize("n_tokens,x_off", [(1, 0), (3, 1), (5, 0), (9, 1)],
                         ids=["1-token", "3-tokens-x-unaligned", "5-tokens", "9-tokens-x-unaligned"])
def test_c_w2(ops, bufs, rng, qtype, rows, cols, w_off, form, n_tokens, x_off):
    """matvec_c_<type> (1-3 tokens) and matmul_c_<type> (from 4: the last 4-token group partial)
    for Q8_0 and Q5_0: 4 blocks a unit, read as uvec2 (rows 8-byte aligned, cols a multiple of
    128), or the _any forms (a block a unit, any even offset); each against numpy and the
    portable kernel; rows 255 / 257 are the 256-row group's edges."""
    raw, w = weights(rng, qtype, rows, cols) if qtype == Q.Q8_0 else blocks(rng, qtype, rows, cols)
    kernel = ("matvec_c_" if n_tokens < linear.MATMUL_FROM else "matmul_c_") + qtype.name.lower() + form
    sel = linear.select(SimpleNamespace(suffix=qtype.name.lower(), cols=cols, row_bytes=raw.nbytes // rows),
                        n_tokens, w_off, cpu=True)
    assert sel.name == kernel
    x = rng.standard_normal((n_tokens, cols)).astype(np.float32)
    y = run(ops, bufs, qtype, raw, x, 0, x_off, w_off, cpu=True)
    assert kernel in ops._kernels
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    close_to_dot(y, x64 @ w64.T, np.abs(x64) @ np.abs(w64).T)
    y_portable = run(ops, bufs, qtype, raw, x, 0, x_off, w_off, cpu=False)
    close_to_dot(y, y_portable, 2 * np.abs(x64) @ np.abs(w64).T)
