"""The tensor-core prefill attention (native/shaders/attention_flash_cm.glsl):
whether a device runs it, which variant a head size takes, and a numpy model
of its tiling.

attention_flash_cm_d<D>.comp has attention_flash.comp's contract plus
attention.comp's sinks (so attention.comp's six bindings and push constants)
for head sizes 64, 128, 256,
in work groups of 64 query rows ((token, q head) pairs of one KV head) and 4
subgroups of 32 lanes.  It needs what the matmul_cm kernels need (16 x 16 x 16
f16 -> f32 cooperative matrices, 32-lane subgroups: linear.coopmat_usable),
subgroup shuffle and vote in compute shaders (the softmax's pair of lanes a
row, the skipped rescale), and its shared memory.  VRAMD_FLASH_CM=0 turns it
off (an A/B against attention_flash.comp).

`emulate` runs the kernel's tiling in numpy (the rows of a work group, its key
span, the BC-key steps, the f16 roundings of Q, K, V and P, the online
softmax with its lazy max and the per-row rescale) so that its index math is tested where the
kernel cannot run (lavapipe has no cooperative matrices).
"""
import os

import numpy as np

from . import linear

ROWS = 64     # BR: query rows of a work group
KEYS = 32     # BC: keys a step
NEG = -1.0e30
LAZY = 8.0    # the reference max moves only when a score passes it by more than this


def shared_bytes(head_dim: int) -> int:
    """Shared memory the head_dim variant declares (kvs, st, ps, cs + ls)."""
    return ROWS * (head_dim // 4 + 2) * 8 + 4 * 16 * (KEYS + 4) * 4 + 4 * 16 * (KEYS // 4 + 2) * 8 + 2 * ROWS * 4


HEAD_DIMS = (64, 128, 256)


def usable(device) -> bool:
    """Whether `device` runs attention_flash_cm_d<D> at all (each head size's
    shared memory is checked by `kernel`)."""
    if os.environ.get("VRAMD_FLASH_CM", "1") == "0" or not linear.coopmat_usable(device):
        return False
    return subgroup_ops(device)


def subgroup_ops(device) -> bool:
    """Whether compute shaders on `device` have subgroup shuffle and vote."""
    vk = device.vk
    sp = vk.VkPhysicalDeviceSubgroupProperties(sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SUBGROUP_PROPERTIES)
    p2 = vk.VkPhysicalDeviceProperties2(sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2, pNext=sp)
    vk.vkGetPhysicalDeviceProperties2(device.physical, p2)
    need = vk.VK_SUBGROUP_FEATURE_SHUFFLE_BIT | vk.VK_SUBGROUP_FEATURE_VOTE_BIT
    return bool(sp.supportedStages & vk.VK_SHADER_STAGE_COMPUTE_BIT) and (sp.supportedOperations & need) == need


def kernel(head_dim: int, shared_limit: int) -> str | None:
    """The variant for `head_dim` on a device with `shared_limit` bytes of shared memory, or None."""
    if head_dim in HEAD_DIMS and shared_bytes(head_dim) <= shared_limit:
        return f"attention_flash_cm_d{head_dim}"
    return None


def tiles(n_tokens: int, n_heads: int, n_kv_heads: int) -> int:
    """Work groups along y: tiles of ROWS (token, q head) pairs."""
    return -(-n_tokens * (n_heads // n_kv_heads) // ROWS)


def _span(pos, t, ctx, window):
    end = int(np.clip(pos[t] + 1, 0, ctx))
    return (end - window if window and end > window else 0), end


def emulate(q, kc, vc, pos, n_kv, scale, window=0, softcap=0.0, sinks=None):
    """The kernel's result, computed its way: q f32 [n, H, D], kc/vc f16 [ctx, n_kv * D],
    pos int [n], sinks f32 [H] or None -> f32 [n, H * D]."""
    n, H, D = q.shape
    ctx, G = kc.shape[0], H // n_kv
    n_pairs = n * G
    out = np.zeros((n, H * D), np.float32)
    for kvh in range(n_kv):
        kh = kc[:, kvh * D:(kvh + 1) * D].astype(np.float32)
        vh = vc[:, kvh * D:(kvh + 1) * D].astype(np.float32)
        for tile in range(tiles(n, H, n_kv)):
            i0 = tile * ROWS
            rows = np.arange(i0, i0 + ROWS)
            live = rows < n_pairs
            qt = np.zeros((ROWS, D), np.float32)
            spans = np.zeros((ROWS, 2), np.int64)
            for r in np.nonzero(live)[0]:
                t, g = divmod(int(rows[r]), G)
                qt[r] = (q[t, kvh * G + g] * np.float32(scale)).astype(np.float16)
                spans[r] = _span(pos, t, ctx, window)
            ok = spans[:, 1] > spans[:, 0]
            if not ok.any():
                continue
            lo, hi = spans[ok, 0].min(), spans[ok, 1].max()
            m = np.full(ROWS, NEG, np.float32)
            lsum = np.zeros(ROWS, np.float32)
            if sinks is not None:   # the sink: a key of value 0 seen first (max = sink, sum = 1)
                for r in np.nonzero(live)[0]:
                    m[r], lsum[r] = sinks[kvh * G + int(rows[r]) % G], 1.0
            acc = np.zeros((ROWS, D), np.float32)
            for k0 in range(lo, hi, KEYS):
                cnt = min(KEYS, hi - k0)
                kt = np.zeros((KEYS, D), np.float32)
                vt = np.zeros((KEYS, D), np.float32)
                kt[:cnt], vt[:cnt] = kh[k0:k0 + cnt], vh[k0:k0 + cnt]
                s = qt @ kt.T
                if softcap > 0:
                    s = softcap * (1.0 - 2.0 / (np.exp(2.0 * s / softcap) + 1.0))
                j = k0 + np.arange(KEYS)
                mask = (j[None, :] >= spans[:, :1]) & (j[None, :] < spans[:, 1:])
                s = np.where(mask, s, NEG).astype(np.float32)
                mt = s.max(axis=1)
                mt = np.where(mt > m + LAZY, mt, m)   # the kernel's lazy reference max
                e = np.where(s > 0.5 * NEG, np.exp(s - mt[:, None]), 0.0).astype(np.float32)
                corr = np.exp(m - mt)
                lsum = lsum * corr + e.sum(axis=1)
                m = mt
                acc = acc * corr[:, None] + e.astype(np.float16).astype(np.float32) @ vt
            for r in np.nonzero(live)[0]:
                t, g = divmod(int(rows[r]), G)
                h = kvh * G + g
                out[t, h * D:(h + 1) * D] = acc[r] / lsum[r] if lsum[r] > 0 else 0.0
    return out
