"""matvec_q8_0_dp (native/shaders/matvec_q8_0_dp.comp): Q8_0 decode by integer dot products,
on real Vulkan, against numpy and against the portable f32 kernels.

The kernel rounds x to 8 bits per block of 32 first (llama.cpp's q8 activations: d = amax / 127,
q = round(x / d)), so it computes W . x' where x' = d q, |x - x'| <= d / 2 per element.  Two
references:
  * exact: W . x' in float64 from numpy's own quantization of x (the same f32 arithmetic:
    d = amax / 127 in f32, q = round(x * (1 / d))).  What is left is f32 accumulation
    (rel 2e-6 of sum|w||x|, as tests/engine/test_kernels.py) plus, rarely, a quant whose
    x / d lands within an ulp of .5 and rounds the other way: one term of d |w|, allowed
    once per row (ROUND_FLIPS);
  * bounded: W . x (float64) and the portable kernel's y, within the rounding bound
    sum over blocks of d_b / 2 * sum_e |W_e| (+ the f32 term).
Weights from gguf.quants.quantize, expanded with gguf.quants.dequantize; shapes: odd row counts
around the work group's 8, the 8B llama's columns (4096, 14336), Gemma 3 270M's 640, x off
16-byte alignment, rows 2 bytes past alignment, several tokens, a zero block of x.
"""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from vramd.engine import linear
from vramd.engine.ops import Ops, Weight, view
from vramd.errors import UsageError
from tests.engine.test_kernels import f32, weights

ROUND_FLIPS = 1


@pytest.fixture(scope="module")
def ops_new(res):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VRAMD_Q8_DECODE", "new")
        o = Ops(res)
    assert o.q8_dp
    yield o
    o.close()


@pytest.fixture(scope="module")
def ops_old(res):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VRAMD_Q8_DECODE", "old")
        o = Ops(res)
    assert not o.q8_dp
    yield o
    o.close()


def quantize_x(x):
    """llama.cpp's 8-bit activations in the kernel's f32 arithmetic: (x' = d q, d per block)."""
    b = x.astype(np.float32).reshape(*x.shape[:-1], -1, 32)
    d = (np.abs(b).max(axis=-1, keepdims=True) / np.float32(127)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.clip(np.round(b * inv), -127, 127)
    return (q * d).reshape(x.shape).astype(np.float64), np.broadcast_to(d, b.shape).reshape(x.shape)


def run(ops, bufs, w, blob, w_skip, rows, cols, x, n_tokens, x_stride):
    wt = bufs("weights", w=blob)["w"]
    t = bufs(x=x, y=4 * n_tokens * rows)
    ops.matvec(Weight(view(wt, w_skip, blob.nbytes - w_skip), Q.Q8_0, rows, cols), t["x"], t["y"], n_tokens,
               x_stride=x_stride)
    ops.sync()
    return f32(t["y"]).reshape(n_tokens, rows).astype(np.float64)


@pytest.mark.parametrize("rows,cols,n_tokens", [(1, 32, 1), (7, 640, 2), (9, 4096, 1), (37, 640, 3),
                                                (13, 14336, 1), (17, 96, 3)])
@pytest.mark.parametrize("x_pad", [0, 1], ids=["x-aligned", "x-unaligned"])
@pytest.mark.parametrize("w_skip", [0, 2], ids=["w-aligned", "w-plus-2"])
def test_q8_dp_matches_numpy_and_the_portable_kernel(ops_new, ops_old, bufs, rng, rows, cols, n_tokens, x_pad,
                                                     w_skip):
    raw, w = weights(rng, Q.Q8_0, rows, cols)
    blob = np.concatenate([np.zeros(w_skip, np.uint8), np.ascontiguousarray(raw).reshape(-1).view(np.uint8)])
    x_stride = cols + x_pad
    x = rng.standard_normal((n_tokens, x_stride)).astype(np.float32)
    x[:, 1::7] *= 30.0                 # a wide range within a block: the scale is set by its largest
    x[0, :32] = 0.0                    # a zero block: d = 0, no division by it
    new = run(ops_new, bufs, w, blob, w_skip, rows, cols, x, n_tokens, x_stride)
    assert "matvec_q8_0_dp" in ops_new._kernels and "matvec_q8_0_dp" not in ops_old._kernels
    old = run(ops_old, bufs, w, blob, w_skip, rows, cols, x, n_tokens, x_stride)

    xs = x[:, :cols].astype(np.float64)
    wd = w.astype(np.float64)
    xq, dx = quantize_x(x[:, :cols])
    mag = np.abs(xs) @ np.abs(wd).T
    f32_term = 2e-6 * mag + 1e-6
    # exact: the kernel's own quantization of x, up to f32 accumulation and rare rounding flips
    err = np.abs(new - xq @ wd.T)
    flip = ROUND_FLIPS * (dx.max(axis=-1, keepdims=True) * np.abs(wd).max(axis=-1)[None, :])
    assert np.all(err <= f32_term + flip), f"max error {err.max():.3g} vs W.x' (x quantized as the kernel does)"
    # bounded: |W.x - W.x'| <= sum_e |W_e| d_e / 2
    bound = (dx / 2) @ np.abs(wd).T + f32_term
    assert np.all(np.abs(new - xs @ wd.T) <= bound), "outside the 8-bit activation rounding bound"
    assert np.all(np.abs(new - old) <= bound + f32_term), "new and portable kernels disagree beyond the bound"
    # the portable kernel is f32-exact; the new one's difference from it is the rounding of x, visible
    # (the dispatch did take the integer kernel, not a second f32 one)
    assert np.all(np.abs(old - xs @ wd.T) <= f32_term)
    if cols > 32:
        assert np.any(np.abs(new - old) > f32_term)


def test_select_and_switch(device, monkeypatch):
    if device.integer_dot:  # the feature is reported only with its extension enabled
        assert "VK_KHR_shader_integer_dot_product" in device.extensions
    class W:
        suffix, cols, row_bytes = "q8_0", 4096, 4352
    assert linear.select(W, 1, 0, q8_dp=True).name == "matvec_q8_0_dp"
    assert linear.select(W, 1, 0, q8_dp=False).name == "matvec_w_q8_0"
    assert linear.select(W, 1, 1, q8_dp=True).name == "matvec_q8_0"      # odd: its word reads need even rows
    assert linear.select(W, 8, 0, q8_dp=True).name.startswith("matmul")  # prefill: unchanged
    W.cols = linear.Q8_DP_MAX_COLS + 32
    assert linear.select(W, 1, 0, q8_dp=True).name != "matvec_q8_0_dp"  # wider than its shared x
    monkeypatch.setenv("VRAMD_Q8_DECODE", "old")
    assert not linear.q8_decode_usable(device)
    monkeypatch.delenv("VRAMD_Q8_DECODE")
    assert not linear.q8_decode_usable(device)   # unset: the f32 kernel (the H200 measured it faster)
    monkeypatch.setenv("VRAMD_Q8_DECODE", "new")
    assert linear.q8_decode_usable(device) == device.integer_dot
    monkeypatch.setenv("VRAMD_Q8_DECODE", "fast")
    with pytest.raises(UsageError, match="VRAMD_Q8_DECODE='fast'"):
        linear.q8_decode_usable(device)


def test_decode_bench_takes_the_path_the_switch_names(monkeypatch):
    """`vramd bench decode --type Q8_0` under VRAMD_Q8_DECODE=new: the profile names the integer kernel
    and not the word kernel (the A/B the lead runs on the GPU is this command with old and new;
    on lavapipe the default is the CPU form, matvec_c_q8_0, which test_bench_decode.py checks)."""
    mode, kernel = "new", "matvec_q8_0_dp"
    from click.testing import CliRunner
    from vramd.bench.decode import command

    monkeypatch.setenv("VRAMD_Q8_DECODE", mode)
    res = CliRunner().invoke(command, ["--shape", "small", "--type", "Q8_0", "--prompt", "8", "--tokens", "2",
                                       "--ctx", "32", "--profile", "--profile-steps", "2"])
    assert res.exit_code == 0, res.output
    assert kernel in res.output and ({"matvec_q8_0_dp", "matvec_w_q8_0"} - {kernel}).pop() not in res.output
