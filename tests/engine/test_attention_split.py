"""Decode attention in ranges (Ops.attention with tmp: attention_split.comp +
attention_merge.comp) against numpy, on the shapes test_kernels.py checks
attention.comp with, and with few ranges forced by a small tmp (several key
tiles per range), a sliding window, head_dim 512 (two V words per thread),
and a long context whose ranges outnumber the merge's work group (144 ranges
of 32 keys, 141 holding keys: two tiles of the merge).  Grouped-query shapes
(2 to 16 q heads per KV head) take attention_split_gqa.comp, a work group
per KV head, when it is asked for (`split_gqa`, VRAMD_SPLIT_GQA=1: opt-in,
slower on the H200); each case runs with it on and off, so both forms stay checked."""
import numpy as np
import pytest
from tests.engine.test_kernels import attention_ref, f32



@pytest.mark.parametrize("n_heads,n_kv,hd,pos,window,tmp_splits", [
    (8, 2, 64, 150, 0, None),    # GQA 4:1, ranges of 32 keys
    (4, 4, 40, 0, 0, None),      # the first token: one key, every other range empty
    (2, 1, 256, 300, 0, None),   # head_dim 256
    (4, 2, 32, 200, 64, None),   # sliding window
    (8, 2, 64, 399, 0, 3),       # tmp for 3 ranges: 134 keys per range, 5 tiles each
    (2, 2, 512, 77, 0, 1),       # head_dim 512, one range
    (2, 1, 64, 4500, 0, 160),    # 144 ranges: more than the merge's 128 threads
    (64, 8, 64, 1000, 0, None),  # gpt-oss: 8 q heads per KV head
    (24, 4, 256, 333, 0, None),  # qwen35's attention layers: 6 per KV head of 256
    (16, 1, 128, 90, 0, None),   # 16 per KV head, 2,048 q words: the group kernel's limits
    (6, 2, 96, 260, 100, None),  # 3 per KV head, a window, an odd group
    (8, 1, 512, 50, 0, 2),       # head_dim 512 (8 x 256 words: the per-head form)
])
@pytest.mark.parametrize("gqa", [True, False], ids=["gqa", "per_head"])
def test_split_attention(ops, bufs, rng, n_heads, n_kv, hd, pos, window, tmp_splits, gqa, monkeypatch):
    monkeypatch.setattr(ops, "split_gqa", gqa)
    used, kernel = [], ops._kernel
    monkeypatch.setattr(ops, "_kernel", lambda name, family=None: used.append(name) or kernel(name, family))
    ctx, width = max(400, pos + 100), n_kv * hd
    k = rng.standard_normal((pos + 1, width)).astype(np.float32)
    v = rng.standard_normal((pos + 1, width)).astype(np.float32)
    q = rng.standard_normal((1, n_heads, hd)).astype(np.float32)
    n_tmp = 4 * n_heads * (hd + 2) * (tmp_splits or 64)
    t = bufs(k=k, v=v, rows=np.arange(pos + 1, dtype=np.int32), pos=np.array([pos], np.int32), q=q,
             out=4 * n_heads * hd, kc=2 * ctx * width, vc=2 * ctx * width, tmp=n_tmp)
    scale = 1 / np.sqrt(hd)
    ops.kv_write(t["k"], t["kc"], t["rows"], pos + 1, width, ctx)
    ops.kv_write(t["v"], t["vc"], t["rows"], pos + 1, width, ctx)
    with ops.batch() as b:
        ops.attention(t["q"], t["kc"], t["vc"], t["pos"], t["out"], 1, n_heads, n_kv, hd, ctx, scale,
                      window=window, tmp=t["tmp"])
        assert b.dispatches == 2   # the split form ran
    group = n_heads // n_kv
    assert ("attention_split_gqa" in used) == (gqa and 2 <= group and group * hd <= 4096)
    ops.sync()
    kc = t["kc"].read(np.float16).reshape(ctx, width)
    vc = t["vc"].read(np.float16).reshape(ctx, width)
    ref = attention_ref(q, kc, vc, np.array([pos]), n_kv, scale, window)
    np.testing.assert_allclose(f32(t["out"]).reshape(1, -1), ref, rtol=1e-4, atol=2e-5)


def test_tmp_too_small_falls_back(ops, bufs, rng):
    t = bufs(q=np.ones((1, 2, 8), np.float32), pos=np.array([0], np.int32), out=64, kc=2 * 16 * 8, vc=2 * 16 * 8,
             tmp=16)
    with ops.batch() as b:
        ops.attention(t["q"], t["kc"], t["vc"], t["pos"], t["out"], 1, 2, 1, 8, 16, 0.3, tmp=t["tmp"])
        assert b.dispatches == 1   # attention.comp
    ops.sync()


@pytest.mark.parametrize("gqa", [True, False], ids=["gqa", "per_head"])
def test_split_attention_softcap(ops, bufs, rng, gqa, monkeypatch):
    """gemma2's score cap in both decode forms."""
    monkeypatch.setattr(ops, "split_gqa", gqa)
    n_heads, n_kv, hd, pos, ctx = 8, 2, 64, 120, 200
    width = n_kv * hd
    k = 3 * rng.standard_normal((pos + 1, width)).astype(np.float32)
    v = rng.standard_normal((pos + 1, width)).astype(np.float32)
    q = 3 * rng.standard_normal((1, n_heads, hd)).astype(np.float32)
    t = bufs(k=k, v=v, rows=np.arange(pos + 1, dtype=np.int32), pos=np.array([pos], np.int32), q=q,
             out=4 * n_heads * hd, kc=2 * ctx * width, vc=2 * ctx * width, tmp=4 * n_heads * (hd + 2) * 64)
    scale = 1 / np.sqrt(hd)
    ops.kv_write(t["k"], t["kc"], t["rows"], pos + 1, width, ctx)
    ops.kv_write(t["v"], t["vc"], t["rows"], pos + 1, width, ctx)
    with ops.batch():
        ops.attention(t["q"], t["kc"], t["vc"], t["pos"], t["out"], 1, n_heads, n_kv, hd, ctx, scale,
                      tmp=t["tmp"], softcap=5.0)
    ops.sync()
    kc = t["kc"].read(np.float16).reshape(ctx, width)
    vc = t["vc"].read(np.float16).reshape(ctx, width)
    ref = attention_ref(q, kc, vc, np.array([pos]), n_kv, scale, 0, softcap=5.0)
    np.testing.assert_allclose(f32(t["out"]).reshape(1, -1), ref, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("gqa", [True, False], ids=["gqa", "per_head"])
@pytest.mark.parametrize("window,softcap,sinks", [(0, 0.0, False), (16, 0.0, False), (0, 4.0, False),
                                                   (12, 0.0, True)])
def test_tokens_of_several_sequences(ops, bufs, rng, window, softcap, sinks, gqa, monkeypatch):
    """Parallel slots' decode: one token of each of several sequences in one split dispatch
    (work-group z the token; by KV head and per head), each reading its own sequence's rows (seq[t] * ctx on, the ids
    beside the positions) of a cache of n_seq regions, its own position, window, softcap and
    sinks: each against numpy on its region alone.  The K/V writes of the same step (kv_write,
    rope_kv_write with seq) put each token's row in its region only."""
    from tests.engine.test_attention_sinks import sink_ref
    from vramd.engine.ops import view
    monkeypatch.setattr(ops, "split_gqa", gqa)   # both decode forms (4 q heads per KV head)
    n_seq, ctx, n_heads, n_kv, hd = 4, 48, 8, 2, 64
    width = n_kv * hd
    seqs, pos = np.array([2, 0, 3], np.int32), np.array([40, 5, 22], np.int32)
    kc = (3 * rng.standard_normal((n_seq * ctx, width))).astype(np.float16)   # every region filled
    vc = (3 * rng.standard_normal((n_seq * ctx, width))).astype(np.float16)
    new_k, new_v = (rng.standard_normal((3, width)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((3, n_heads, hd)).astype(np.float32)
    sk = rng.standard_normal(n_heads).astype(np.float32)
    t = bufs(kc=kc, vc=vc, q=q, nk=new_k, nv=new_v, ps=np.concatenate([pos, seqs]), sinks=sk,
             out=4 * q.size, tmp=4 * 3 * n_heads * (hd + 2) * 64)
    p, s = view(t["ps"], 0, 12), view(t["ps"], 12, 12)
    scale = 1 / np.sqrt(hd)
    ops.rope_kv_write(t["nk"], t["kc"], p, 3, n_kv, hd, ctx, seq=s, n_seq=n_seq)
    ops.kv_write(t["nv"], t["vc"], p, 3, width, ctx, seq=s, n_seq=n_seq)
    with ops.batch() as b:
        ops.attention(t["q"], t["kc"], t["vc"], p, t["out"], 3, n_heads, n_kv, hd, ctx, scale, window=window,
                      tmp=t["tmp"], softcap=softcap, sinks=t["sinks"] if sinks else None, seq=s, n_seq=n_seq)
        assert b.dispatches == 2   # one split and one merge for the three tokens
    ops.sync()
    kc_after = t["kc"].read(np.float16).reshape(n_seq * ctx, width)
    vc_after = t["vc"].read(np.float16).reshape(n_seq * ctx, width)
    written = {int(sq) * ctx + int(ps) for sq, ps in zip(seqs, pos)}
    untouched = [r for r in range(n_seq * ctx) if r not in written]
    assert np.array_equal(kc_after[untouched], kc[untouched]) and np.array_equal(vc_after[untouched], vc[untouched])
    for j, (sq, ps) in enumerate(zip(seqs, pos)):
        row = int(sq) * ctx + int(ps)
        np.testing.assert_array_equal(vc_after[row], new_v[j].astype(np.float16))
        assert not np.array_equal(kc_after[row], new_k[j].astype(np.float16))   # rotated (position > 0)
    out = f32(t["out"]).reshape(3, -1)
    for j, (sq, ps) in enumerate(zip(seqs, pos)):
        region = slice(int(sq) * ctx, (int(sq) + 1) * ctx)
        args = (q[j:j + 1], kc_after[region], vc_after[region], np.array([ps]), n_kv, scale)
        ref = sink_ref(*args, sk.astype(np.float64), window) if sinks else attention_ref(*args, window, softcap)
        np.testing.assert_allclose(out[j:j + 1], ref, rtol=1e-4, atol=2e-5)


def test_several_sequences_need_the_split_form(ops, bufs):
    """Tokens of several sequences read their regions only through the split form: without
    its tmp the call is refused (never attention.comp over the whole cache)."""
    from vramd.errors import UsageError
    from vramd.engine.ops import view
    t = bufs(q=np.ones((2, 2, 8), np.float32), ps=np.array([0, 0, 0, 1], np.int32), out=128, kc=2 * 2 * 16 * 8,
             vc=2 * 2 * 16 * 8)
    with pytest.raises(UsageError, match="several sequences' tokens need the split form's tmp"):
        ops.attention(t["q"], t["kc"], t["vc"], view(t["ps"], 0, 8), t["out"], 2, 2, 1, 8, 16, 0.3,
                      seq=view(t["ps"], 8, 8), n_seq=2)
