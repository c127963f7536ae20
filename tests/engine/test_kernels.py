"""Every compute kernel of vramd/engine/ops.py against numpy, on real Vulkan
(lavapipe in CI).

References are computed in float64 from exactly the values the kernel sees:
quantized weights made with gguf.quants.quantize and expanded with
gguf.quants.dequantize; F16/BF16 weights rounded first; the KV cache read back
as float16.  Tolerances, stated per test, cover f32 accumulation (matvec and
attention sum thousands of terms in a different order than numpy) and the
GPU's exp/sin/cos; they are far below what a wrong index or a wrong block
layout produces (errors of the order of the values themselves).
"""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from vramd.errors import ModelError, UsageError
from vramd.engine.ops import Weight, view

MiB = 1 << 20














def f32(t, n=None):
    a = t.read(np.float32)
    return a if n is None else a[:n]


def weights(rng, qtype, rows, cols):
    """(bytes to upload, the float32 matrix they mean)."""
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    if qtype == Q.F32:
        return w, w
    if qtype == Q.F16:
        h = w.astype(np.float16)
        return h, h.astype(np.float32)
    if qtype == Q.BF16:
        b = (w.view(np.uint32) >> 16).astype(np.uint16)  # truncation: any bf16 value will do
        return b, (b.astype(np.uint32) << 16).view(np.float32)
    q = quantize(w, qtype)
    return q, dequantize(q, qtype)


def close_to_dot(y, ref, mag, rel=2e-6):
    """|y - ref| <= rel * sum|w||x| + 1e-6: f32 accumulation error scales
    with the sum of the magnitudes of the terms."""
    err = np.abs(y - ref)
    bound = rel * mag + 1e-6
    assert np.all(err <= bound), f"max error {err.max():.3g}, worst ratio {np.max(err / bound):.3g}"


TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,cols,n_tokens", [(37, 416, 1), (37, 416, 11), (5, 32 * 150, 3), (3, 64, 8),
                                                    (130, 96, 70)])
def test_matvec(ops, linear_form, bufs, rng, qtype, rows, cols, n_tokens):
    """n_tokens 1 and 3: one token per work group (decode form); 8, 11 and
    70: tiles of 64 rows x 32 tokens (prefill form), partial in both, and 130
    rows x 70 tokens spanning several tiles each way.  The portable kernels:
    on a GPU with cooperative matrices the prefill form would be matmul_cm,
    whose f16 tiles are test_matmul_cm.py's (this f32 bound is not theirs)."""
    if qtype in (Q.F32, Q.F16, Q.BF16):
        cols += 1  # odd, not a multiple of the work group (float types have no blocks)
    raw, w = weights(rng, qtype, rows, cols)
    x = rng.standard_normal((n_tokens, cols)).astype(np.float32)
    # x starts one float into its tensor: an offset that is not storage-aligned.
    xpad = np.concatenate([[np.float32(7)], x.reshape(-1)])
    wt = bufs("weights", w=raw)["w"]
    t = bufs(x=xpad, y=4 * n_tokens * rows)
    cm, ops.coopmat = ops.coopmat, False
    try:
        ops.matvec(Weight(wt, qtype, rows, cols), view(t["x"], 4), t["y"], n_tokens)
        ops.sync()
    finally:
        ops.coopmat = cm
    y = f32(t["y"]).reshape(n_tokens, rows)
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    close_to_dot(y, ref, np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.F16], ids=lambda t: t.name)
def test_a_steps_decode_rows_take_the_kernel_of_a_lone_token(ops, bufs, rng, qtype):
    """A mixed step (TransformerModel._set_segs: ops.token_rows) of a decode row, a 20-token
    prefill chunk and 17 more decode rows: every decode row's output is bit for bit the one
    token's matvec alone, whatever kernel the chunk's (or 17 rows') size would select (f16
    tensor-core tiles on a GPU, matmul_c on a CPU device); the chunk's rows as a 20-token matvec."""
    rows, cols = 70, 512
    raw, _w = weights(rng, qtype, rows, cols)
    runs = [(0, 1, True), (1, 20, False), (21, 17, True)]
    n = 38
    x = rng.standard_normal((n, cols)).astype(np.float32)
    wt = bufs("weights", w=raw)["w"]
    t = bufs(x=x, y=4 * n * rows, y1=4 * rows, yc=4 * 20 * rows)
    wgt = Weight(wt, qtype, rows, cols)
    ops.token_rows = (n, runs)
    try:
        ops.matvec(wgt, t["x"], t["y"], n)
    finally:
        ops.token_rows = None
    ops.sync()
    got = f32(t["y"]).reshape(n, rows)
    for r in [0, *range(21, 38)]:
        ops.matvec(wgt, view(t["x"], 4 * r * cols), t["y1"], 1)
        ops.sync()
        assert np.array_equal(got[r], f32(t["y1"])), r
    ops.matvec(wgt, view(t["x"], 4 * cols), t["yc"], 20)
    ops.sync()
    assert np.array_equal(got[1:21], f32(t["yc"]).reshape(20, rows))


def test_matvec_strides_write_into_wider_rows(ops, linear_form, bufs, rng):
    """y_stride > rows: three matvecs fill one fused [tokens, q|k|v] buffer.  With
    cooperative matrices these 16 tokens (linear.CM_FROM) go to matmul_cm, which rounds x and
    each dequantized weight to f16 (2^-11 relative each): its bound is 1.1e-3 * sum|w||x|."""
    n_tokens, cols = 16, 64
    parts = [weights(rng, Q.Q8_0, r, cols) for r in (24, 8, 8)]
    x = rng.standard_normal((n_tokens, cols)).astype(np.float32)
    t = bufs(x=x, y=np.full(n_tokens * 40, -1, np.float32))
    offset = 0
    for raw, w in parts:
        wt = bufs("weights", w=raw)["w"]
        ops.matvec(Weight(wt, Q.Q8_0, w.shape[0], cols), t["x"], view(t["y"], 4 * offset), n_tokens, y_stride=40)
        offset += w.shape[0]
    ops.sync()
    wall = np.concatenate([w for _, w in parts]).astype(np.float64)
    ref = x.astype(np.float64) @ wall.T
    if ops.coopmat:
        close_to_dot(f32(t["y"]).reshape(n_tokens, 40), ref, np.abs(x).astype(np.float64) @ np.abs(wall).T, 1.1e-3)
    else:
        np.testing.assert_allclose(f32(t["y"]).reshape(n_tokens, 40), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_get_rows(ops, bufs, rng, qtype):
    rows, cols = 50, 96 if qtype in (Q.Q8_0, Q.Q4_0) else 95
    raw, table = weights(rng, qtype, rows, cols)
    ids = np.array([0, 49, 7, 7, 23, 1], np.int32)
    stride = cols + 3  # the padding between rows must stay untouched
    t = bufs(ids=ids, out=np.full(len(ids) * stride, -5, np.float32))
    wt = bufs("weights", w=raw)["w"]
    ops.get_rows(Weight(wt, qtype, rows, cols), t["ids"], t["out"], len(ids), o_stride=stride)
    ops.sync()
    out = f32(t["out"]).reshape(len(ids), stride)
    np.testing.assert_array_equal(out[:, :cols], table[ids])  # exact: a decode, no arithmetic beyond f16*int
    assert np.all(out[:, cols:] == -5)


@pytest.mark.parametrize("n_tokens,width", [(1, 4096), (3, 1000), (2, 5000), (2, 301)])
def test_rms_norm(ops, bufs, rng, n_tokens, width):
    x = rng.standard_normal((n_tokens, width)).astype(np.float32) * 3
    w = rng.standard_normal(width).astype(np.float32)
    eps = 1e-5
    t = bufs(x=x, w=w, y=4 * x.size)
    ops.rms_norm(t["x"], t["w"], t["y"], eps, n_tokens, width)
    ops.rms_norm(t["x"], t["w"], t["x"], eps, n_tokens, width)  # in place
    ops.sync()
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt(np.mean(x64 * x64, axis=1, keepdims=True) + eps) * w
    np.testing.assert_allclose(f32(t["y"]).reshape(x.shape), ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(f32(t["x"]).reshape(x.shape), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n_tokens,width", [(6, 128), (3, 301)])   # vec4 rows and the scalar loop
def test_rms_norm_without_weight(ops, bufs, rng, n_tokens, width):
    """w None (gemma4's V norm): the rows normalised, no weight read."""
    x = rng.standard_normal((n_tokens, width)).astype(np.float32) * 3
    t = bufs(x=x, y=4 * x.size)
    ops.rms_norm(t["x"], None, t["y"], 1e-6, n_tokens, width)
    ops.sync()
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt(np.mean(x64 * x64, axis=1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(f32(t["y"]).reshape(x.shape), ref, rtol=1e-5, atol=1e-6)


def rope_ref(x, pos, n_rot, neox, base, scale, factors=None):
    x = x.astype(np.float64).copy()
    i = np.arange(n_rot // 2)
    inv = base ** (-2.0 * i / n_rot)
    if factors is not None:
        inv = inv / factors
    theta = scale * pos[:, None].astype(np.float64) * inv  # [tokens, n_rot/2]
    c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    a_idx = i if neox else 2 * i
    b_idx = i + n_rot // 2 if neox else 2 * i + 1
    a, b = x[:, :, a_idx].copy(), x[:, :, b_idx].copy()
    x[:, :, a_idx] = a * c - b * s
    x[:, :, b_idx] = a * s + b * c
    return x


@pytest.mark.parametrize("neox", [False, True], ids=["normal", "neox"])
@pytest.mark.parametrize("n_rot,freq_scale,factors", [(64, 1.0, False), (32, 0.25, False), (64, 1.0, True)],
                         ids=["full", "partial-linear", "freq-factors"])
def test_rope(ops, bufs, rng, neox, n_rot, freq_scale, factors):
    n_tokens, n_heads, head_dim, base = 5, 3, 64, 500000.0
    pos = np.array([0, 1, 17, 2047, 5000], np.int32)
    x = rng.standard_normal((n_tokens, n_heads, head_dim)).astype(np.float32)
    ff = (1.0 + rng.random(n_rot // 2) * 7).astype(np.float32) if factors else None
    items = dict(x=x, pos=pos)
    if factors:
        items["ff"] = ff
    t = bufs(**items)
    ops.rope(t["x"], t["pos"], n_tokens, n_heads, head_dim, n_rot=n_rot, neox=neox, freq_base=base,
             freq_scale=freq_scale, freq_factors=t["ff"] if factors else None)
    ops.sync()
    ref = rope_ref(x, pos, n_rot, neox, base, freq_scale, ff)
    # theta = pos * inv_freq is formed in f32: its error grows with the
    # position (~ pos * 6e-8 rad), the one term the tolerance must allow.
    tol = 1e-5 + 2e-7 * pos.astype(np.float64)[:, None, None]
    err = np.abs(f32(t["x"]).reshape(x.shape) - ref)
    assert np.all(err <= tol), err.max()
    assert np.array_equal(f32(t["x"]).reshape(x.shape)[:, :, n_rot:], x[:, :, n_rot:])  # untouched dims


def attention_ref(q, kc, vc, pos, n_kv, scale, window=0, softcap=0.0):
    n_tokens, n_heads, hd = q.shape
    group = n_heads // n_kv
    out = np.zeros((n_tokens, n_heads * hd))
    k = kc.astype(np.float64).reshape(len(kc), n_kv, hd)
    v = vc.astype(np.float64).reshape(len(vc), n_kv, hd)
    for t in range(n_tokens):
        first = max(0, pos[t] + 1 - window) if window else 0
        for h in range(n_heads):
            kk, vv = k[first:pos[t] + 1, h // group], v[first:pos[t] + 1, h // group]
            s = kk @ q[t, h].astype(np.float64) * scale
            if softcap:
                s = softcap * np.tanh(s / softcap)
            p = np.exp(s - s.max())
            out[t, h * hd:(h + 1) * hd] = p @ vv / p.sum()
    return out


@pytest.mark.parametrize("n_heads,n_kv,hd,p0,n_tokens,window", [
    (8, 2, 64, 150, 5, 0),    # GQA 4:1, two key tiles, prefill of 5 tokens at p0 > 0
    (4, 4, 40, 0, 1, 0),      # decode of the first token (one key); head_dim not a multiple of anything
    (2, 1, 256, 300, 2, 0),   # head_dim 256 (two dims per thread)
    (4, 2, 32, 200, 3, 64),   # sliding window
])
def test_kv_write_and_attention(ops, bufs, rng, n_heads, n_kv, hd, p0, n_tokens, window):
    ctx, width = 400, n_kv * hd
    # The cache before: p0 rows written by an earlier batch (a prompt).
    k_old = rng.standard_normal((max(p0, 1), width)).astype(np.float32)
    v_old = rng.standard_normal((max(p0, 1), width)).astype(np.float32)
    k_new = rng.standard_normal((n_tokens, width)).astype(np.float32)
    v_new = rng.standard_normal((n_tokens, width)).astype(np.float32)
    q = rng.standard_normal((n_tokens, n_heads, hd)).astype(np.float32)
    t = bufs(k_old=k_old, v_old=v_old, pos_old=np.arange(len(k_old), dtype=np.int32), k_new=k_new, v_new=v_new,
             pos=np.arange(p0, p0 + n_tokens, dtype=np.int32), q=q, out=4 * n_tokens * n_heads * hd,
             kc=2 * ctx * width, vc=2 * ctx * width)
    scale = 1 / np.sqrt(hd)
    if p0:
        ops.kv_write(t["k_old"], t["kc"], t["pos_old"], p0, width, ctx)
        ops.kv_write(t["v_old"], t["vc"], t["pos_old"], p0, width, ctx)
    # The f32 kernels (this bound is theirs): on a GPU the tensor-core prefill attention's f16
    # P and V are test_attention_flash_cm.py's.
    flash_cm, ops.flash_cm = ops.flash_cm, False
    try:
        with ops.batch():
            ops.kv_write(t["k_new"], t["kc"], t["pos"], n_tokens, width, ctx)
            ops.kv_write(t["v_new"], t["vc"], t["pos"], n_tokens, width, ctx)
            ops.attention(t["q"], t["kc"], t["vc"], t["pos"], t["out"], n_tokens, n_heads, n_kv, hd, ctx, scale,
                          window=window)
    finally:
        ops.flash_cm = flash_cm
    ops.sync()
    kc = t["kc"].read(np.float16).reshape(ctx, width)
    vc = t["vc"].read(np.float16).reshape(ctx, width)
    # The cache holds f16 of what was written: within half an f16 ulp
    # (round to nearest; 2^-11 relative).
    for cache, old, new in ((kc, k_old, k_new), (vc, v_old, v_new)):
        written = np.concatenate([old[:p0], new])
        np.testing.assert_allclose(cache[:p0 + n_tokens].astype(np.float32), written, rtol=2 ** -11, atol=1e-7)
    pos = np.arange(p0, p0 + n_tokens)
    ref = attention_ref(q, kc, vc, pos, n_kv, scale, window)
    # f32 scores and exp over <= 400 keys: 1e-5 relative to the values (|v| ~ 1).
    np.testing.assert_allclose(f32(t["out"]).reshape(n_tokens, -1), ref, rtol=1e-4, atol=2e-5)


def test_kv_write_skips_positions_beyond_the_cache(ops, bufs):
    ctx, width = 4, 8
    t = bufs(src=np.ones((2, width), np.float32), pos=np.array([3, 4], np.int32),
             kc=np.zeros(ctx * width + 16, np.float16))  # 16 guard halves after the cache
    ops.kv_write(t["src"], t["kc"], t["pos"], 2, width, ctx)
    ops.sync()
    kc = t["kc"].read(np.float16)
    assert np.all(kc[3 * width:4 * width] == 1) and np.all(kc[4 * width:] == 0) and np.all(kc[:3 * width] == 0)


def test_elementwise(ops, bufs, rng):
    n, width = 3 * 1000 + 1, 1000
    a = rng.standard_normal(n).astype(np.float32) * 4
    b = rng.standard_normal(n).astype(np.float32)
    bias = rng.standard_normal(width).astype(np.float32)
    t = bufs(a=a, b=b, bias=bias, s=4 * n, r=4 * n, bb=4 * (n - 1), sc=4 * n)
    with ops.batch():
        ops.silu_mul(t["a"], t["b"], t["s"], n)
        ops.add(t["a"], t["b"], t["r"], n)
        ops.add(t["a"], t["bias"], t["bb"], n - 1, b_len=width)  # bias over 3 token rows
        ops.scale(t["a"], t["sc"], n, 0.125)
    ops.sync()
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    # exp on the GPU: a few f32 ulps.
    np.testing.assert_allclose(f32(t["s"]), a64 / (1 + np.exp(-a64)) * b64, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(f32(t["r"]), a + b)  # one f32 add: exact
    np.testing.assert_array_equal(f32(t["bb"]), a[:n - 1] + np.tile(bias, 3))
    np.testing.assert_array_equal(f32(t["sc"]), a * np.float32(0.125))


def test_batch_records_a_layer_and_submits_once(ops, bufs, rng, res):
    """embed -> norm -> matvec -> residual add, recorded into one command
    buffer; dependent ops see each other's results through the barriers."""
    vocab, n_embd, n_tokens = 40, 64, 3
    raw, table = weights(rng, Q.Q4_0, vocab, n_embd)
    wraw, w = weights(rng, Q.Q8_0, n_embd, n_embd)
    norm = rng.standard_normal(n_embd).astype(np.float32)
    ids = np.array([3, 39, 0], np.int32)
    wt = bufs("weights", table=raw, w=wraw, norm=norm)
    t = bufs(ids=ids, x=4 * n_tokens * n_embd, h=4 * n_tokens * n_embd, y=4 * n_tokens * n_embd)
    with ops.batch() as b:
        submits = b.submits
        ops.get_rows(Weight(wt["table"], Q.Q4_0, vocab, n_embd), t["ids"], t["x"], n_tokens)
        ops.rms_norm(t["x"], wt["norm"], t["h"], 1e-6, n_tokens, n_embd)
        ops.matvec(Weight(wt["w"], Q.Q8_0, n_embd, n_embd), t["h"], t["y"], n_tokens)
        ops.add(t["y"], t["x"], t["y"], n_tokens * n_embd)
    assert b.dispatches == 4 and b.submits == submits + 1  # one command buffer, one vkQueueSubmit
    ops.sync()
    x = table[ids].astype(np.float64)
    h = x / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + 1e-6) * norm
    ref = h @ w.astype(np.float64).T + x
    np.testing.assert_allclose(f32(t["y"]).reshape(n_tokens, n_embd), ref, rtol=1e-4, atol=1e-4)


def test_graph_replays_at_new_positions(ops, bufs, rng):
    """A recorded decode graph is resubmitted with only the position and
    token-id buffers rewritten (the kernels read them on the device)."""
    n_heads, hd, vocab = 2, 16, 10
    raw, table = weights(rng, Q.F16, vocab, n_heads * hd)
    wt = bufs("weights", table=raw)
    t = bufs(ids=np.array([4], np.int32), pos=np.array([0], np.int32), x=4 * n_heads * hd)
    g = ops.graph()
    with ops.record(g):
        ops.get_rows(Weight(wt["table"], Q.F16, vocab, n_heads * hd), t["ids"], t["x"], 1)
        ops.rope(t["x"], t["pos"], 1, n_heads, hd, neox=True)
    for token, p in [(4, 0), (7, 9), (2, 123)]:
        t["ids"].write(np.array([token], np.int32))
        t["pos"].write(np.array([p], np.int32))
        g.submit()
        ops.sync()
        ref = rope_ref(table[[token]].reshape(1, n_heads, hd), np.array([p]), hd, True, 10000.0, 1.0)
        np.testing.assert_allclose(f32(t["x"]).reshape(1, n_heads, hd), ref, rtol=1e-5, atol=1e-4)


def test_table_larger_than_one_storage_view(ops, bufs, rng, res):
    """An F16 table beyond maxStorageBufferRange is bound in row chunks by
    matvec and get_rows; an activation that large is refused clearly."""
    limit = res.device.limits["maxStorageBufferRange"]
    if limit > 512 * MiB:
        pytest.skip("the device's storage range is too large to exceed cheaply (lavapipe: 128 MiB)")
    cols = 2048 + 2  # row bytes not a power of two: chunks start mid-alignment
    rows = limit // (2 * cols) + 300
    w = rng.standard_normal((rows, cols)).astype(np.float16)
    wt = bufs("weights", w=w)["w"]
    assert len(wt.views()) == 2
    ids = np.array([0, rows // 2, limit // (2 * cols) - 1, limit // (2 * cols), rows - 1], np.int32)
    x = rng.standard_normal(cols).astype(np.float32)
    t = bufs(ids=ids, e=4 * len(ids) * cols, x=x, y=4 * rows)
    wgt = Weight(wt, Q.F16, rows, cols)
    ops.get_rows(wgt, t["ids"], t["e"], len(ids))
    ops.matvec(wgt, t["x"], t["y"], 1)
    ops.sync()
    np.testing.assert_array_equal(f32(t["e"]).reshape(len(ids), cols), w[ids].astype(np.float32))
    y = f32(t["y"])
    for lo in (0, rows // 2 - 2000, limit // (2 * cols) - 1000, rows - 1000):  # spot checks on both chunks
        ws = w[lo:lo + 1000].astype(np.float64)
        close_to_dot(y[lo:lo + 1000], ws @ x, np.abs(ws) @ np.abs(x))
    with pytest.raises(UsageError, match="maxStorageBufferRange"):
        ops.scale(wt, wt, wt.nbytes // 4, 2.0)


def test_unsupported_weights_are_one_line_model_errors(bufs):
    t = bufs("weights", w=4096)["w"]
    with pytest.raises(ModelError, match=r"tensor type Q2_K is not supported") as e:
        Weight(t, Q.Q2_K, 1, 256)  # Q4_K, the example before, is supported now
    assert "\n" not in str(e.value)
    with pytest.raises(ModelError, match="multiple of 32"):
        Weight(t, Q.Q8_0, 2, 48)
    with pytest.raises(ModelError, match="needs 4352 bytes"):
        Weight(t, Q.Q8_0, 32, 128)
