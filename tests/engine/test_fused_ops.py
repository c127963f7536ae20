"""Ops.add_rms_norm (native/shaders/add_rms_norm.comp) against numpy: the
residual add and the norm after it in one dispatch, with the addend and the
output in the same buffer as the forward pass binds them."""
import numpy as np
import pytest

from tests.engine.test_kernels import bufs, f32, ops, res, rng  # noqa: F401 (fixtures)
from vramd.engine.ops import view


@pytest.mark.parametrize("n_tokens,width", [(1, 4096), (3, 300), (5, 64)])
@pytest.mark.parametrize("alias", [True, False], ids=["y-is-a", "y-apart"])
def test_add_rms_norm(ops, bufs, rng, n_tokens, width, alias):
    x = rng.standard_normal((n_tokens, width)).astype(np.float32)
    a = rng.standard_normal((n_tokens, width)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(width)).astype(np.float32)
    # x one float into its tensor: offsets need not be storage-aligned
    t = bufs(x=np.concatenate([[np.float32(3)], x.reshape(-1)]), a=a, w=w, y=4 * n_tokens * width)
    y = t["a"] if alias else t["y"]
    ops.add_rms_norm(view(t["x"], 4), t["a"], t["w"], y, 1e-5, n_tokens, width)
    ops.sync()
    s = x.astype(np.float64) + a
    want = s / np.sqrt((s * s).mean(axis=1, keepdims=True) + 1e-5) * w
    assert np.allclose(f32(t["x"])[1:].reshape(n_tokens, width), s, rtol=1e-6, atol=1e-6)
    got = f32(y)[:n_tokens * width].reshape(n_tokens, width)
    assert np.abs(got - want).max() <= 2e-6 * np.abs(want).max()
