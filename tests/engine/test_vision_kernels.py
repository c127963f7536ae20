"""The vision encoder's kernels (vramd/engine/vision_ops.py) against numpy,
on real Vulkan (lavapipe in CI; tests/engine/conftest.py picks the device).

References are float64 numpy (and math.erf / math.tanh for GELU) over
exactly the values the kernel sees (F16/BF16 weights rounded first).
Tolerances are stated per test: they cover f32 accumulation and the GPU's
exp, and are orders of magnitude below what a wrong index, a wrong layout or
a missing term produces (errors of the order of the values themselves).
"""
import math

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from vramd.errors import ModelError, UsageError
from vramd.engine.ops import Weight, view
from vramd.engine.vision_ops import VisionOps





@pytest.fixture(scope="module")
def vops(res):
    o = VisionOps(res)
    yield o
    o.close()








def f32(t, shape=None):
    a = t.read(np.float32)
    if shape is None:
        return a
    return a[:int(np.prod(shape))].reshape(shape)


def rounded(rng, qtype, shape):
    """(bytes to upload, the float32 values they mean) for F32/F16/BF16."""
    w = rng.standard_normal(shape).astype(np.float32)
    if qtype == Q.F32:
        return w, w
    if qtype == Q.F16:
        h = w.astype(np.float16)
        return h, h.astype(np.float32)
    b = (w.view(np.uint32) >> 16).astype(np.uint16)  # truncation: any bf16 value will do
    return b, (b.astype(np.uint32) << 16).view(np.float32)


def max_ratio(err, bound):
    return float(np.max(np.abs(err) / bound))


# -- layer norm ----------------------------------------------------------------

def layer_norm_ref(x, w, b, eps):
    x = x.astype(np.float64)
    mu = x.mean(axis=1, keepdims=True)
    y = (x - mu) / np.sqrt(((x - mu) ** 2).mean(axis=1, keepdims=True) + eps)
    if w is not None:
        y = y * w
    if b is not None:
        y = y + b
    return y


@pytest.mark.parametrize("n_tokens,width", [(5, 1024), (3, 1151), (2, 77)])
def test_layer_norm(vops, bufs, rng, n_tokens, width):
    """Rows with a large mean (50 +- 3): a one-pass E[x^2] - E[x]^2 would
    lose ~3 digits there; the two-pass kernel matches to f32 rounding.
    Tolerance 2e-5 absolute + 1e-5 relative on outputs of order 1-5."""
    x = (rng.standard_normal((n_tokens, width)) * 3 + 50).astype(np.float32)
    w = rng.standard_normal(width).astype(np.float32)
    b = rng.standard_normal(width).astype(np.float32)
    eps = 1e-6
    t = bufs(x=x, w=w, b=b, y=x.nbytes, yw=x.nbytes, yn=x.nbytes)
    vops.layer_norm(t["x"], t["w"], t["b"], t["y"], eps, n_tokens, width)
    vops.layer_norm(t["x"], t["w"], None, t["yw"], eps, n_tokens, width)
    vops.layer_norm(t["x"], None, None, t["yn"], eps, n_tokens, width)
    vops.layer_norm(t["x"], t["w"], t["b"], t["x"], eps, n_tokens, width)  # in place
    vops.sync()
    for name, ref in [("y", layer_norm_ref(x, w, b, eps)), ("x", layer_norm_ref(x, w, b, eps)),
                      ("yw", layer_norm_ref(x, w, None, eps)), ("yn", layer_norm_ref(x, None, None, eps))]:
        np.testing.assert_allclose(f32(t[name], x.shape), ref, rtol=1e-5, atol=2e-5, err_msg=name)


def test_layer_norm_strides(vops, bufs, rng):
    """Rows read and written with strides (the padding between rows stays)
    from an offset that is not storage-aligned."""
    n_tokens, width, stride = 4, 300, 311
    x = rng.standard_normal((n_tokens, stride)).astype(np.float32)
    w = rng.standard_normal(width).astype(np.float32)
    b = rng.standard_normal(width).astype(np.float32)
    t = bufs(x=np.concatenate([[np.float32(9)], x.reshape(-1)]), w=w, b=b,
             y=np.full(n_tokens * stride, -3, np.float32))
    vops.layer_norm(view(t["x"], 4), t["w"], t["b"], t["y"], 1e-5, n_tokens, width, x_stride=stride,
                    y_stride=stride)
    vops.sync()
    y = f32(t["y"], (n_tokens, stride))
    np.testing.assert_allclose(y[:, :width], layer_norm_ref(x[:, :width], w, b, 1e-5), rtol=1e-5, atol=2e-5)
    assert np.all(y[:, width:] == -3)


# -- GELU ----------------------------------------------------------------------

def _gelu_tanh(a):
    """0.5 a (1 + tanh(u)), written as a / (1 + e^{-2u}) past u < -1 (the same
    value: 1 + tanh(u) = 2 / (1 + e^{-2u})) because 1 + math.tanh(u)
    cancels to nothing in float64 below ~1e-16."""
    u = math.sqrt(2 / math.pi) * (a + 0.044715 * a ** 3)
    if u >= -1:
        return 0.5 * a * (1 + math.tanh(u))
    return a / (1 + math.exp(-2 * u)) if u > -350 else 0.0


GELU_REF = {
    "tanh": _gelu_tanh,
    "erf": lambda a: 0.5 * a * math.erfc(-a / math.sqrt(2)),  # = 1 + erf(z), without float64's cancellation
    "quick": lambda a: a / (1 + math.exp(-1.702 * a)) if a > -400 else 0.0,
    "silu": lambda a: a / (1 + math.exp(-a)) if a > -700 else 0.0,
}


# the form -> its name in an mmproj config (MmprojConfig.ffn_act), for VisionOps.activation
MMPROJ_NAME = {"tanh": "gelu", "erf": "gelu_erf", "quick": "gelu_quick", "silu": "silu"}


@pytest.mark.parametrize("mode", ["tanh", "erf", "quick", "silu"])
def test_gelu(vops, bufs, rng, mode):
    """Every form (and SiLU, the fourth FFN activation of clip, through the
    same kernel) against its float64 definition (math.erf, math.tanh) over
    a dense sweep of -12 .. 12 and random values (n odd, several work
    groups), by name through activation(), then in place.  Tolerance
    1e-6 |ref| + 1e-7 |x| + 1e-7: the f32 rounding of a few operations and
    of the GPU's exp, and for erf the erfc fit (fractional 1.2e-7); measured
    on lavapipe: at most 0.21 of it.  And relative 5e-5 wherever |ref| >
    1e-30, the negative tails included: the kernel has no 1 + tanh or
    1 + erf cancellation (which would be off by 100% there); what is left is
    exp's f32 argument (up to ~70, rounded to ~4e-6 relative) and its ulps;
    measured: 1.7e-5."""
    sweep = np.linspace(-12, 12, 4801)
    x = np.concatenate([sweep, rng.standard_normal(5001) * 4]).astype(np.float32)
    ref = np.array([GELU_REF[mode](float(a)) for a in x])
    t = bufs(x=x, y=x.nbytes, by_name=x.nbytes)
    if mode == "silu":
        vops.silu(t["x"], t["y"], x.size)
    else:
        vops.gelu(t["x"], t["y"], x.size, mode)
    vops.activation(t["x"], t["by_name"], x.size, MMPROJ_NAME[mode])
    vops.sync()
    y = f32(t["y"], x.shape)
    bound = 1e-6 * np.abs(ref) + 1e-7 * np.abs(x) + 1e-7
    assert max_ratio(y - ref, bound) <= 1, f"max error {np.max(np.abs(y - ref)):.3g}"
    tail = np.abs(ref) > 1e-30
    assert max_ratio(y[tail] - ref[tail], 5e-5 * np.abs(ref[tail])) <= 1
    np.testing.assert_array_equal(f32(t["by_name"], x.shape), y)  # the mmproj name picks the same form
    vops.activation(t["x"], t["x"], x.size, MMPROJ_NAME[mode])  # in place
    vops.sync()
    np.testing.assert_array_equal(f32(t["x"], x.shape), y)


def test_gelu_forms_differ_and_saturate(vops, bufs):
    """The three forms are told apart (a swapped mode would pass no test
    above, but make sure they really differ where they should: at x = -1.5
    tanh and erf differ by ~2e-4, quick is off by ~8e-3) and the tails
    saturate to x and to 0 without NaN or inf."""
    x = np.array([-1.5, -1e4, -100, 100, 1e4, 0.0], np.float32)
    t = bufs(x=x, **{m: x.nbytes for m in ("tanh", "erf", "quick")})
    for m in ("tanh", "erf", "quick"):
        vops.gelu(t["x"], t[m], x.size, m)
    vops.sync()
    y = {m: f32(t[m], x.shape) for m in ("tanh", "erf", "quick")}
    for m in y:
        assert np.all(np.isfinite(y[m])), (m, y[m])
        np.testing.assert_array_equal(y[m][1:], [0, 0, 100, 1e4, 0], err_msg=m)
    assert 1e-4 < abs(y["tanh"][0] - y["erf"][0]) < 2e-3
    assert abs(y["quick"][0] - y["erf"][0]) > 5e-3
    with pytest.raises(UsageError, match="expected one of tanh, erf, quick"):
        vops.gelu(t["x"], t["x"], x.size, "none")
    with pytest.raises(UsageError, match="expected one of gelu, gelu_erf, gelu_quick, silu"):
        vops.activation(t["x"], t["x"], x.size, "relu")


# -- attention -----------------------------------------------------------------

def attention_ref(q, k, v, n_heads, head_dim, scale):
    n = q.shape[0]
    q, k, v = (a.astype(np.float64).reshape(n, n_heads, head_dim).transpose(1, 0, 2) for a in (q, k, v))
    s = scale * q @ k.transpose(0, 2, 1)                     # [heads, queries, keys]
    p = np.exp(s - s.max(axis=2, keepdims=True))
    p /= p.sum(axis=2, keepdims=True)
    return (p @ v).transpose(1, 0, 2).reshape(n, n_heads * head_dim)


@pytest.mark.parametrize("n_tokens,n_heads,head_dim,q_mag", [
    (577, 16, 64, 1.0),    # ViT-L/14 at 336 px: 24 x 24 patches + the class token
    (37, 3, 72, 1.0),      # SigLIP's head size; query and key tiles both partial
    (33, 2, 128, 4.0),     # the largest head; peaked softmax (scores of tens)
    (1, 1, 5, 1.0),        # one token: out = v
    (50, 2, 16, 30.0),     # scores in the hundreds: the online max must rescale
    (1500, 1, 4, 3.0),     # a long sequence (94 key tiles), kept cheap by a small head
])
def test_attention_full(vops, bufs, rng, n_tokens, n_heads, head_dim, q_mag):
    """Tolerance 5e-6 absolute + 5e-6 relative: the output is a convex
    combination of v (values of order 1); f32 scores, exp and sums over up
    to 577 keys stay well inside it.  A mask, a skipped key tile or a wrong
    head offset gives errors of order 0.1-1."""
    width = n_heads * head_dim
    q = (rng.standard_normal((n_tokens, width)) * q_mag).astype(np.float32)
    k = rng.standard_normal((n_tokens, width)).astype(np.float32)
    v = rng.standard_normal((n_tokens, width)).astype(np.float32)
    scale = head_dim ** -0.5
    t = bufs(q=q, k=k, v=v, o=q.nbytes)
    vops.attention_full(t["q"], t["k"], t["v"], t["o"], n_tokens, n_heads, head_dim, scale)
    vops.sync()
    ref = attention_ref(q, k, v, n_heads, head_dim, scale)
    np.testing.assert_allclose(f32(t["o"], ref.shape), ref, rtol=5e-6, atol=5e-6)


def test_attention_full_fused_qkv_and_strided_out(vops, bufs, rng):
    """q, k, v as views of one [n, 3 * hidden] buffer (a fused QKV
    projection's output), out written with a wider stride: the columns
    between rows stay untouched."""
    n_tokens, n_heads, head_dim = 45, 4, 24
    width = n_heads * head_dim
    qkv = rng.standard_normal((n_tokens, 3 * width)).astype(np.float32)
    o_stride = width + 5
    t = bufs(qkv=qkv, o=np.full(n_tokens * o_stride, 7, np.float32))
    vops.attention_full(t["qkv"], view(t["qkv"], 4 * width), view(t["qkv"], 8 * width), t["o"], n_tokens,
                        n_heads, head_dim, 0.2, q_stride=3 * width, k_stride=3 * width, v_stride=3 * width,
                        o_stride=o_stride)
    vops.sync()
    o = f32(t["o"], (n_tokens, o_stride))
    ref = attention_ref(qkv[:, :width], qkv[:, width:2 * width], qkv[:, 2 * width:], n_heads, head_dim, 0.2)
    np.testing.assert_allclose(o[:, :width], ref, rtol=5e-6, atol=5e-6)
    assert np.all(o[:, width:] == 7)


def test_attention_full_refuses_large_heads(vops, bufs):
    t = bufs(a=4 * 2 * 130)
    with pytest.raises(ModelError, match="head_dim 130"):
        vops.attention_full(t["a"], t["a"], t["a"], t["a"], 2, 1, 130, 1.0)


# -- patch embedding -------------------------------------------------------------

def conv_ref(img, w, b, patch):
    """The strided convolution by its definition: for each kernel offset
    (ky, kx), the image sampled every `patch` pixels from (ky, kx) times the
    kernel's taps there, summed; then rows = patches in raster order."""
    hidden = w.shape[0]
    _, h, wd = img.shape
    out = np.zeros((hidden, h // patch, wd // patch))
    img, w = img.astype(np.float64), w.astype(np.float64)
    for ky in range(patch):
        for kx in range(patch):
            out += np.einsum("oc,cyx->oyx", w[:, :, ky, kx], img[:, ky::patch, kx::patch])
    if b is not None:
        out += b[:, None, None]
    return out.reshape(hidden, -1).T


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16], ids=lambda t: t.name)
@pytest.mark.parametrize("channels,height,width,patch,hidden", [
    (3, 42, 70, 14, 70),      # 3 x 5 patches; hidden not a multiple of the 64-channel tile
    (3, 336, 336, 14, 96),    # ViT-L/14's 24 x 24 grid (576 patches: 18 patch tiles)
    (1, 10, 15, 5, 3),        # one channel, odd patch, K = 25 < one 32-column step
])
def test_patch_embed(vops, bufs, rng, qtype, channels, height, width, patch, hidden):
    """The weight is uploaded as the bytes of the numpy [hidden, channels,
    patch, patch] array (= ggml [patch, patch, channels, hidden], how a
    converter writes the torch Conv2d weight into v.patch_embd.weight).
    Tolerance 1e-5 relative to sum |w| |x| of each output + 1e-6."""
    img = rng.standard_normal((channels, height, width)).astype(np.float32)
    raw, w = rounded(rng, qtype, (hidden, channels, patch, patch))
    b = rng.standard_normal(hidden).astype(np.float32)
    n_patches = (height // patch) * (width // patch)
    t = bufs(img=img, b=b, o=4 * n_patches * hidden)
    wt = bufs("weights", w=raw)["w"]
    weight = Weight(wt, qtype, hidden, channels * patch * patch)
    vops.patch_embed(t["img"], weight, t["b"], t["o"], channels, height, width, patch)
    vops.sync()
    ref = conv_ref(img, w, b, patch)
    mag = conv_ref(np.abs(img), np.abs(w), None, patch)
    assert max_ratio(f32(t["o"], ref.shape) - ref, 1e-5 * mag + 1e-6) <= 1


def test_patch_embed_no_bias_strided_out(vops, bufs, rng):
    """No bias; out rows wider than hidden (the class-token slot of a
    [1 + n_patches, hidden] buffer is row 0, so the patches go at row 1:
    a view at one row's offset)."""
    channels, side, patch, hidden = 3, 28, 14, 40
    img = rng.standard_normal((channels, side, side)).astype(np.float32)
    raw, w = rounded(rng, Q.F16, (hidden, channels, patch, patch))
    t = bufs(img=img, o=np.full(5 * hidden, -2, np.float32))
    wt = bufs("weights", w=raw)["w"]
    vops.patch_embed(t["img"], Weight(wt, Q.F16, hidden, channels * patch * patch), None,
                     view(t["o"], 4 * hidden), channels, side, side, patch)
    vops.sync()
    o = f32(t["o"], (5, hidden))
    assert np.all(o[0] == -2)
    ref = conv_ref(img, w, None, patch)
    mag = conv_ref(np.abs(img), np.abs(w), None, patch)
    assert max_ratio(o[1:] - ref, 1e-5 * mag + 1e-6) <= 1


def test_patch_embed_refusals(vops, bufs, rng):
    t = bufs(img=4 * 3 * 28 * 28, o=4 * 4 * 8, w=2 * 8 * 3 * 14 * 14, q=34 * 8 * 3 * 14 * 14 // 32)
    w = Weight(t["w"], Q.F16, 8, 3 * 14 * 14)
    with pytest.raises(UsageError, match="whole number"):
        vops.patch_embed(t["img"], w, None, t["o"], 3, 28, 27, 14)
    with pytest.raises(ModelError, match="need 147"):
        vops.patch_embed(t["img"], w, None, t["o"], 3, 7, 7, 7)
    with pytest.raises(ModelError, match="Q8_0"):
        vops.patch_embed(t["img"], Weight(t["q"], Q.Q8_0, 8, 3 * 14 * 14 - 12), None, t["o"], 3, 28, 28, 14)


# -- average pool ------------------------------------------------------------------

def avg_pool_ref(x, side, pool):
    hidden = x.shape[1]
    g = x.astype(np.float64).reshape(side // pool, pool, side // pool, pool, hidden)
    return g.mean(axis=(1, 3)).reshape(-1, hidden)


@pytest.mark.parametrize("side,pool,hidden", [(64, 4, 40), (12, 3, 37), (5, 5, 3), (7, 1, 9)])
def test_avg_pool_2d(vops, bufs, rng, side, pool, hidden):
    """(64, 4): the Gemma 3 projector's 64 x 64 -> 16 x 16 (at a small
    hidden); pool 1 is the identity.  The reference averages
    pool x pool blocks of the [side, side, hidden] grid.  Tolerance 1e-6
    (a mean of at most 25 values of order 1)."""
    x = rng.standard_normal((side * side, hidden)).astype(np.float32)
    t = bufs(x=x, o=4 * (side // pool) ** 2 * hidden)
    vops.avg_pool_2d(t["x"], t["o"], side, pool, hidden)
    vops.sync()
    ref = avg_pool_ref(x, side, pool)
    np.testing.assert_allclose(f32(t["o"], ref.shape), ref, rtol=1e-6, atol=1e-6)


def test_avg_pool_2d_refuses_a_ragged_grid(vops, bufs):
    t = bufs(x=4 * 36, o=4 * 36)
    with pytest.raises(UsageError, match="6x6 grid"):
        vops.avg_pool_2d(t["x"], t["o"], 6, 4, 1)


# -- linear layers through Ops.matvec ------------------------------------------------

@pytest.mark.parametrize("qtype", [Q.F32, Q.F16], ids=lambda t: t.name)
def test_linear_577_tokens_with_bias(vops, bufs, rng, qtype):
    """A ViT linear layer over 577 tokens: the tiled matmul (19 token tiles,
    the last with one token) then the bias broadcast over token rows.
    Odd sizes (rows 130, k 257).  Tolerance 2e-6 relative to sum |w| |x| of
    each output + 1e-6 (as test_kernels.py's matvec)."""
    n_tokens, rows, cols = 577, 130, 257
    raw, w = rounded(rng, qtype, (rows, cols))
    x = rng.standard_normal((n_tokens, cols)).astype(np.float32)
    b = rng.standard_normal(rows).astype(np.float32)
    t = bufs(x=x, b=b, y=4 * n_tokens * rows)
    wt = bufs("weights", w=raw)["w"]
    with vops.batch():
        vops.matvec(Weight(wt, qtype, rows, cols), t["x"], t["y"], n_tokens)
        vops.add(t["y"], t["b"], t["y"], n_tokens * rows, b_len=rows)
    vops.sync()
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    ref = x64 @ w64.T + b
    mag = np.abs(x64) @ np.abs(w64).T
    assert max_ratio(f32(t["y"], ref.shape) - ref, 2e-6 * mag + 1e-6) <= 1


# -- a whole ViT block in one batch ---------------------------------------------------

def test_vit_block_in_one_batch(vops, bufs, rng):
    """A pre-norm ViT encoder layer as clip.cpp builds it, recorded into one
    batch (each op ordered after the one before it): patch embedding +
    position embedding, LN1, Q/K/V linear layers with biases, full
    attention, output projection, residual, LN2, fc1, GELU (quick), fc2,
    residual; then the 2x2 average pool.  Against the same chain in float64
    numpy.  Tolerance 2e-4 absolute + 1e-4 relative over outputs of order
    1-10: the f32 errors of eleven ops compound, a wrong order or a missing
    barrier does not stay near that."""
    channels, side_px, patch, hidden, n_heads, n_ff, eps = 3, 56, 14, 64, 4, 96, 1e-6
    side = side_px // patch
    n = side * side
    hd = hidden // n_heads
    img = rng.standard_normal((channels, side_px, side_px)).astype(np.float32)
    pw = (rng.standard_normal((hidden, channels, patch, patch)) * 0.05).astype(np.float16)
    pb = rng.standard_normal(hidden).astype(np.float32) * 0.1
    pos = rng.standard_normal((n, hidden)).astype(np.float32) * 0.1

    def lin(rows, cols):
        return ((rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float16),
                (rng.standard_normal(rows) * 0.1).astype(np.float32))

    wq, wk, wv, wo = (lin(hidden, hidden) for _ in range(4))
    w1, w2 = lin(n_ff, hidden), lin(hidden, n_ff)
    ln = [(1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32) for _ in range(2)]
    lb = [(0.1 * rng.standard_normal(hidden)).astype(np.float32) for _ in range(2)]

    wts = bufs("weights", pw=pw, wq=wq[0], wk=wk[0], wv=wv[0], wo=wo[0], w1=w1[0], w2=w2[0])
    t = bufs(img=img, pb=pb, pos=pos, bq=wq[1], bk=wk[1], bv=wv[1], bo=wo[1], b1=w1[1], b2=w2[1],
             ln1=ln[0], lb1=lb[0], ln2=ln[1], lb2=lb[1],
             x=4 * n * hidden, h=4 * n * hidden, q=4 * n * hidden, k=4 * n * hidden, v=4 * n * hidden,
             a=4 * n * hidden, f=4 * n * n_ff, pooled=4 * n // 4 * hidden)

    def linear(w, b, src, dst, rows, cols):
        vops.matvec(Weight(wts[w], Q.F16, rows, cols), t[src], t[dst], n)
        vops.add(t[dst], t[b], t[dst], n * rows, b_len=rows)

    with vops.batch():
        vops.patch_embed(t["img"], Weight(wts["pw"], Q.F16, hidden, channels * patch * patch), t["pb"], t["x"],
                         channels, side_px, side_px, patch)
        vops.add(t["x"], t["pos"], t["x"], n * hidden)
        vops.layer_norm(t["x"], t["ln1"], t["lb1"], t["h"], eps, n, hidden)
        with vops.parallel():
            linear("wq", "bq", "h", "q", hidden, hidden)
            linear("wk", "bk", "h", "k", hidden, hidden)
            linear("wv", "bv", "h", "v", hidden, hidden)
        vops.attention_full(t["q"], t["k"], t["v"], t["a"], n, n_heads, hd, hd ** -0.5)
        linear("wo", "bo", "a", "h", hidden, hidden)
        vops.add(t["x"], t["h"], t["x"], n * hidden)
        vops.layer_norm(t["x"], t["ln2"], t["lb2"], t["h"], eps, n, hidden)
        linear("w1", "b1", "h", "f", n_ff, hidden)
        vops.gelu(t["f"], t["f"], n * n_ff, "quick")
        linear("w2", "b2", "f", "h", hidden, n_ff)
        vops.add(t["x"], t["h"], t["x"], n * hidden)
        vops.avg_pool_2d(t["x"], t["pooled"], side, 2, hidden)
    vops.sync()

    def lin_ref(a, wb):
        return a @ wb[0].astype(np.float64).T + wb[1]

    x = conv_ref(img, pw.astype(np.float32), pb, patch) + pos
    h = layer_norm_ref(x, ln[0], lb[0], eps)
    att = attention_ref(lin_ref(h, wq), lin_ref(h, wk), lin_ref(h, wv), n_heads, hd, hd ** -0.5)
    x = x + lin_ref(att, wo)
    f = lin_ref(layer_norm_ref(x, ln[1], lb[1], eps), w1)
    f = f / (1 + np.exp(-1.702 * f))
    x = x + lin_ref(f, w2)
    np.testing.assert_allclose(f32(t["x"], x.shape), x, rtol=1e-4, atol=2e-4)
    np.testing.assert_allclose(f32(t["pooled"], (n // 4, hidden)), avg_pool_ref(x, side, 2), rtol=1e-4,
                               atol=2e-4)


# -- offsets ---------------------------------------------------------------------------

def test_every_binding_at_an_unaligned_offset(vops, bufs, rng):
    """Each kernel with every buffer bound through a view one element past a
    storage-aligned start (one float; one half for the F16 patch kernel), so
    each offset the shaders add is non-zero: a dropped offset reads the pad
    (value 1e4) or writes one element early (caught by the pads kept)."""
    pad = np.float32(1e4)

    def padded(a):
        return np.concatenate([[pad], np.asarray(a, np.float32).reshape(-1)])

    def v1(tensor):
        return view(tensor, 4)

    # attention_full: q, k, v, out
    n, heads, hd = 21, 2, 12
    q, k, v = (rng.standard_normal((n, heads * hd)).astype(np.float32) for _ in range(3))
    t = bufs(q=padded(q), k=padded(k), v=padded(v), o=padded(np.zeros(n * heads * hd)))
    vops.attention_full(v1(t["q"]), v1(t["k"]), v1(t["v"]), v1(t["o"]), n, heads, hd, 0.3)
    # layer_norm: x, w, b, y
    x = rng.standard_normal((3, 50)).astype(np.float32)
    w, b = rng.standard_normal(50).astype(np.float32), rng.standard_normal(50).astype(np.float32)
    t.update(bufs(x=padded(x), w=padded(w), b=padded(b), y=padded(np.zeros(x.size))))
    vops.layer_norm(v1(t["x"]), v1(t["w"]), v1(t["b"]), v1(t["y"]), 1e-5, 3, 50)
    # gelu: x, y
    t.update(bufs(gy=padded(np.zeros(x.size))))
    vops.gelu(v1(t["x"]), v1(t["gy"]), x.size, "erf")
    # avg_pool_2d: x, out
    g = rng.standard_normal((16, 5)).astype(np.float32)
    t.update(bufs(g=padded(g), gp=padded(np.zeros(4 * 5))))
    vops.avg_pool_2d(v1(t["g"]), v1(t["gp"]), 4, 2, 5)
    # patch_embed: image, F16 weight one half in, bias, out
    img = rng.standard_normal((2, 6, 9)).astype(np.float32)
    pw = rng.standard_normal((7, 2, 3, 3)).astype(np.float16)
    pb = rng.standard_normal(7).astype(np.float32)
    wraw = np.concatenate([np.array([np.float16(1e4)]), pw.reshape(-1)])
    wt = bufs("weights", w=wraw)["w"]
    t.update(bufs(img=padded(img), pb=padded(pb), po=padded(np.zeros(6 * 7))))
    vops.patch_embed(v1(t["img"]), Weight(view(wt, 2), Q.F16, 7, 18), v1(t["pb"]), v1(t["po"]), 2, 6, 9, 3)
    vops.sync()

    def got(name, shape):
        a = f32(t[name])
        assert a[0] == pad, f"{name}: the element before the view was written"
        return a[1:1 + int(np.prod(shape))].reshape(shape)

    np.testing.assert_allclose(got("o", q.shape), attention_ref(q, k, v, heads, hd, 0.3), rtol=5e-6, atol=5e-6)
    np.testing.assert_allclose(got("y", x.shape), layer_norm_ref(x, w, b, 1e-5), rtol=1e-5, atol=2e-5)
    erf = np.array([GELU_REF["erf"](float(a)) for a in x.reshape(-1)]).reshape(x.shape)
    np.testing.assert_allclose(got("gy", x.shape), erf, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(got("gp", (4, 5)), avg_pool_ref(g, 4, 2), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got("po", (6, 7)), conv_ref(img, pw.astype(np.float32), pb, 3), rtol=1e-5,
                               atol=1e-5)


# -- a synthetic mmproj's whole encoder against the numpy reference ----------------------

def encode_on_device(vops, bufs, path, pixels):
    """The tower and projector of the mmproj file at `path`, composed from
    VisionOps as clip.cpp's graph runs them (the order of
    tests/engine/reference/vision.py), in one batch: (tower output
    [n_pos, n_embd], projector output [n_tokens, n_text]).  The tensors are
    uploaded as the file's bytes, except mm.input_projection (gemma3), which
    llama.cpp multiplies transposed (y = x W, W numpy [n_embd, n_text]): it
    goes up transposed once, as a loader would place it for matvec."""
    from vramd.model.gguf_check import validate_gguf
    from vramd.model.mmproj import load_mmproj

    mf = validate_gguf(path)
    cfg, info = load_mmproj(mf)
    raw = {}
    with open(path, "rb") as f:
        for name in info.names:
            ti = mf.tensor(name)
            f.seek(ti.offset)
            raw[name] = np.frombuffer(f.read(ti.nbytes), np.uint8)
    types = {name: mf.tensor(name).type for name in info.names}
    shapes = {name: mf.tensor(name).shape for name in info.names}
    if cfg.projector == "gemma3":
        name = "mm.input_projection.weight"
        w = raw[name].view(np.float16 if types[name] == Q.F16 else np.float32).reshape(tuple(reversed(shapes[name])))
        raw[name] = np.ascontiguousarray(w.T).view(np.uint8).reshape(-1)
        shapes[name] = tuple(reversed(shapes[name]))
    keys = {name: f"t{i}" for i, name in enumerate(raw)}  # region tensor names
    wt = bufs("weights", **{keys[n]: a for n, a in raw.items()})

    def T(name):
        return wt[keys[name]] if name in keys else None

    def W(name):
        cols, rows = shapes[name][0], int(np.prod(shapes[name][1:]))
        return Weight(T(name), types[name], rows, cols)

    e, side, p = cfg.n_embd, cfg.patches_per_side, cfg.patch_size
    cls = 1 if info.has_class_embd else 0
    n = cfg.n_patches + cls
    text = info.n_embd_text
    t = bufs(img=pixels.astype(np.float32), x=4 * n * e, h=4 * n * e, q=4 * n * e, k=4 * n * e, v=4 * n * e,
             a=4 * n * e, f=4 * n * cfg.n_ff, pooled=4 * cfg.n_patches * e, m=4 * n * text, y=4 * n * text)

    def linear(name, src, dst, n_tok):
        w = W(name + ".weight")
        vops.matvec(w, src, dst, n_tok)
        if T(name + ".bias") is not None:
            vops.add(dst, T(name + ".bias"), dst, n_tok * w.rows, b_len=w.rows)

    with vops.batch():
        if cls:
            vops.copy(T("v.class_embd"), t["x"], 4 * e)
        vops.patch_embed(t["img"], Weight(T("v.patch_embd.weight"), types["v.patch_embd.weight"], e, 3 * p * p),
                         T("v.patch_embd.bias"), view(t["x"], 4 * e * cls), 3, cfg.image_size, cfg.image_size, p)
        vops.add(t["x"], T("v.position_embd.weight"), t["x"], n * e)
        if info.has_pre_ln:
            vops.layer_norm(t["x"], T("v.pre_ln.weight"), T("v.pre_ln.bias"), t["x"], cfg.eps, n, e)
        for i in range(cfg.n_layer_run):
            b = f"v.blk.{i}."
            vops.layer_norm(t["x"], T(b + "ln1.weight"), T(b + "ln1.bias"), t["h"], cfg.eps, n, e)
            with vops.parallel():
                for m in "qkv":
                    linear(b + "attn_" + m, t["h"], t[m], n)
            vops.attention_full(t["q"], t["k"], t["v"], t["a"], n, cfg.n_head, cfg.head_dim, cfg.head_dim ** -0.5)
            linear(b + "attn_out", t["a"], t["h"], n)
            vops.add(t["x"], t["h"], t["x"], n * e)
            vops.layer_norm(t["x"], T(b + "ln2.weight"), T(b + "ln2.bias"), t["h"], cfg.eps, n, e)
            up, down = info.ffn_names[i]
            linear(up, t["h"], t["f"], n)
            vops.activation(t["f"], t["f"], n * cfg.n_ff, cfg.ffn_act)
            linear(down, t["f"], t["h"], n)
            vops.add(t["x"], t["h"], t["x"], n * e)
        if info.has_post_ln:
            vops.layer_norm(t["x"], T("v.post_ln.weight"), T("v.post_ln.bias"), t["x"], cfg.eps, n, e)
        if cfg.projector == "mlp":
            patches = view(t["x"], 4 * e * cls)  # the class position is dropped
            linear("mm.0", patches, t["m"], cfg.n_patches)
            vops.gelu(t["m"], t["m"], cfg.n_patches * text, "tanh")
            linear("mm.2", t["m"], t["y"], cfg.n_patches)
        else:
            vops.avg_pool_2d(t["x"], t["pooled"], side, cfg.n_merge, e)
            vops.rms_norm(t["pooled"], T("mm.soft_emb_norm.weight"), t["pooled"], cfg.eps, cfg.n_tokens, e)
            vops.matvec(W("mm.input_projection.weight"), t["pooled"], t["y"], cfg.n_tokens)
    vops.sync()
    return f32(t["x"], (n, e)), f32(t["y"], (cfg.n_tokens, text))


@pytest.mark.parametrize("projector,more", [
    ("mlp", {}),                                    # CLIP-style: class token, pre-norm, quick GELU
    ("mlp", {"weight_type": "F32", "image_size": 56, "patch_size": 14, "n_head": 2, "n_layer": 3,
             "feature_layer": 2}),                 # head_dim 32, 17 positions, F32, 2 of 3 layers run
    ("gemma3", {}),                                 # SigLIP-style: patch bias, post-norm, tanh GELU, pool 2
    ("gemma3", {"image_size": 64, "n_merge": 4}),   # an 8x8 grid pooled 4x4 (the real model's pool)
], ids=["mlp", "mlp-f32-56px", "gemma3", "gemma3-pool4"])
def test_encoder_matches_reference_vision(vops, bufs, rng, tmp_path, projector, more):
    """The whole encoder of a synthetic mmproj file (tests/ggufgen/vision.py)
    through the device kernels equals tests/engine/reference/vision.py (float64
    numpy, written from llama.cpp's clip graph by another hand): the layouts
    assumed here (image planes, patch kernel, raster order, pooling grid,
    head split) are the reference's.  Tolerance 1e-5 x the output's largest
    magnitude: f32 through two or three layers against float64 (measured on
    lavapipe: at most 9e-7 of it); a wrong layout is off by the order of the
    values, and even the erf GELU in place of the tanh one is caught."""
    from tests.ggufgen.vision import write_mmproj
    from tests.engine.reference.vision import ReferenceVision

    path = write_mmproj(tmp_path / "mmproj.gguf", projector, **more)
    ref = ReferenceVision(path)
    s = ref.cfg.image_size
    pixels = rng.standard_normal((3, s, s)).astype(np.float32)
    tower_ref = ref.tower(pixels)
    out_ref = ref.project(tower_ref)
    tower, out = encode_on_device(vops, bufs, path, pixels)
    for got, want, what in ((tower, tower_ref, "tower"), (out, out_ref, "projector")):
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err <= 1e-5, f"{what}: max error {err:.3g} of the largest value"
