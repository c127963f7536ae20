"""Prefill attention in tiles (Ops.attention with several tokens:
attention_flash.comp) against numpy and against attention.comp (flash=False)
on random f16 caches: odd chunk lengths and contexts, chunks after earlier
ones (positions from p0 > 0), the last cache row, sliding windows, GQA
ratios 1 to 32 (a group larger than a tile's rows spreads over work
groups), head sizes 40 to 256, each tile size's edge (64, 32, 16 rows),
gemma2's softcap, and strided q/out rows (views of wider buffers).  Both
K/V tiles: attention_flash.comp's 16 keys and attention_flash_k32.comp's 32
(the H200's; its 40.9 KiB of shared memory is more than lavapipe advertises,
32 KiB, but lavapipe runs it: Mesa's CPU driver does not hold shaders to that
limit)."""
import numpy as np
import pytest
from tests.engine.test_kernels import attention_ref, f32

from vramd.engine.ops import FLASH_K16_SHARED, FLASH_K32_SHARED, flash_kernel, flash_rows


@pytest.fixture(autouse=True)
def _portable(ops):
    """These test the portable kernels at f32 tolerances: the tensor-core form
    (attention_flash_cm, f16 Q and P) is tested in test_attention_flash_cm.py."""
    cm, ops.flash_cm = ops.flash_cm, False
    yield
    ops.flash_cm = cm

KERNELS = ["attention_flash", "attention_flash_k32"]


@pytest.mark.parametrize("n_heads,n_kv,hd,p0,n_tokens,ctx,window,softcap", [
    (4, 4, 64, 0, 37, 101, 0, 0.0),      # GQA 1, a first chunk: 37 tokens, 64-row tiles
    (4, 2, 128, 101, 33, 333, 0, 0.0),   # GQA 2, a chunk after 101 earlier tokens
    (8, 2, 256, 50, 19, 97, 0, 0.0),     # GQA 4, head_dim 256 (gemma3's): 16-row tiles, 4 tokens each
    (8, 1, 64, 7, 65, 72, 0, 0.0),       # GQA 8; the chunk ends at the cache's last row
    (4, 1, 256, 300, 21, 341, 64, 0.0),  # gemma3's local layers: a sliding window inside the chunk's span
    (2, 1, 128, 10, 45, 99, 16, 0.0),    # a window shorter than the chunk: early keys leave each tile
    (8, 4, 128, 30, 23, 61, 0, 5.0),     # gemma2's softcap (scores scaled up so that it bites)
    (2, 1, 40, 3, 9, 17, 0, 0.0),        # head_dim 40: words not a multiple of a row's threads
    (6, 2, 80, 0, 3, 5, 0, 0.0),         # head_dim 80, three tokens from position 0
    (32, 1, 256, 5, 3, 9, 0, 0.0),       # GQA 32: one token's heads over two work groups
    (4, 2, 66, 12, 11, 31, 0, 0.0),      # head_dim 66: just over the 64-row tile's limit
])
@pytest.mark.parametrize("kernel", KERNELS)
def test_flash_attention(ops, bufs, rng, kernel, n_heads, n_kv, hd, p0, n_tokens, ctx, window, softcap):
    ops.flash = kernel
    width = n_kv * hd
    kc = rng.standard_normal((ctx, width)).astype(np.float16)
    vc = rng.standard_normal((ctx, width)).astype(np.float16)
    q = rng.standard_normal((n_tokens, n_heads, hd)).astype(np.float32)
    pos = np.arange(p0, p0 + n_tokens, dtype=np.int32)
    scale = (8.0 if softcap else 1.0) / np.sqrt(hd)
    out_bytes = 4 * n_tokens * n_heads * hd
    t = bufs(q=q, kc=kc, vc=vc, pos=pos, out=out_bytes, old=out_bytes)
    with ops.batch():
        ops.attention(t["q"], t["kc"], t["vc"], t["pos"], t["out"], n_tokens, n_heads, n_kv, hd, ctx, scale,
                      window=window, softcap=softcap)
        ops.attention(t["q"], t["kc"], t["vc"], t["pos"], t["old"], n_tokens, n_heads, n_kv, hd, ctx, scale,
                      window=window, softcap=softcap, flash=False)
    ops.sync()
    assert kernel in ops._kernels   # the tiled form ran
    got = f32(t["out"]).reshape(n_tokens, -1)
    ref = attention_ref(q, kc, vc, pos, n_kv, scale, window, softcap)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(got, f32(t["old"]).reshape(n_tokens, -1), rtol=1e-4, atol=2e-5)


def test_flash_strided_rows(ops, bufs, rng):
    """q read from a fused buffer's rows (q_stride) and out written into wider rows (o_stride):
    the floats between the heads' columns are left alone."""
    n_heads, n_kv, hd, n, ctx = 4, 2, 64, 13, 29
    qs, os_ = n_heads * hd + 24, n_heads * hd + 8
    kc = rng.standard_normal((ctx, n_kv * hd)).astype(np.float16)
    vc = rng.standard_normal((ctx, n_kv * hd)).astype(np.float16)
    qbuf = rng.standard_normal((n, qs)).astype(np.float32)
    pos = np.arange(ctx - n, ctx, dtype=np.int32)
    t = bufs(q=qbuf, kc=kc, vc=vc, pos=pos, out=np.full((n, os_), 7.0, np.float32))
    ops.attention(t["q"], t["kc"], t["vc"], t["pos"], t["out"], n, n_heads, n_kv, hd, ctx, 0.125,
                  q_stride=qs, o_stride=os_)
    ops.sync()
    out = f32(t["out"]).reshape(n, os_)
    ref = attention_ref(qbuf[:, :n_heads * hd].reshape(n, n_heads, hd), kc, vc, pos, n_kv, 0.125)
    np.testing.assert_allclose(out[:, :n_heads * hd], ref, rtol=1e-4, atol=2e-5)
    assert np.all(out[:, n_heads * hd:] == 7.0)


def test_tile_rows():
    """The rows a work group holds follow the Q tile's 16.5 KiB (attention_flash.comp's QTILE)."""
    assert [flash_rows(d) for d in (40, 64, 66, 128, 130, 256)] == [64, 64, 32, 32, 16, 16]
    assert max(flash_rows(d) * (d // 2 + 1) for d in range(2, 257, 2)) <= 2112


def test_the_key_tile_follows_the_shared_memory(monkeypatch):
    """32-key tiles where they fit (the H200's 48 KiB), 16 elsewhere (lavapipe's 32 KiB); the bytes are the
    shader's arrays: Q tile 2112 vec2, K/V 32 rows of 129 words, scores 64 rows of 33 floats."""
    assert FLASH_K32_SHARED == 2112 * 8 + 32 * 129 * 4 + 64 * 33 * 4 <= 48 << 10
    assert flash_kernel({"maxComputeSharedMemorySize": 32768}) == "attention_flash"
    assert flash_kernel({"maxComputeSharedMemorySize": 49152}) == "attention_flash_k32"
    assert FLASH_K16_SHARED == 2112 * 8 + 16 * 129 * 4 + 64 * 17 * 4 <= 32 << 10   # lavapipe's 32 KiB hold it
    # Vulkan guarantees 16 KiB only: such a device takes no flash kernel (attention.comp instead)
    assert flash_kernel({"maxComputeSharedMemorySize": 16384}) is None
    assert flash_kernel({"maxComputeSharedMemorySize": FLASH_K16_SHARED}) == "attention_flash"
    monkeypatch.setenv("VRAMD_FLASH_K16", "1")   # the benchmarks' switch back to 16-key tiles
    assert flash_kernel({"maxComputeSharedMemorySize": 49152}) == "attention_flash"
