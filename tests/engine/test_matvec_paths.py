"""matvec_<type>'s load paths (native/shaders/matvec.glsl), against numpy.

test_kernels.py checks matvec on shapes chosen to be awkward (odd columns, x
one float off alignment), which take the word-at-a-time paths.  Decode runs
the other ones: rows and x 16-byte aligned, read as uvec4/vec4.  Here both,
on the same data: every row count around the work group's 8 rows (2 per
subgroup), x aligned or not per token (x_stride), the weight rows aligned or
not (a view starting 8 bytes into its tensor), several tokens (work-group z);
300 rows: two of matvec_c_<type>'s 256-row groups, the last partial (CPU form,
linear_form runs every test in both forms).
Q8_0 rows of 512 columns are 544 bytes: aligned, they take matvec_w_q8_0
(a quant word per lane), 8 bytes off, matvec_q8_0.
"""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from vramd.engine.ops import Weight, view
from tests.engine.test_kernels import close_to_dot, f32, weights

TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 7, 8, 9, 17, 37, 300])
@pytest.mark.parametrize("x_pad", [0, 4, 1], ids=["x-aligned", "x-stride-aligned", "x-unaligned"])
@pytest.mark.parametrize("w_skip", [0, 8], ids=["w-aligned", "w-plus-8"])
def test_matvec_paths(ops, linear_form, bufs, rng, qtype, rows, x_pad, w_skip):
    cols, n_tokens = 512, 3
    raw, w = weights(rng, qtype, rows, cols)
    blob = np.concatenate([np.zeros(w_skip, np.uint8), np.ascontiguousarray(raw).reshape(-1).view(np.uint8)])
    x_stride = cols + x_pad  # x_pad 1: tokens 1 and 2 start off 16-byte alignment
    x = rng.standard_normal((n_tokens, x_stride)).astype(np.float32)
    wt = bufs("weights", w=blob)["w"]
    t = bufs(x=x, y=4 * n_tokens * rows)
    ops.matvec(Weight(view(wt, w_skip, blob.nbytes - w_skip), qtype, rows, cols), t["x"], t["y"], n_tokens,
               x_stride=x_stride)
    ops.sync()
    y = f32(t["y"]).reshape(n_tokens, rows)
    xs = x[:, :cols].astype(np.float64)
    close_to_dot(y, xs @ w.astype(np.float64).T, np.abs(xs) @ np.abs(w).astype(np.float64).T)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matvec_decode_shape(ops, linear_form, bufs, rng, qtype):
    """A wide row (14336 columns, as llama-3-8B's ffn_down) and rows that
    are not a multiple of the work group's."""
    rows, cols = 13, 14336
    raw, w = weights(rng, qtype, rows, cols)
    x = rng.standard_normal(cols).astype(np.float32)
    wt = bufs("weights", w=raw)["w"]
    t = bufs(x=x, y=4 * rows)
    ops.matvec(Weight(wt, qtype, rows, cols), t["x"], t["y"], 1)
    ops.sync()
    xs = x.astype(np.float64)
    close_to_dot(f32(t["y"]), w.astype(np.float64) @ xs, np.abs(w).astype(np.float64) @ np.abs(xs))
