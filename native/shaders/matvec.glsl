// Y[t, r] = sum_c W[r, c] * X[t, c] in f32, W dequantized on the fly (see
// dequant.glsl); included by matvec_<type>.comp (decode: a few tokens, one
// per work-group z; prefill uses matmul.glsl).
//
// Layout.  A work group of WG threads computes RPW consecutive rows.  Each
// subgroup takes NR of them at a time and computes them jointly (one read of
// a piece of x serves NR rows); a row's partial sums are added with one
// subgroupAdd.  No shared memory, no barrier: the subgroups are independent,
// and a work group has enough rows that its fixed cost is spread (a row per
// 128-thread work group, the previous form, cost ~212 us for 14336 x 4096
// F16 on the H200 whatever the type).  Ops dispatches ceil(rows / RPW)
// groups (_MATVEC_ROWS in vramd/engine/ops.py).  Rows run over a 2-D grid
// (x + y * width) because a grid dimension may stop at 65535 and a
// vocabulary is larger.  A subgroup's lanes stride over the columns, so
// neighbouring lanes read neighbouring memory.
//
// Loads.  F16/BF16/F32 rows are read 16 bytes (a uvec4) per lane and x 16
// bytes per vec4 when the dispatch allows it (rows and x 16-byte aligned,
// decided once per dispatch, so the branch is uniform); otherwise one
// 4-byte word at a time.  Q8_0 (34-byte blocks) and Q4_0 (18) are read a
// whole block per lane, as the aligned words that cover it (blocks sit at
// 2 mod 4 every other one; the quant words are reassembled with shifts).
// All loads of a loop trip are issued before any is used (memory latency).
//
// Other types (the interface a type in dequant*.glsl uses): a type defines
// ROW_BYTES(cols) and `float elem(uint rowb, uint c)` (one element); that
// alone works (the generic path below, one element per lane at a time).  A
// faster form: also define MV_UNIT (elements per unit, e.g. a block or a
// part of one; cols is a multiple of it) and
//     float mv_unit(uint rowb, uint u, uint xb)
// returning sum_e W[row, u * MV_UNIT + e] * x[xb + u * MV_UNIT + e]; lanes
// stride over the units of a row.  mv_unit reads x through x[] or xvec4().
#extension GL_EXT_control_flow_attributes : enable
#extension GL_KHR_shader_subgroup_basic : enable
#extension GL_KHR_shader_subgroup_arithmetic : enable
layout(local_size_x = 128) in;
#define WG 128u
#define NR 2u     // rows a subgroup computes together (they share x loads)
#define RPW 8u    // rows per work group (Ops: _MATVEC_ROWS)
#define UNROLL 4u // vector loads in flight per row per lane (float types)
#define BU 2u     // blocks in flight per row per lane (Q8_0, Q4_0)

layout(std430, set = 0, binding = 0) readonly buffer Weights { uint w[]; };
layout(std430, set = 0, binding = 0) readonly buffer Weights4 { uvec4 w4[]; };
layout(std430, set = 0, binding = 1) readonly buffer Input { float x[]; };
layout(std430, set = 0, binding = 1) readonly buffer Input4 { vec4 x4[]; };
layout(std430, set = 0, binding = 2) buffer Output { float y[]; };

layout(push_constant) uniform Params {
    uint rows;      // weight rows in this dispatch
    uint cols;      // elements per row (quantized: a multiple of the block)
    uint n_tokens;
    uint w_off;     // byte offset of this dispatch's row 0 in binding 0
    uint x_off;     // float offset of X[0, 0] in binding 1
    uint x_stride;  // floats from X[t, 0] to X[t + 1, 0]
    uint y_off;     // float offset of Y[0, row 0] in binding 2
    uint y_stride;  // floats from Y[t, 0] to Y[t + 1, 0]
} p;

#include "dequant.glsl"

bool x_aligned;  // this token's x row starts at a multiple of 4 floats (16 bytes; Ops aligns bindings to 16)

// x[i .. i+3]; i is a multiple of 4.
vec4 xvec4(uint i) {
    if (x_aligned) {
        return x4[i >> 2];
    }
    return vec4(x[i], x[i + 1u], x[i + 2u], x[i + 3u]);
}

// Adds the dot products of rows rowb[k] (byte offsets) with the x row at
// float offset xb into acc[k]; lane `lane` of `sg` lanes.
void dot_rows(uint rowb[NR], uint xb, uint lane, uint sg, inout float acc[NR]) {
#if defined(TYPE_F16) || defined(TYPE_BF16) || defined(TYPE_F32)
#if defined(TYPE_F32)
    const uint EPV = 4u;  // elements per uvec4
#else
    const uint EPV = 8u;
#endif
    bool vec_ok = x_aligned && (p.cols % EPV) == 0u && (rowb[0] & 15u) == 0u && (ROW_BYTES(p.cols) & 15u) == 0u;
    if (vec_ok) {
        uint nv = p.cols / EPV;
        for (uint j0 = lane; j0 < nv; j0 += UNROLL * sg) {
            uvec4 q[UNROLL][NR];
            [[unroll]] for (uint un = 0u; un < UNROLL; un++) {
                uint j = min(j0 + un * sg, nv - 1u);  // clamped: unconditional, independent loads
                [[unroll]] for (uint k = 0u; k < NR; k++) {
                    q[un][k] = w4[(rowb[k] >> 4) + j];
                }
            }
            [[unroll]] for (uint un = 0u; un < UNROLL; un++) {
                uint j = j0 + un * sg;
                if (j < nv) {
                    uint c = xb + j * EPV;
#if defined(TYPE_F32)
                    vec4 xa = x4[c >> 2];
                    [[unroll]] for (uint k = 0u; k < NR; k++) {
                        acc[k] += dot(uintBitsToFloat(q[un][k]), xa);
                    }
#else
                    vec4 xa = x4[c >> 2], xc = x4[(c >> 2) + 1u];
                    [[unroll]] for (uint k = 0u; k < NR; k++) {
                        uvec4 v = q[un][k];
#if defined(TYPE_F16)
                        vec4 a = vec4(unpackHalf2x16(v.x), unpackHalf2x16(v.y));
                        vec4 b = vec4(unpackHalf2x16(v.z), unpackHalf2x16(v.w));
#else
                        vec4 a = uintBitsToFloat(uvec4(v.x << 16, v.x & 0xFFFF0000u, v.y << 16, v.y & 0xFFFF0000u));
                        vec4 b = uintBitsToFloat(uvec4(v.z << 16, v.z & 0xFFFF0000u, v.w << 16, v.w & 0xFFFF0000u));
#endif
                        acc[k] += dot(a, xa) + dot(b, xc);
                    }
#endif
                }
            }
        }
        return;
    }
#endif
#if defined(TYPE_F16) || defined(TYPE_BF16)
    // Unaligned: two halves (one word at an even byte offset) per lane at a
    // time; an odd last column goes to lane 0.
    uint pairs = p.cols >> 1;
    for (uint j = lane; j < pairs; j += sg) {
        [[unroll]] for (uint k = 0u; k < NR; k++) {
            uint q = w_u32a2(rowb[k] + 4u * j);
#if defined(TYPE_F16)
            vec2 v = unpackHalf2x16(q);
#else
            vec2 v = vec2(uintBitsToFloat(q << 16), uintBitsToFloat(q & 0xFFFF0000u));
#endif
            acc[k] += dot(v, vec2(x[xb + 2u * j], x[xb + 2u * j + 1u]));
        }
    }
    if ((p.cols & 1u) != 0u && lane == 0u) {
        [[unroll]] for (uint k = 0u; k < NR; k++) {
            acc[k] += elem(rowb[k], p.cols - 1u) * x[xb + p.cols - 1u];
        }
    }
#elif defined(TYPE_Q8_0) || defined(TYPE_Q4_0)
    // One block per lane: the words covering it.  A block at byte b: if b is
    // a multiple of 4, word 0 holds the scale then two quant bytes, and quant
    // word i (quants 4i..4i+3) is (wd[i] >> 16) | (wd[i+1] << 16); if b is 2
    // mod 4, the scale is wd[0]'s high half and quant word i is wd[i+1].
#if defined(TYPE_Q8_0)
    const uint NW = 9u;   // words covering 34 bytes at an even offset
#else
    const uint NW = 5u;   // 18 bytes
#endif
    uint nb = p.cols >> 5;
    for (uint b0 = lane; b0 < nb; b0 += BU * sg) {
        // The words of BU blocks per row first (clamped: unconditional), then
        // the arithmetic block by block.
        uint wd[BU][NR][NW];
        [[unroll]] for (uint bu = 0u; bu < BU; bu++) {
            uint blk = min(b0 + bu * sg, nb - 1u);
            [[unroll]] for (uint k = 0u; k < NR; k++) {
                uint wi = (rowb[k] + blk * BLOCK_BYTES) >> 2;
                [[unroll]] for (uint i = 0u; i < NW; i++) {
                    wd[bu][k][i] = w[wi + i];
                }
            }
        }
        [[unroll]] for (uint bu = 0u; bu < BU; bu++) {
            uint blk = b0 + bu * sg;
            if (blk >= nb) {
                break;
            }
            uint c = xb + (blk << 5);
            vec4 xs[8];  // Q4_0: 0..3 are elements 0..15 (low nibbles), 4..7 16..31 (high)
            [[unroll]] for (uint i = 0u; i < 8u; i++) {
                xs[i] = xvec4(c + 4u * i);
            }
            [[unroll]] for (uint k = 0u; k < NR; k++) {
                bool odd = ((rowb[k] + blk * BLOCK_BYTES) & 2u) != 0u;
                float d = unpackHalf2x16(odd ? (wd[bu][k][0] >> 16) : wd[bu][k][0]).x;
                float s = 0.0;
#if defined(TYPE_Q8_0)
                [[unroll]] for (uint i = 0u; i < 8u; i++) {
                    int q = int(odd ? wd[bu][k][i + 1u] : ((wd[bu][k][i] >> 16) | (wd[bu][k][i + 1u] << 16)));
                    vec4 v = vec4(bitfieldExtract(q, 0, 8), bitfieldExtract(q, 8, 8), bitfieldExtract(q, 16, 8),
                                  bitfieldExtract(q, 24, 8));
                    s += dot(v, xs[i]);
                }
#else  // Q4_0: quant word i holds elements 4i..4i+3 (low nibbles) and 16+4i.. (high)
                [[unroll]] for (uint i = 0u; i < 4u; i++) {
                    uint q = odd ? wd[bu][k][i + 1u] : ((wd[bu][k][i] >> 16) | (wd[bu][k][i + 1u] << 16));
                    vec4 lo = vec4(q & 15u, (q >> 8) & 15u, (q >> 16) & 15u, (q >> 24) & 15u) - 8.0;
                    vec4 hi = vec4((q >> 4) & 15u, (q >> 12) & 15u, (q >> 20) & 15u, (q >> 28) & 15u) - 8.0;
                    s += dot(lo, xs[i]) + dot(hi, xs[i + 4u]);
                }
#endif
                acc[k] += d * s;
            }
        }
    }
#elif defined(MV_UNIT)
    uint nu = p.cols / MV_UNIT;
    for (uint u = lane; u < nu; u += sg) {
        [[unroll]] for (uint k = 0u; k < NR; k++) {
            acc[k] += mv_unit(rowb[k], u, xb);
        }
    }
#else
    // Generic: one element per lane at a time (F32 unaligned, and any type
    // that defines only elem()).
    for (uint c = lane; c < p.cols; c += sg) {
        float xv = x[xb + c];
        [[unroll]] for (uint k = 0u; k < NR; k++) {
            acc[k] += elem(rowb[k], c) * xv;
        }
    }
#endif
}

void main() {
    uint wg = gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x;
    uint t = gl_WorkGroupID.z;
    uint xb = p.x_off + t * p.x_stride;
    x_aligned = (xb & 3u) == 0u;
    uint lane = gl_SubgroupInvocationID, sg = gl_SubgroupSize;
    uint rb = ROW_BYTES(p.cols);
    // Subgroup g takes rows r0 .. r0 + NR - 1 of the group's RPW, then the
    // next NR if the work group has fewer than RPW / NR subgroups (lavapipe:
    // 16 of 8 lanes, NVIDIA: 4 of 32).  Everything here is subgroup-uniform.
    for (uint g = gl_SubgroupID; g < RPW / NR; g += gl_NumSubgroups) {
        uint r0 = wg * RPW + g * NR;
        if (r0 >= p.rows) {
            break;
        }
        uint rowb[NR];
        float acc[NR];
        [[unroll]] for (uint k = 0u; k < NR; k++) {
            rowb[k] = p.w_off + min(r0 + k, p.rows - 1u) * rb;  // past the end: recompute the last row
            acc[k] = 0.0;
        }
        dot_rows(rowb, xb, lane, sg, acc);
        [[unroll]] for (uint k = 0u; k < NR; k++) {
            float s = subgroupAdd(acc[k]);
            if (lane == 0u && r0 + k < p.rows) {
                y[p.y_off + t * p.y_stride + r0 + k] = s;
            }
        }
    }
}
