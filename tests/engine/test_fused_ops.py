"""Ops.add_rms_norm (native/shaders/add_rms_norm.comp) against numpy: the
residual add and the norm after it in one dispatch, with the addend and the
output in the same buffer as the forward pass binds them."""
import numpy as np
import pytest

from vramd.engine.ops import view
from tests.engine.test_kernels import f32


@pytest.mark.parametrize("n_tokens,width", [(1, 4096), (3, 300), (5, 64), (2, 5000), (2, 301)])
@pytest.mark.parametrize("alias", [True, False], ids=["y-is-a", "y-apart"])
@pytest.mark.parametrize("lead", [1, 4], ids=["x-unaligned", "x-aligned"])
def test_add_rms_norm(ops, bufs, rng, n_tokens, width, alias, lead):
    """Both paths of rms_row.glsl: vec4 (aligned rows of a multiple of 4 floats
    up to 4096) and scalar (unaligned, odd or wider rows)."""
    x = rng.standard_normal((n_tokens, width)).astype(np.float32)
    a = rng.standard_normal((n_tokens, width)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(width)).astype(np.float32)
    # x `lead` floats into its tensor: offsets need not be storage-aligned
    t = bufs(x=np.concatenate([np.full(lead, 3, np.float32), x.reshape(-1)]), a=a, w=w, y=4 * n_tokens * width)
    y = t["a"] if alias else t["y"]
    ops.add_rms_norm(view(t["x"], 4 * lead), t["a"], t["w"], y, 1e-5, n_tokens, width)
    ops.sync()
    s = x.astype(np.float64) + a
    want = s / np.sqrt((s * s).mean(axis=1, keepdims=True) + 1e-5) * w
    assert np.allclose(f32(t["x"])[lead:].reshape(n_tokens, width), s, rtol=1e-6, atol=1e-6)
    got = f32(y)[:n_tokens * width].reshape(n_tokens, width)
    assert np.abs(got - want).max() <= 2e-6 * np.abs(want).max()


@pytest.mark.parametrize("neox", [False, True], ids=["normal", "neox"])
@pytest.mark.parametrize("n_rot,factors", [(64, False), (32, False), (64, True)], ids=["full", "partial", "factors"])
def test_rope_kv_write_equals_rope_then_kv_write(ops, bufs, rng, neox, n_rot, factors):
    n_tokens, n_heads, hd, ctx = 5, 2, 64, 8
    width = n_heads * hd
    k = rng.standard_normal((n_tokens, width)).astype(np.float32)
    pos = np.array([0, 3, 7, 8, 1000], np.int32)   # the last two are beyond the cache: skipped
    ff = (1 + rng.random(n_rot // 2)).astype(np.float32)
    t = bufs(k=k, k2=k, pos=pos, ff=ff, c1=np.zeros(ctx * width, np.float16),
             c2=np.zeros(ctx * width, np.float16))
    rope = dict(n_rot=n_rot, neox=neox, freq_base=500000.0, freq_scale=0.5,
                freq_factors=t["ff"] if factors else None)
    with ops.batch():
        ops.rope(t["k"], t["pos"], n_tokens, n_heads, hd, **rope)
        ops.kv_write(t["k"], t["c1"], t["pos"], n_tokens, width, ctx)
        ops.rope_kv_write(t["k2"], t["c2"], t["pos"], n_tokens, n_heads, hd, ctx, **rope)
    ops.sync()
    c1, c2 = t["c1"].read(np.float16), t["c2"].read(np.float16)
    assert np.abs(c1).max() > 0
    # Same arithmetic as rope.comp: equal on lavapipe; another driver may
    # contract a multiply-add differently, hence one f16 ulp of slack.
    np.testing.assert_allclose(c2.astype(np.float32), c1.astype(np.float32), rtol=2 ** -10, atol=1e-7)
    assert np.array_equal(f32(t["k2"]).reshape(n_tokens, width), k)   # x left as it was
