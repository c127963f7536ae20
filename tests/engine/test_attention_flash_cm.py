"""The tensor-core prefill attention (attention_flash_cm_d<D>,
native/shaders/attention_flash_cm.glsl; vramd/engine/attention_cm.py) and its
choice in Ops.attention.

On lavapipe (no cooperative matrices): the kernel's tiling emulated in numpy
(attention_cm.emulate: its work groups' rows, key spans, 32-key steps, online
softmax and rescale, its f16 roundings) against the numpy reference
(test_kernels.attention_ref), and the selection's rules: lavapipe keeps
attention_flash.comp.  On a GPU (marked native_gpu: `VRAMD_TEST_DEVICE=native
pytest -m native_gpu`): the kernel against the emulation, the numpy reference
and attention_flash.comp on the same data, at odd chunk lengths and contexts,
chunks after earlier ones, windows, softcap, GQA 1/4/8, head sizes 64/128/256,
and gpt-oss's attention sinks (against attention.comp, which takes them).

Tolerances.  The kernel rounds Q * scale, K, V and the probabilities P to f16
and accumulates in f32.  Against the reference fed the same f16 Q * scale,
only P's rounding differs (half an f16 ulp, 2^-12 of each weight): |d| <= 3e-3 for
these |V| <= ~5.  Against the exact reference and the f32 kernel the scores'
roundings add up with the head size and the scale; the bound there is twice
what the emulation's own error is on the case, plus 1e-3: a wrong index, mask
or rescale gives errors of the order of the values.  Kernel vs emulation: the
same arithmetic in another order, where an exp a few f32 ulps off may round a
weight to the neighbouring f16 (2^-11 of it): 3e-3.
"""
import numpy as np
import pytest
from tests.engine.test_attention_sinks import sink_ref
from tests.engine.test_kernels import attention_ref, f32

from vramd.engine import attention_cm

CASES = [  # n_heads, n_kv, hd, p0, n_tokens, ctx, window, softcap
    (4, 4, 64, 0, 37, 101, 0, 0.0),      # GQA 1, a first chunk
    (8, 2, 128, 101, 33, 333, 0, 0.0),   # GQA 4, a chunk after 101 earlier tokens
    (8, 1, 64, 7, 65, 72, 0, 0.0),       # GQA 8; the chunk ends at the cache's last row
    (8, 2, 256, 50, 19, 97, 0, 0.0),     # head_dim 256, 4 query rows a token
    (4, 1, 128, 300, 21, 341, 64, 0.0),  # a sliding window inside the chunk's span
    (2, 1, 64, 10, 45, 99, 16, 0.0),     # a window shorter than the chunk: keys leave each tile
    (8, 4, 128, 30, 23, 61, 0, 5.0),     # gemma2's softcap (scores scaled up so that it bites)
    (32, 4, 128, 0, 9, 9, 0, 0.0),       # GQA 8 from position 0, 9 tokens: 72 rows over two work groups
]


def _case(rng, n_heads, n_kv, hd, p0, n_tokens, ctx, softcap):
    kc = rng.standard_normal((ctx, n_kv * hd)).astype(np.float16)
    vc = rng.standard_normal((ctx, n_kv * hd)).astype(np.float16)
    q = rng.standard_normal((n_tokens, n_heads, hd)).astype(np.float32)
    pos = np.arange(p0, p0 + n_tokens, dtype=np.int32)
    scale = (8.0 if softcap else 1.0) / np.sqrt(hd)
    return kc, vc, q, pos, scale


def _q16(q, scale):
    """Q * scale as the kernel holds it (f16), for the reference with scale 1."""
    return (q * np.float32(scale)).astype(np.float16).astype(np.float32)


@pytest.mark.parametrize("n_heads,n_kv,hd,p0,n_tokens,ctx,window,softcap", CASES[:3] + CASES[4:7])
def test_emulated_tiling_matches_reference(rng, n_heads, n_kv, hd, p0, n_tokens, ctx, window, softcap):
    kc, vc, q, pos, scale = _case(rng, n_heads, n_kv, hd, p0, n_tokens, ctx, softcap)
    got = attention_cm.emulate(q, kc, vc, pos, n_kv, scale, window, softcap)
    ref16 = attention_ref(_q16(q, scale), kc, vc, pos, n_kv, 1.0, window, softcap)
    np.testing.assert_allclose(got, ref16, rtol=0, atol=2e-3)
    ref = attention_ref(q, kc, vc, pos, n_kv, scale, window, softcap)
    assert np.abs(got - ref).max() < 0.1   # the f16 scores' rounding, not an index


SINKS = np.array([-3.0, 0.5, 2.0, 6.0, -1.0, 1.5, 4.0, 0.0], np.float32)


@pytest.mark.parametrize("window", [0, 16])
def test_emulated_sinks_match_reference(rng, window):
    """gpt-oss's shape (head_dim 64, GQA 8 here), its windowed layers too: the sink is the
    online softmax's starting state."""
    kc, vc, q, pos, scale = _case(rng, 8, 1, 64, 20, 45, 65, 0.0)
    got = attention_cm.emulate(q, kc, vc, pos, 1, scale, window, sinks=SINKS)
    ref16 = sink_ref(_q16(q, scale), kc, vc, pos, 1, 1.0, SINKS.astype(np.float64), window)
    np.testing.assert_allclose(got, ref16, rtol=0, atol=2e-3)
    plain = attention_cm.emulate(q, kc, vc, pos, 1, scale, window)
    assert np.abs(plain - got).max() > 0.05   # the sinks matter at this size


def test_selection_rules(monkeypatch, device):
    """Head sizes 64/128/256 within the shared memory; lavapipe (no cooperative
    matrices) and VRAMD_FLASH_CM=0 keep attention_flash.comp."""
    assert attention_cm.kernel(128, 49152) == "attention_flash_cm_d128"
    assert attention_cm.kernel(64, 32768) == "attention_flash_cm_d64"
    assert attention_cm.kernel(256, 49152) == "attention_flash_cm_d256"
    assert attention_cm.kernel(256, 32768) is None and attention_cm.kernel(80, 49152) is None
    assert attention_cm.shared_bytes(256) <= 48 * 1024
    assert attention_cm.tiles(9, 32, 4) == 2 and attention_cm.tiles(64, 1, 1) == 1
    assert attention_cm.subgroup_ops(device)   # lavapipe and NVIDIA have shuffle and vote
    monkeypatch.setenv("VRAMD_FLASH_CM", "0")
    assert not attention_cm.usable(device)
    if not device.coopmat:
        monkeypatch.delenv("VRAMD_FLASH_CM")
        assert not attention_cm.usable(device)


def test_choice_in_ops_attention(ops, bufs, rng):
    """A chunk takes the tensor-core form exactly where the device runs it (lavapipe: never)."""
    kc, vc, q, pos, scale = _case(rng, 4, 2, 64, 3, 5, 9, 0.0)
    t = bufs(q=q, kc=kc, vc=vc, pos=pos, out=4 * q.size)
    ops.attention(t["q"], t["kc"], t["vc"], t["pos"], t["out"], 5, 4, 2, 64, 9, scale)
    ops.sync()
    if not ops.residency.device.coopmat:
        assert not ops.flash_cm
    assert ("attention_flash_cm_d64" if ops.flash_cm else ops.flash or "attention") in ops._kernels
    np.testing.assert_allclose(f32(t["out"]).reshape(5, -1), attention_ref(q, kc, vc, pos, 2, scale),
                               rtol=0, atol=3e-2 if ops.flash_cm else 2e-5)


@pytest.fixture
def cm_ops(ops):
    if not ops.flash_cm:
        pytest.fail(f"{ops.residency.device.name} cannot run attention_flash_cm "
                    "(native_gpu tests need cooperative matrices, subgroup shuffle and vote)")
    return ops


def _run(ops, bufs, rng, n_heads, n_kv, hd, p0, n_tokens, ctx, window, softcap, every=1):
    """`every`: the float64 references on every so many tokens only (long chunks)."""
    kc, vc, q, pos, scale = _case(rng, n_heads, n_kv, hd, p0, n_tokens, ctx, softcap)
    out_bytes = 4 * q.size
    t = bufs(q=q, kc=kc, vc=vc, pos=pos, out=out_bytes, old=out_bytes)
    ops.attention(t["q"], t["kc"], t["vc"], t["pos"], t["out"], n_tokens, n_heads, n_kv, hd, ctx, scale,
                  window=window, softcap=softcap)
    ops.flash_cm = False   # the same call on attention_flash.comp
    try:
        ops.attention(t["q"], t["kc"], t["vc"], t["pos"], t["old"], n_tokens, n_heads, n_kv, hd, ctx, scale,
                      window=window, softcap=softcap)
    finally:
        ops.flash_cm = True
    ops.sync()
    assert f"attention_flash_cm_d{hd}" in ops._kernels   # the tensor-core form ran
    got = f32(t["out"]).reshape(n_tokens, -1)
    old = f32(t["old"]).reshape(n_tokens, -1)
    emu = attention_cm.emulate(q, kc, vc, pos, n_kv, scale, window, softcap)
    assert np.abs(got - emu).max() <= 3e-3, f"vs the emulation: {np.abs(got - emu).max():.3g}"
    sel = np.r_[0:n_tokens:every, n_tokens - 1]
    q, pos, got, old, emu = q[sel], pos[sel], got[sel], old[sel], emu[sel]
    ref = attention_ref(q, kc, vc, pos, n_kv, scale, window, softcap)
    ref16 = attention_ref(_q16(q, scale), kc, vc, pos, n_kv, 1.0, window, softcap)
    bound = 2 * np.abs(emu - ref).max() + 1e-3
    assert np.abs(got - ref16).max() <= 3e-3, f"vs numpy on f16 Q: {np.abs(got - ref16).max():.3g}"
    assert np.abs(got - ref).max() <= bound, f"vs numpy: {np.abs(got - ref).max():.3g} > {bound:.3g}"
    assert np.abs(got - old).max() <= bound, f"vs attention_flash.comp: {np.abs(got - old).max():.3g}"


@pytest.mark.native_gpu
@pytest.mark.parametrize("n_heads,n_kv,hd,p0,n_tokens,ctx,window,softcap", CASES)
def test_flash_cm(cm_ops, bufs, rng, n_heads, n_kv, hd, p0, n_tokens, ctx, window, softcap):
    _run(cm_ops, bufs, rng, n_heads, n_kv, hd, p0, n_tokens, ctx, window, softcap)


@pytest.mark.native_gpu
@pytest.mark.parametrize("hd,n_kv,window", [(128, 8, 0), (64, 8, 0), (256, 4, 512)])
def test_flash_cm_long_chunk(cm_ops, bufs, rng, hd, n_kv, window):
    """A 1024-token chunk after 1000 earlier tokens (an 8B llama's 32/8 heads): many work
    groups and key steps, the rescale taken and skipped; the numpy references on every
    37th token (the emulation on all)."""
    _run(cm_ops, bufs, rng, 4 * n_kv, n_kv, hd, 1000, 1024 if hd < 256 else 400, 2024, window, 0.0, every=37)


@pytest.mark.native_gpu
def test_flash_cm_strided_rows(cm_ops, bufs, rng):
    """q read from a fused buffer's rows (q_stride) and out written into wider rows (o_stride)."""
    n_heads, n_kv, hd, n, ctx = 8, 2, 128, 13, 29
    qs, os_ = n_heads * hd + 24, n_heads * hd + 8
    kc = rng.standard_normal((ctx, n_kv * hd)).astype(np.float16)
    vc = rng.standard_normal((ctx, n_kv * hd)).astype(np.float16)
    qbuf = rng.standard_normal((n, qs)).astype(np.float32)
    pos = np.arange(ctx - n, ctx, dtype=np.int32)
    t = bufs(q=qbuf, kc=kc, vc=vc, pos=pos, out=np.full((n, os_), 7.0, np.float32))
    cm_ops.attention(t["q"], t["kc"], t["vc"], t["pos"], t["out"], n, n_heads, n_kv, hd, ctx, 0.125,
                     q_stride=qs, o_stride=os_)
    cm_ops.sync()
    assert "attention_flash_cm_d128" in cm_ops._kernels
    out = f32(t["out"]).reshape(n, os_)
    q = qbuf[:, :n_heads * hd].reshape(n, n_heads, hd)
    emu = attention_cm.emulate(q, kc, vc, pos, n_kv, 0.125)
    assert np.abs(out[:, :n_heads * hd] - emu).max() <= 3e-3
    assert np.all(out[:, n_heads * hd:] == 7.0)


@pytest.mark.native_gpu
@pytest.mark.parametrize("n_heads,n_kv,p0,n_tokens,ctx,window", [(8, 1, 20, 45, 65, 0), (64, 8, 100, 77, 177, 128)])
def test_flash_cm_sinks(cm_ops, bufs, rng, n_heads, n_kv, p0, n_tokens, ctx, window):
    """gpt-oss (64 q heads over 8 KV heads, head_dim 64, sliding window 128 on alternate layers):
    sinks bound at an offset; against the emulation, numpy and attention.comp."""
    from vramd.engine.ops import view
    hd = 64
    kc, vc, q, pos, scale = _case(rng, n_heads, n_kv, hd, p0, n_tokens, ctx, 0.0)
    sinks = np.resize(SINKS, n_heads)
    out_bytes = 4 * q.size
    t = bufs(q=q, kc=kc, vc=vc, pos=pos, sinks=np.concatenate([np.zeros(3, np.float32), sinks]),
             out=out_bytes, old=out_bytes)
    sv = view(t["sinks"], 12, 4 * n_heads)
    cm_ops.attention(t["q"], t["kc"], t["vc"], t["pos"], t["out"], n_tokens, n_heads, n_kv, hd, ctx, scale,
                     window=window, sinks=sv)
    cm_ops.attention(t["q"], t["kc"], t["vc"], t["pos"], t["old"], n_tokens, n_heads, n_kv, hd, ctx, scale,
                     window=window, sinks=sv, flash=False)   # attention.comp
    cm_ops.sync()
    assert "attention_flash_cm_d64" in cm_ops._kernels
    got = f32(t["out"]).reshape(n_tokens, -1)
    emu = attention_cm.emulate(q, kc, vc, pos, n_kv, scale, window, sinks=sinks)
    ref = sink_ref(q, kc, vc, pos, n_kv, scale, sinks.astype(np.float64), window)
    bound = 2 * np.abs(emu - ref).max() + 1e-3
    assert np.abs(got - emu).max() <= 3e-3, f"vs the emulation: {np.abs(got - emu).max():.3g}"
    assert np.abs(got - ref).max() <= bound, f"vs numpy: {np.abs(got - ref).max():.3g} > {bound:.3g}"
    old = f32(t["old"]).reshape(n_tokens, -1)
    assert np.abs(got - old).max() <= bound, f"vs attention.comp: {np.abs(got - old).max():.3g}"


def _seq_case(ops, bufs, rng, n_heads, n_kv, hd, p0, n_tokens, ctx, seq, n_seq=3):
    """A prefill chunk of sequence `seq` of a cache of n_seq regions (vramd/engine/kvcache.py:
    sequence s owns rows [s*ctx, (s+1)*ctx)), bound as engine/blocks.py binds it: a view at the
    region's offset, the buffer starting one word in (so the kernel's K/V offsets are not 0).
    The other regions hold larger values: a row read from them shows in the result."""
    from vramd.engine.ops import view
    kc, vc, q, pos, scale = _case(rng, n_heads, n_kv, hd, p0, n_tokens, ctx, 0.0)
    width, region = n_kv * hd, 2 * ctx * n_kv * hd
    big = [(8 * rng.standard_normal((n_seq * ctx, width))).astype(np.float16) for _ in range(2)]
    for b, c in zip(big, (kc, vc)):
        b[seq * ctx:(seq + 1) * ctx] = c
    pad = np.zeros(2, np.float16)
    t = bufs(q=q, kc=np.concatenate([pad, big[0].ravel()]), vc=np.concatenate([pad, big[1].ravel()]), pos=pos,
             out=4 * q.size)
    ops.attention(t["q"], view(t["kc"], 4 + seq * region, region), view(t["vc"], 4 + seq * region, region),
                  t["pos"], t["out"], n_tokens, n_heads, n_kv, hd, ctx, scale)
    ops.sync()
    return f32(t["out"]).reshape(n_tokens, -1), kc, vc, q, pos, scale


@pytest.mark.parametrize("seq", [1, 2])
def test_prefill_of_a_sequence_at_an_offset(ops, bufs, rng, seq):
    """The prefill kernel this device takes (lavapipe: attention_flash.comp) on one sequence's
    region of a multi-sequence cache: that region's keys only."""
    got, kc, vc, q, pos, scale = _seq_case(ops, bufs, rng, 8, 2, 64, 5, 19, 40, seq)
    np.testing.assert_allclose(got, attention_ref(q, kc, vc, pos, 2, scale), rtol=0,
                               atol=3e-2 if ops.flash_cm else 2e-5)


@pytest.mark.native_gpu
@pytest.mark.parametrize("hd,seq", [(64, 1), (128, 2), (256, 1)])
def test_flash_cm_sequence_at_an_offset(cm_ops, bufs, rng, hd, seq):
    """The tensor-core form on a sequence's region at an offset: against its emulation on that
    region alone."""
    got, kc, vc, q, pos, scale = _seq_case(cm_ops, bufs, rng, 8, 2, hd, 30, 45, 96, seq)
    assert f"attention_flash_cm_d{hd}" in cm_ops._kernels
    emu = attention_cm.emulate(q, kc, vc, pos, 2, scale)
    assert np.abs(got - emu).max() <= 3e-3, f"vs the emulation: {np.abs(got - emu).max():.3g}"
