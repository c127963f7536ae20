"""The kernel-selection point for linear layers: which kernel computes y = W x for a weight and a batch.

`select(w, n_tokens, wo)` is the one place that decides; `Ops.matvec`
dispatches what it returns.  New matrix kernels (cooperative-matrix tiles,
integer dot products: issue 15) plug in here, chosen by the device's
capabilities and the batch size, with the portable kernels below as the
path for devices without them and the reference they are tested against.

Today's kernels (native/shaders/matvec.glsl, matmul.glsl):
  matvec_<type>    one work group per 8 rows, a token per z: decode and tiny batches
  matvec_w_<type>  a quant unit per thread (Q8_0, Q4_K, Q6_K rows on 16 bytes): decode
                   (docs/benchmarks.md "Decode at the roofline" has its figures)
  matvec_q8_0_dp   Q8_0 decode by integer dot products, x quantized to int8 blocks in the
                   kernel (native/shaders/matvec_q8_0_dp.comp): where `q8_decode_usable`
  matmul_<type>    64 rows x 32 tokens a work group, from 4 tokens (prefill)
  matvec_t<NT>_<type>, matvec_w_t<NT>_<type>
                   a step's decode rows (ops.token_rows: one token of each of several sequences),
                   NT of them a work group, each weight read once for the NT: each row's result
                   bit for bit what its lone kernel (matvec_<type> / matvec_w_<type>) gives
                   (matvec.glsl "Several tokens"; per_token_kernel)
  matvec_c_<type>  CPU devices (VkPhysicalDeviceType CPU: lavapipe), decode: a row per
                   invocation, 16 rows each, 16 invocations a group, a token per z (matvec.glsl
                   MV_ROWLANE: no subgroup op, shared memory or barrier); Q8_0 and Q5_0 read
                   4 blocks a unit as uvec2 (rows 8-byte aligned, cols a multiple of 128),
                   matvec_c_<type>_any otherwise (likewise matmul_c_<type>)
  matmul_c_<type>  CPU devices, prefill: the same form with MC_NT 4, 16 rows x 4 tokens an
                   invocation (each quant unit decoded once for the 4 tokens), 16 invocations a group
  matmul_cm_<type> 128 rows x 128 tokens a work group on the tensor cores (KHR cooperative
                   matrices, native/shaders/matmul_cm.glsl): prefill where `coopmat_usable`
and for mixture-of-experts layers (Ops.matvec_id / Ops.matmul_id, chosen by `grouped`):
  matvec_id_<type> a slot (token, expert) per z: decode, a few tokens
  matmul_id_<type> matmul_<type>'s tiles over the slots grouped by expert (moe_group.comp,
                   matmul_rows.glsl's MM_ID): prefill
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from vramd.errors import UsageError

MATMUL_ROWS, MATMUL_TOKENS = 64, 32   # the tile of a matmul_<type> work group (BR, BT in matmul.glsl)
MATVEC_ROWS = 8                       # rows per matvec_<type> work group (RPW in matvec.glsl)
# types with a unit-per-thread decode matvec (matvec_w_<type>, matvec.glsl's MV_WORDS) -> its
# rows per work group (MW_NR in matvec_w_<type>.comp)
MATVEC_ROWS_W = {"q8_0": 8, "q4_k": 4, "q6_k": 4}
# CPU devices: types with a row-per-invocation matvec (matvec_c_<type>, matvec.glsl's MV_ROWLANE)
# -> rows per work group (MC_WG in matvec_c_<type>.comp)
# (16 invocations x 16 rows: the 32768-row slice of Gemma 3 270M's Q8_0 output matrix on lavapipe,
# alternating, load 5: 32 x 4 rows 112-120 ms, 16 x 8 94-104, 16 x 16 76-90, 8 x 16 75-84)
# types whose matvec_c_<type> reads 4 blocks (W2_UNIT columns) a unit as uvec2 (MC_W2), with a
# matvec_c_<type>_any for other alignments
W2_TYPES, W2_UNIT = ("q8_0", "q5_0"), 128
MATVEC_ROWS_C = {t: 256 for t in ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")}
# CPU devices: the prefill form of the same types (matmul_c_<type>.comp: MC_WG x MC_NR rows, MC_NT
# tokens a work group, each quant unit decoded once for the MC_NT tokens).  Rows per invocation
# measured on lavapipe, 2048 x 640 Q5_0 x 32 tokens (alternating, load 6-9, min of 4): invocations x
# rows 16 x 2: 240 ms, 8 x 4: 148, 8 x 8: 72-108, 8 x 16: 83, 16 x 16: 47, 8 x 32: 44, 8 x 64: 59;
# matmul_q5_0 436.  lavapipe loads each token's x for every lane, so the rows sharing one x
# load are what counts; 16 x 16 unrolls half of 8 x 32 (pipeline creation at first use).
MATMUL_C_ROWS, MATMUL_C_TOKENS = 256, 4
# Tokens per work group of the decode-rows kernels (matvec_t<NT>_<type> for F32/F16/BF16,
# matvec_w_t<NT>_<type> for Q8_0/Q4_K/Q6_K; matvec.glsl's MV_NT), and rows per work group: matvec_t 16 (4 a subgroup), matvec_w_t that of
# matvec_w_<type> with at most 32 (rows x tokens) accumulators a thread (its shared sums hold 32 x WG/4).
MV_TOKENS = (4, 8, 16)
MV_TOKENS_CAP = 16                    # the largest NT taken unless VRAMD_MV_TOKENS says otherwise
MATVEC_ROWS_T = 16
MV_FLOAT = frozenset({"f32", "f16", "bf16"})   # their load path depends on x's alignment (see per_token_kernel)
MATMUL_FROM = 4                       # n_tokens from which the tiled form is used
# ... and the tensor-core form: its 128-row work groups are few at small n (32 for a 4,096-row
# matrix), so it is latency-bound there: `vramd bench slots` (8B Q8_0, H200, 2026-12-02) stepped
# 1 / 2 / 4 / 8 / 16 sequences in 6.48 / 8.93 / 39.35 / 40.39 / 42.08 ms with it from 4 tokens,
# where each further token through the matvec costs ~2.45 ms: they cross near 16.
CM_FROM = 16
MATMUL_ID_FROM = 4                    # tokens (not slots) from which MoE experts may take matmul_id
MATMUL_ID_SLOTS = 4                   # and slots per expert on average from which they do (grouped)
CM_ROWS, CM_TOKENS = 128, 128         # the tile of a matmul_cm_<type> work group (BR, BT in matmul_cm.glsl)
# weight types with a matmul_cm_<type> kernel (bf16 weights go through f16 tiles; mxfp4: gpt-oss's
# type, its dense matrices here: its routed experts go through matvec_id, vramd/engine/moe.py)
CM_TYPES = frozenset({"f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k", "mxfp4"})
Q8_DP_ROWS = 8                        # rows per matvec_q8_0_dp work group (NR there)
Q8_DP_MAX_COLS = 16384                # the widest row it takes (MAX_COLS there: x's quants in shared memory)
Q8_DP_SHARED = Q8_DP_MAX_COLS + Q8_DP_MAX_COLS // 32 * 4 + 8 * 128 * 4   # its shared bytes (xq, xd, part)
CM_SUBGROUP = 32                      # matmul_cm.glsl splits its 256 threads into 8 subgroups of 32
CM_SHARED = 2 * 128 * 18 * 8 + 8 * 256 * 4   # bytes of shared memory it declares (ws, xs: LD4 = 18 f16vec4s a row; st)


def grouped(n_tokens: int, n_used: int, n_expert: int, cpu: bool = False) -> bool:
    """Whether a MoE layer's experts for n_tokens take the grouped matmul (matmul_id_<type>,
    each used expert's matrix read once per tile of its slots) rather than matvec_id (one
    expert matrix read per slot).  A matmul_id tile is 32 slots wide whatever it holds, so
    it pays where the experts get several slots each: from MATMUL_ID_SLOTS slots per expert
    on average (qwen3moe, 128 experts top-8: from 64 tokens; qwen35moe's 256: 128; gpt-oss's
    32 top-4: 32), and not on CPU devices: on lavapipe (2 shared cores, a 512 x 2048 Q4_K
    gate of 256 experts, `matvec_id` against moe_group + matmul_id) 256 tokens took 6.0 s
    against 30.2 s, 64 tokens 2.5 against 20.9: there the matmul's padded tiles are compute
    it does not have.  VRAMD_MOE_GROUPED (benchmarks, tests): 0 keeps matvec_id for every
    batch, 1 takes matmul_id for every batch from MATMUL_ID_FROM tokens on any device."""
    mode = os.environ.get("VRAMD_MOE_GROUPED", "")
    if mode not in ("", "0", "1"):
        raise UsageError(f"VRAMD_MOE_GROUPED={mode!r}: expected 0 or 1")
    if mode == "0" or n_tokens < MATMUL_ID_FROM:
        return False
    return mode == "1" or (not cpu and n_tokens * n_used >= MATMUL_ID_SLOTS * n_expert)


def id_tiles(n_slots: int, n_expert: int, bt: int) -> int:
    """The most tiles moe_group.comp makes of n_slots slots, tiles of at most bt slots of
    one expert: sum_e ceil(c_e / bt) <= n_slots // bt + (experts with a slot)."""
    return n_slots // bt + min(n_expert, n_slots)


def group_words(n_slots: int, n_expert: int, bt: int) -> int:
    """uint32 words of moe_group.comp's output: the sorted slots, the tile count, 3 per tile."""
    return n_slots + 1 + 3 * id_tiles(n_slots, n_expert, bt)


@dataclass(frozen=True)
class LinearKernel:
    name: str            # the SPIR-V kernel (native/shaders/<name>.spv)
    rows_per_group: int
    tokens_per_group: int   # 1: one token per z of the grid


def cm_subgroup_size(device) -> int | None:
    """The subgroup size the matmul_cm pipelines require of `device` (32, where
    VK_EXT_subgroup_size_control lets a compute pipeline ask for it), else None: the
    device's own size must then be 32."""
    sizes = getattr(device, "subgroup_sizes", None)
    return CM_SUBGROUP if sizes and sizes[0] <= CM_SUBGROUP <= sizes[1] else None


def coopmat_usable(device) -> bool:
    """Whether `device` (a gpu.device.Device) runs the matmul_cm_<type> kernels: the
    cooperative-matrix extension with a 16 x 16 x 16 f16 x f16 -> f32 subgroup shape
    (what they use), subgroups of 32 lanes (required at pipeline creation, or the
    device's size) and their shared memory.  The environment variable
    VRAMD_NO_COOPMAT turns them off (benchmarks of the portable path)."""
    if os.environ.get("VRAMD_NO_COOPMAT"):
        return False   # set (to anything): the portable kernels, for comparison
    shapes = getattr(device, "coopmat", None) or []
    shape = any(s["m"] == 16 and s["n"] == 16 and s["k"] == 16 and s["a"] == "f16" and s["b"] == "f16"
                and s["c"] == "f32" and s["result"] == "f32" and s["scope"] == "subgroup" for s in shapes)
    return (shape and (device.subgroup_size == CM_SUBGROUP or cm_subgroup_size(device) is not None)
            and device.limits.get("maxComputeSharedMemorySize", 0) >= CM_SHARED)


def q8_decode_usable(device) -> bool:
    """Whether Q8_0 decode takes matvec_q8_0_dp on `device`: integer dot products
    (VK_KHR_shader_integer_dot_product's feature, Device.integer_dot) and its shared memory.

    VRAMD_Q8_DECODE is a measurement switch for A/B benchmarks of the two Q8_0 decode
    paths: `old` the f32 word kernel (matvec_w_q8_0 / matvec_q8_0), `new` the integer
    one (an error where the device lacks it), unset: `old`.  Measured on the H200
    (2026-12-02, `vramd bench decode --shape 8b --type Q8_0 --prompt 128 --tokens 32 --ctx
    512`, same run): old 164.8 tok/s, new 153.4: the integer kernel is slower there, and
    it trades the f32 kernel's exactness for the 8-bit rounding of x (a 1.3 % logit error
    on test_forward's tiny models), so it stays opt-in until it is faster.  Its tests ask
    for it with `new`."""
    mode = os.environ.get("VRAMD_Q8_DECODE", "")
    if mode not in ("", "old", "new"):
        raise UsageError(f"VRAMD_Q8_DECODE={mode!r}: expected 'old' or 'new'")
    able = (bool(getattr(device, "integer_dot", False))
            and device.limits.get("maxComputeSharedMemorySize", 0) >= Q8_DP_SHARED)
    if mode == "new" and not able:
        raise UsageError(f"VRAMD_Q8_DECODE=new: device {device.name} lacks integer dot products "
                         f"(VK_KHR_shader_integer_dot_product) or {Q8_DP_SHARED} bytes of shared memory")
    return able and mode == "new"


def select(w, n_tokens: int, wo: int, coopmat: bool = False, cpu: bool = False,
           q8_dp: bool = False) -> LinearKernel:
    """The kernel for `w` (an ops.Weight) over `n_tokens`, its rows bound at byte offset `wo`;
    `coopmat`: the device runs the cooperative-matrix kernels (coopmat_usable); `cpu`: the
    device is a CPU (VkPhysicalDeviceType CPU, e.g. lavapipe); `q8_dp`: Q8_0 decode by integer
    dot products (q8_decode_usable; before the CPU forms: on a CPU it is only ever asked for)."""
    # Its scales are read as halves of aligned words: rows on even bytes (row_bytes is even).
    if q8_dp and n_tokens < MATMUL_FROM and w.suffix == "q8_0" and w.cols <= Q8_DP_MAX_COLS and wo % 2 == 0:
        return LinearKernel("matvec_q8_0_dp", Q8_DP_ROWS, 1)
    if coopmat and w.suffix in CM_TYPES and n_tokens >= CM_FROM:   # (a CPU device has none; a sweep may force it)
        return LinearKernel("matmul_cm_" + w.suffix, CM_ROWS, CM_TOKENS)
    if cpu and w.suffix in MATVEC_ROWS_C:
        # Q8_0, Q5_0: 4 blocks a unit read as uvec2 (dequant*.glsl's MC_W2) where rows are
        # 8-byte aligned (136- and 88-byte units), else a block a unit read as words (_any)
        tail = "_any" if w.suffix in W2_TYPES and (w.cols % W2_UNIT or wo % 8) else ""
        if n_tokens < MATMUL_FROM:
            return LinearKernel("matvec_c_" + w.suffix + tail, MATVEC_ROWS_C[w.suffix], 1)
        return LinearKernel("matmul_c_" + w.suffix + tail, MATMUL_C_ROWS, MATMUL_C_TOKENS)
    if n_tokens >= MATMUL_FROM and not (coopmat and w.suffix in CM_TYPES):   # (below CM_FROM: the matvec)
        return LinearKernel("matmul_" + w.suffix, MATMUL_ROWS, MATMUL_TOKENS)
    if w.suffix in MATVEC_ROWS_W and w.row_bytes % 16 == 0 and wo % 16 == 0:
        return LinearKernel("matvec_w_" + w.suffix, MATVEC_ROWS_W[w.suffix], 1)
    return LinearKernel("matvec_" + w.suffix, MATVEC_ROWS, 1)


def mv_tokens() -> int:
    """The largest tokens-per-group of the decode-rows kernels Ops may take (per_token_kernel):
    VRAMD_MV_TOKENS (benchmarks, A/B): 1 runs each decode row through its lone kernel (one
    weight read a row: the form before these kernels), 4 / 8 / 16 caps NT there; unset:
    MV_TOKENS_CAP."""
    mode = os.environ.get("VRAMD_MV_TOKENS", "")
    if mode == "":
        return MV_TOKENS_CAP
    if mode not in ("1", *map(str, MV_TOKENS)):
        raise UsageError(f"VRAMD_MV_TOKENS={mode!r}: expected 1, {', '.join(map(str, MV_TOKENS))}")
    return int(mode)


def per_token_kernel(w, n_rows: int, wo: int, x_stride: int, cap: int, subgroup: int, **sel) -> LinearKernel:
    # subgroup: the subgroup size every pipeline of the device runs with (Ops.fixed_subgroup)
    """The kernel for `n_rows` decode rows of one step (each one token of its own sequence) of
    `w`, bound at byte `wo`: what select() gives one token (`sel`: its coopmat, cpu, q8_dp), run
    for each row (a z of the grid each), or where that is matvec_<type> / matvec_w_<type> and
    n_rows >= 2, its form with NT tokens a work group (NT of MV_TOKENS up to `cap`: the smallest
    holding n_rows, else the largest), which reads each weight once for NT rows and gives each
    row bit for bit what the lone kernel gives (the same lane -> unit assignment, per-lane order
    and subgroup / shared-memory sums: matvec.glsl "Several tokens").  Not for: the CPU forms
    and matvec_q8_0_dp (their lone kernels, per row); the quantized types' matvec_<type> (the
    mv_unit hook, Q8_0 / Q4_K / Q6_K rows off 16 bytes and the other quantized types: it loads,
    decodes and dots a unit in one call, so an NT form inlines NT x NR copies of it: lavapipe
    took over a minute to compile Q5_K's at NT 4; splitting those hooks as the MV_WORDS ones
    are would give them one); F32/F16/BF16 where x_stride % 4 != 0 (the
    rows would differ in alignment, which picks the lone kernel's load path and so its sums);
    devices whose pipelines may get different subgroup sizes (`subgroup` 0: a row's sums follow
    the lanes) or subgroups under 4 lanes (matvec_w_t's shared sums)."""
    lone = select(w, 1, wo, **sel)
    fits = [nt for nt in MV_TOKENS if nt <= cap]
    if n_rows < 2 or not fits or subgroup < 4 or (w.suffix in MV_FLOAT and x_stride % 4):
        return lone
    nt = next((t for t in fits if t >= n_rows), fits[-1])
    if lone.name == "matvec_w_" + w.suffix:
        return LinearKernel(f"matvec_w_t{nt}_{w.suffix}", min(MATVEC_ROWS_W[w.suffix], 32 // nt), nt)
    if lone.name == "matvec_" + w.suffix and w.suffix in MV_FLOAT:
        return LinearKernel(f"matvec_t{nt}_{w.suffix}", MATVEC_ROWS_T, nt)
    return lone
