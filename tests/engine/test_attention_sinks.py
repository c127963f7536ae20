"""Attention sinks (gpt-oss) in the attention kernels: attention_flash.comp (prefill),
attention.comp (prefill with flash=False,
and decode without scratch) and attention_split or attention_dec_n1g8 + attention_merge (decode),
against numpy: out = sum_j e^(s_j - M) v_j / (sum_j e^(s_j - M) + e^(sink_h - M)).

Sinks are drawn around the scores' scale and beyond (-3 .. 6: from a
negligible share to most of the mass, which shrinks the output towards 0),
with and without a sliding window; tolerances as test_kernels.py's attention
(f32 scores against f16 caches)."""

import numpy as np
import pytest

from tests.engine.test_kernels import f32
from vramd.engine.ops import view


@pytest.fixture(autouse=True)
def _portable(ops):
    """These test the portable kernels at f32 tolerances: the tensor-core form
    (attention_flash_cm, f16 Q and P) is tested in test_attention_flash_cm.py."""
    cm, ops.flash_cm = ops.flash_cm, False
    yield
    ops.flash_cm = cm


def sink_ref(q, kc, vc, pos, n_kv, scale, sinks, window=0):
    n_tokens, n_heads, hd = q.shape
    group = n_heads // n_kv
    out = np.zeros((n_tokens, n_heads * hd))
    k = kc.astype(np.float64).reshape(len(kc), n_kv, hd)
    v = vc.astype(np.float64).reshape(len(vc), n_kv, hd)
    for t in range(n_tokens):
        first = max(0, pos[t] + 1 - window) if window else 0
        for h in range(n_heads):
            s = k[first:pos[t] + 1, h // group] @ q[t, h].astype(np.float64) * scale
            m = max(s.max(), sinks[h])
            p = np.exp(s - m)
            out[t, h * hd:(h + 1) * hd] = p @ v[first:pos[t] + 1, h // group] / (p.sum() + np.exp(sinks[h] - m))
    return out


@pytest.mark.parametrize("n_tokens,p0,window,split", [(5, 150, 0, False), (3, 40, 16, False), (1, 200, 0, True),
                                                       (1, 90, 32, True), (1, 0, 0, True), (1, 70, 0, False)])
@pytest.mark.parametrize("form", ["new", "old"])
def test_sinks(ops, bufs, rng, n_tokens, p0, window, split, form, monkeypatch):
    """form: the decode split's (VRAMD_DECODE_ATTN: attention_dec_n1g8 or attention_split)."""
    monkeypatch.setattr(ops, "decode_attn", form)
    n_heads, n_kv, hd, ctx = 4, 2, 64, 256
    width = n_kv * hd
    rows = p0 + n_tokens
    k = rng.standard_normal((rows, width)).astype(np.float32)
    v = rng.standard_normal((rows, width)).astype(np.float32)
    q = rng.standard_normal((n_tokens, n_heads, hd)).astype(np.float32)
    sinks = np.array([-3.0, 0.5, 2.0, 6.0], np.float32)
    t = bufs(k=k, v=v, rows=np.arange(rows, dtype=np.int32), pos=np.arange(p0, rows, dtype=np.int32), q=q,
             sinks=np.concatenate([np.zeros(3, np.float32), sinks]), out=4 * n_tokens * n_heads * hd,
             kc=2 * ctx * width, vc=2 * ctx * width, tmp=4 * 1024 * 1024)
    ops.kv_write(t["k"], t["kc"], t["rows"], rows, width, ctx)
    ops.kv_write(t["v"], t["vc"], t["rows"], rows, width, ctx)
    scale = 1 / np.sqrt(hd)
    ops.attention(t["q"], t["kc"], t["vc"], t["pos"], t["out"], n_tokens, n_heads, n_kv, hd, ctx, scale,
                  window=window, tmp=t["tmp"] if split else None, sinks=view(t["sinks"], 12, 16))
    ops.sync()
    kc = t["kc"].read(np.float16).reshape(ctx, width)
    vc = t["vc"].read(np.float16).reshape(ctx, width)
    ref = sink_ref(q, kc, vc, np.arange(p0, rows), n_kv, scale, sinks.astype(np.float64), window)
    got = f32(t["out"]).reshape(n_tokens, -1)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=2e-5)
    # the sinks matter: without them the output differs by far more than the tolerance
    plain = sink_ref(q, kc, vc, np.arange(p0, rows), n_kv, scale, np.full(4, -np.inf), window)
    assert np.abs(plain - got).max() > 100 * 2e-5


@pytest.mark.parametrize("n_heads,n_kv,hd,p0,n_tokens,ctx,window", [
    (8, 2, 64, 0, 37, 101, 0),      # gpt-oss's head_dim and GQA 4 (64-row tiles), a first chunk
    (8, 2, 64, 90, 41, 140, 32),    # gpt-oss's sliding layers: a window shorter than the chunk
    (4, 1, 128, 101, 19, 333, 0),   # 32-row tiles, a chunk after earlier ones
    (16, 2, 256, 5, 7, 20, 8),      # 16-row tiles, GQA 8 over work groups, a window
    (4, 4, 40, 3, 9, 17, 0),        # GQA 1; head_dim 40: words not a multiple of a row's threads
])
@pytest.mark.parametrize("kernel", ["attention_flash", "attention_flash_k32"])
def test_flash_sinks(ops, bufs, rng, kernel, n_heads, n_kv, hd, p0, n_tokens, ctx, window):
    """Prefill with sinks takes the flash kernel (either K/V tile: test_attention_flash.py): against numpy and
    against attention.comp (flash=False)."""
    ops.flash = kernel
    width = n_kv * hd
    kc = rng.standard_normal((ctx, width)).astype(np.float16)
    vc = rng.standard_normal((ctx, width)).astype(np.float16)
    q = rng.standard_normal((n_tokens, n_heads, hd)).astype(np.float32)
    sinks = rng.uniform(-3.0, 6.0, n_heads).astype(np.float32)
    pos = np.arange(p0, p0 + n_tokens, dtype=np.int32)
    nbytes = 4 * n_tokens * n_heads * hd
    t = bufs(q=q, kc=kc, vc=vc, pos=pos, sinks=np.concatenate([np.zeros(5, np.float32), sinks]), out=nbytes,
             old=nbytes)
    scale = 1 / np.sqrt(hd)
    sv = view(t["sinks"], 20, 4 * n_heads)
    with ops.batch():
        ops.attention(t["q"], t["kc"], t["vc"], t["pos"], t["out"], n_tokens, n_heads, n_kv, hd, ctx, scale,
                      window=window, sinks=sv)
        ops.attention(t["q"], t["kc"], t["vc"], t["pos"], t["old"], n_tokens, n_heads, n_kv, hd, ctx, scale,
                      window=window, sinks=sv, flash=False)
    ops.sync()
    assert kernel in ops._kernels   # the tiled form ran
    got = f32(t["out"]).reshape(n_tokens, -1)
    ref = sink_ref(q, kc, vc, pos, n_kv, scale, sinks.astype(np.float64), window)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(got, f32(t["old"]).reshape(n_tokens, -1), rtol=1e-4, atol=2e-5)
    plain = sink_ref(q, kc, vc, pos, n_kv, scale, np.full(n_heads, -np.inf), window)
    assert np.abs(plain - got).max() > 100 * 2e-5
