"""Decode attention in ranges (Ops.attention with tmp: attention_dec_n* or
attention_split.comp, then attention_merge.comp) against numpy, on the shapes
test_kernels.py checks attention.comp with, and with few ranges forced by a
small tmp (several key tiles per range), a sliding window, head_dim 512 (two
V words per thread), and a long context whose ranges outnumber the merge's
work group (old forms: 144 ranges of 32 keys, 141 holding keys: two tiles of
the merge).  Every case runs in each form (`form`): the long-context one
(attention_dec_n<NC>, VRAMD_DECODE_ATTN=new, the default: a work group per
KV head block and range; head_dim % 8 == 0 and <= 256, else the per-head
form), "new_qs" its variants with q in shared memory (VRAMD_DEC_Q=shared),
the old per-head one (attention_split.comp, VRAMD_DECODE_ATTN=old), and the
old by-KV-head one (attention_split_gqa.comp, VRAMD_SPLIT_GQA=1, for 2 to 16
q heads per KV head), so every form stays checked.  The new form's ranges
follow the keys alone: a token's output is the same bits alone and beside
other sequences' tokens (test_new_form_is_batch_invariant)."""
import numpy as np
import pytest
from tests.engine.test_kernels import attention_ref, f32

FORMS = ["new", "new_qs", "gqa", "per_head"]


def set_form(ops, monkeypatch, form):
    """Selects a decode form on `ops`; the kernel names recorded from then on."""
    monkeypatch.setattr(ops, "decode_attn", "new" if form.startswith("new") else "old")
    monkeypatch.setattr(ops, "dec_q", "shared" if form == "new_qs" else "regs")
    monkeypatch.setattr(ops, "split_gqa", form == "gqa")
    used, kernel = [], ops._kernel
    monkeypatch.setattr(ops, "_kernel", lambda name, family=None: used.append(name) or kernel(name, family))
    return used


def expected_kernel(form, n_heads, n_kv, hd):
    group = n_heads // n_kv
    if form.startswith("new") and hd % 8 == 0 and hd <= 256:
        name = "attention_dec_n1g8" if hd <= 64 else "attention_dec_n2g4" if hd <= 128 else "attention_dec_n4g2"
        return name + ("_qs" if form == "new_qs" else "")
    if form == "gqa" and 2 <= group and group * hd <= 4096:
        return "attention_split_gqa"
    return "attention_split"


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
    (32, 8, 128, 700, 0, None),  # the 8B's shape (new: n2g4, 4 q heads a group, 22 ranges of 32 keys)
    (40, 4, 128, 260, 0, None),  # 10 q heads per KV head at 128: new, three head blocks (4, 4, 2)
    (6, 3, 192, 130, 0, None),   # head_dim 192: new n4g2, a piece per lane partly past the head
    (4, 1, 36, 60, 0, None),     # head_dim 36 (not a multiple of 8): new falls back to the per-head form
])
@pytest.mark.parametrize("form", FORMS)
def test_split_attention(ops, bufs, rng, n_heads, n_kv, hd, pos, window, tmp_splits, form, monkeypatch):
    used = set_form(ops, monkeypatch, form)
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
    assert expected_kernel(form, n_heads, n_kv, hd) in used
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


@pytest.mark.parametrize("form", FORMS)
def test_split_attention_softcap(ops, bufs, rng, form, monkeypatch):
    """gemma2's score cap in every decode form."""
    used = set_form(ops, monkeypatch, form)
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
    assert expected_kernel(form, n_heads, n_kv, hd) in used
    np.testing.assert_allclose(f32(t["out"]).reshape(1, -1), ref, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("window,softcap,sinks", [(0, 0.0, False), (16, 0.0, False), (0, 4.0, False),
                                                   (12, 0.0, True)])
def test_tokens_of_several_sequences(ops, bufs, rng, window, softcap, sinks, form, monkeypatch):
    """Parallel slots' decode: one token of each of several sequences in one split dispatch
    (work-group z the token; by KV head and per head), each reading its own sequence's rows (seq[t] * ctx on, the ids
    beside the positions) of a cache of n_seq regions, its own position, window, softcap and
    sinks: each against numpy on its region alone.  The K/V writes of the same step (kv_write,
    rope_kv_write with seq) put each token's row in its region only."""
    from tests.engine.test_attention_sinks import sink_ref
    from vramd.engine.ops import view
    used = set_form(ops, monkeypatch, form)   # every decode form (4 q heads per KV head)
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
    assert expected_kernel(form, n_heads, n_kv, hd) in used
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


@pytest.mark.parametrize("form", ["new", "new_qs"])
@pytest.mark.parametrize("hd,window,sinks", [(64, 0, False), (128, 0, True), (64, 24, True)])
def test_new_form_is_batch_invariant(ops, bufs, rng, hd, window, sinks, form, monkeypatch):
    """Parallel slots' decode in the new form: each token's output has the same bits as
    the same token run alone (its ranges follow its keys, not the step's tokens), for three
    sequences at different lengths beside each other (the old per-head form fails it: its
    ranges at ctx 2,000 are 21 a token of three, 63 alone)."""
    from vramd.engine.ops import view
    used = set_form(ops, monkeypatch, form)
    n_seq, ctx, n_heads, n_kv = 3, 2000, 16, 2
    width = n_kv * hd
    seqs, pos = np.array([1, 2, 0], np.int32), np.array([1900, 17, 700], np.int32)
    kc = (2 * rng.standard_normal((n_seq * ctx, width))).astype(np.float16)
    vc = rng.standard_normal((n_seq * ctx, width)).astype(np.float16)
    q = rng.standard_normal((3, n_heads, hd)).astype(np.float32)
    sk = rng.standard_normal(n_heads).astype(np.float32)
    t = bufs(kc=kc, vc=vc, q=q, ps=np.concatenate([pos, seqs]), sinks=sk, out=4 * q.size, one=4 * q[0].size,
             tmp=4 * 3 * n_heads * (hd + 2) * 64)
    scale = 1 / np.sqrt(hd)
    kw = dict(window=window, tmp=t["tmp"], sinks=t["sinks"] if sinks else None, n_seq=n_seq)
    ops.attention(t["q"], t["kc"], t["vc"], view(t["ps"], 0, 12), t["out"], 3, n_heads, n_kv, hd, ctx, scale,
                  seq=view(t["ps"], 12, 12), **kw)
    ops.sync()
    together = f32(t["out"]).reshape(3, -1)
    for j in range(3):
        ops.attention(view(t["q"], 4 * j * n_heads * hd, 4 * n_heads * hd), t["kc"], t["vc"],
                      view(t["ps"], 4 * j, 4), t["one"], 1, n_heads, n_kv, hd, ctx, scale,
                      seq=view(t["ps"], 12 + 4 * j, 4), **kw)
        ops.sync()
        np.testing.assert_array_equal(f32(t["one"]).reshape(1, -1), together[j:j + 1])
    assert expected_kernel(form, n_heads, n_kv, hd) in used


def test_decode_form_by_environment(monkeypatch):
    """VRAMD_DECODE_ATTN picks the form (new / old; unset: new); any other value is refused
    in one line."""
    from vramd.engine.ops import decode_attn_form
    from vramd.errors import UsageError
    monkeypatch.delenv("VRAMD_DECODE_ATTN", raising=False)
    assert decode_attn_form() == "new"
    for form in ("new", "old"):
        monkeypatch.setenv("VRAMD_DECODE_ATTN", form)
        assert decode_attn_form() == form
    monkeypatch.setenv("VRAMD_DECODE_ATTN", "fast")
    with pytest.raises(UsageError, match="VRAMD_DECODE_ATTN='fast': expected new or old"):
        decode_attn_form()


def test_dec_q_by_environment(ops, monkeypatch):
    """VRAMD_DEC_Q: regs (the default) or shared; anything else refused in one line."""
    from vramd.engine.ops import Ops
    from vramd.errors import UsageError
    assert ops.dec_q == "regs"
    monkeypatch.setenv("VRAMD_DEC_Q", "smem")
    with pytest.raises(UsageError, match="VRAMD_DEC_Q='smem': expected regs or shared"):
        Ops(ops.residency)


def test_dec_groups_by_environment(ops, bufs, rng, monkeypatch):
    """VRAMD_DEC_GROUPS sets the new form's work groups a token (the ranges: 8 KV heads x 4
    ranges at 32 groups, against the default's 8 x 32 at 2,048 keys), the result the same
    within the tolerance; a bad value is refused in one line."""
    from vramd.engine.ops import Ops, _env_count
    from vramd.errors import UsageError
    for bad in ("0", "-3", "x"):
        monkeypatch.setenv("VRAMD_DEC_GROUPS", bad)
        with pytest.raises(UsageError, match=f"VRAMD_DEC_GROUPS='{bad}': expected a positive integer"):
            Ops(ops.residency)
    monkeypatch.delenv("VRAMD_DEC_GROUPS")
    assert _env_count("VRAMD_DEC_GROUPS", 512) == 512
    n_heads, n_kv, hd, pos, ctx = 32, 8, 64, 2047, 2048
    width = n_kv * hd
    t = bufs(kc=rng.standard_normal((ctx, width)).astype(np.float16),
             vc=rng.standard_normal((ctx, width)).astype(np.float16),
             q=rng.standard_normal((1, n_heads, hd)).astype(np.float32), pos=np.array([pos], np.int32),
             out=4 * n_heads * hd, tmp=4 * n_heads * (hd + 2) * 64)
    ref = attention_ref(t["q"].read(np.float32).reshape(1, n_heads, hd), t["kc"].read(np.float16).reshape(ctx, width),
                        t["vc"].read(np.float16).reshape(ctx, width), np.array([pos]), n_kv, hd ** -0.5)
    used = set_form(ops, monkeypatch, "new")
    seen, dispatch = [], ops._dispatch
    monkeypatch.setattr(ops, "_dispatch", lambda k, v, push, grid: seen.append(grid) or dispatch(k, v, push, grid))
    for groups, splits in ((None, 32), (32, 4)):
        monkeypatch.setattr(ops, "dec_groups", groups or 512)
        seen.clear()
        ops.attention(t["q"], t["kc"], t["vc"], t["pos"], t["out"], 1, n_heads, n_kv, hd, ctx, hd ** -0.5,
                      tmp=t["tmp"])
        ops.sync()
        assert "attention_dec_n1g8" in used and seen[0] == (n_kv, splits, 1)
        np.testing.assert_allclose(f32(t["out"]).reshape(1, -1), ref, rtol=1e-4, atol=2e-5)
