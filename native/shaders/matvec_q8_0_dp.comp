// Decode matvec with Q8_0 weights by integer dot products: Y[t, r] =
// sum_c W[r, c] * X[t, c], X quantized to 8 bits first (issue 15 item 4).
// Selected by vramd/engine/linear.py (select, q8_decode_usable) where the
// device has VK_KHR_shader_integer_dot_product; the same bindings and push
// constants as matvec.glsl (Ops.matvec dispatches either), a token per z.
//
// 1. Each work group quantizes its token's x row into shared memory the way
//    llama.cpp's q8_1 activations are made: per block of 32, d = amax / 127,
//    q = round(x / d) (|x - d q| <= d / 2), 4 int8 packed a word.  Every work
//    group does this for itself rather than a separate kernel writing it once:
//    the word kernel it replaces already read the whole f32 x row per work
//    group (L2-resident, 16-56 KB), so this costs no more x traffic, needs no
//    scratch buffer and no extra dispatch or barrier in a recorded step, and
//    the dot loop then reads 1 byte of x per element from shared memory
//    instead of 4 from global.
// 2. The dot loop is matvec.glsl's word-per-thread form (MV_WORDS): a work
//    group on NR rows, thread i on quant word i of the row (neighbouring
//    threads, neighbouring words: a warp load reads 128 contiguous bytes),
//    MW_WU words in flight.  A 34-byte block starts at 0 or 2 mod 4, so a
//    quant word is stitched from the two aligned words covering it (adjacent,
//    one cache line); then one OpSDot (4 x int8 -> int32, exact) replaces four
//    extracts, conversions and multiply-adds, and the f32 scales d_w * d_x are
//    applied per word.  The first trip's weight loads are issued before step 1.
// GL_EXT_integer_dot_product needs a newer glslang than the one pinned here,
// so OpSDot (SPV_KHR_integer_dot_product; DotProduct, DotProductInput4x8BitPacked)
// is declared through GL_EXT_spirv_intrinsics.
#version 450
#extension GL_EXT_control_flow_attributes : enable
#extension GL_KHR_shader_subgroup_basic : enable
#extension GL_KHR_shader_subgroup_arithmetic : enable
#extension GL_EXT_spirv_intrinsics : require

spirv_instruction(extensions = ["SPV_KHR_integer_dot_product"], capabilities = [6019, 6018], id = 4450)
int sdot4x8(int a, int b, spirv_literal int packed_format);  // OpSDot, format 0: PackedVectorFormat4x8Bit (as glslang emits dotPacked4x8EXT(int, int))

layout(local_size_x = 128) in;
#define WG 128u
#define NR 8u          // rows a work group (linear.py: Q8_DP_ROWS)
#define MW_WU 4u       // words a thread has in flight per row
#define MAX_COLS 16384u  // shared x: 1.125 bytes a column (linear.py: Q8_DP_MAX_COLS)

layout(std430, set = 0, binding = 0) readonly buffer Weights { uint w[]; };
layout(std430, set = 0, binding = 1) readonly buffer Input { float x[]; };
layout(std430, set = 0, binding = 1) readonly buffer Input4 { vec4 x4[]; };
layout(std430, set = 0, binding = 2) buffer Output { float y[]; };

layout(push_constant) uniform Params {
    uint rows;      // weight rows in this dispatch
    uint cols;      // elements per row (a multiple of 32, at most MAX_COLS)
    uint n_tokens;
    uint w_off;     // byte offset of this dispatch's row 0 in binding 0 (even)
    uint x_off;     // float offset of X[0, 0] in binding 1
    uint x_stride;  // floats from X[t, 0] to X[t + 1, 0]
    uint y_off;     // float offset of Y[0, row 0] in binding 2
    uint y_stride;  // floats from Y[t, 0] to Y[t + 1, 0]
} p;

shared uint xq[MAX_COLS / 4u];   // x's int8 quants, 4 a word (element 4i + k in byte k of word i)
shared float xd[MAX_COLS / 32u]; // x's block scales
shared float part[NR][WG];       // per-subgroup sums

// Block `blk` of the x row at float offset xb into xq / xd.
void quantize_block(uint xb, uint blk, bool aligned) {
    vec4 v[8];
    uint c = xb + blk * 32u;
    [[unroll]] for (uint i = 0u; i < 8u; i++) {
        v[i] = aligned ? x4[(c >> 2) + i]
                       : vec4(x[c + 4u * i], x[c + 4u * i + 1u], x[c + 4u * i + 2u], x[c + 4u * i + 3u]);
    }
    vec4 m = abs(v[0]);
    [[unroll]] for (uint i = 1u; i < 8u; i++) {
        m = max(m, abs(v[i]));
    }
    float amax = max(max(m.x, m.y), max(m.z, m.w));
    float d = amax / 127.0;
    float id = d > 0.0 ? 1.0 / d : 0.0;
    [[unroll]] for (uint i = 0u; i < 8u; i++) {
        ivec4 q = clamp(ivec4(round(v[i] * id)), ivec4(-127), ivec4(127));
        xq[blk * 8u + i] = uint(q.x & 255) | (uint(q.y & 255) << 8) | (uint(q.z & 255) << 16) | (uint(q.w & 255) << 24);
    }
    xd[blk] = d;
}

uint rowb[NR];
uint qw[MW_WU][NR];   // a trip's quant words
float dw[MW_WU][NR];  // and their blocks' scales

// Issues the loads of the trip from word w0 (MW_WU words a thread, WG apart; past the end: the
// last word again, counted 0 by the caller).
void load_trip(uint w0, uint nw) {
    [[unroll]] for (uint u = 0u; u < MW_WU; u++) {
        uint wi = min(w0 + u * WG, nw - 1u);
        uint blk = wi >> 3, j = wi & 7u;
        [[unroll]] for (uint k = 0u; k < NR; k++) {
            uint b = rowb[k] + blk * 34u;
            uint o = b + 2u + 4u * j, i = o >> 2;
            uint lo = w[i], hi = w[i + 1u], sw = w[b >> 2];
            qw[u][k] = (o & 2u) == 0u ? lo : (lo >> 16) | (hi << 16);
            dw[u][k] = unpackHalf2x16((b & 2u) == 0u ? sw : sw >> 16).x;
        }
    }
}

void main() {
    uint wg = gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x;
    uint t = gl_WorkGroupID.z;
    uint r0 = wg * NR;
    if (r0 >= p.rows) {
        return;  // the whole group: uniform
    }
    uint xb = p.x_off + t * p.x_stride;
    uint nb = p.cols / 32u, nw = nb * 8u;
    float acc[NR];
    [[unroll]] for (uint k = 0u; k < NR; k++) {
        rowb[k] = p.w_off + min(r0 + k, p.rows - 1u) * (nb * 34u);  // past the end: the last row again
        acc[k] = 0.0;
    }
    // The first trip's weight loads go out before x is quantized: they do not depend on it, and
    // a 4096-column row is only two trips a thread, so the prologue would otherwise stall them.
    load_trip(gl_LocalInvocationID.x, nw);
    bool aligned = (xb & 3u) == 0u;
    for (uint blk = gl_LocalInvocationID.x; blk < nb; blk += WG) {
        quantize_block(xb, blk, aligned);
    }
    barrier();

    for (uint w0 = gl_LocalInvocationID.x; w0 < nw; w0 += MW_WU * WG) {
        if (w0 != gl_LocalInvocationID.x) {
            load_trip(w0, nw);
        }
        [[unroll]] for (uint u = 0u; u < MW_WU; u++) {
            uint wi = w0 + u * WG;
            float keep = wi < nw ? 1.0 : 0.0;  // branch-free: a word past the end is recomputed, counted 0
            wi = min(wi, nw - 1u);
            uint xw = xq[wi];
            float dx = keep * xd[wi >> 3];
            [[unroll]] for (uint k = 0u; k < NR; k++) {
                acc[k] += float(sdot4x8(int(qw[u][k]), int(xw), 0)) * (dw[u][k] * dx);
            }
        }
    }
    [[unroll]] for (uint k = 0u; k < NR; k++) {
        float s = subgroupAdd(acc[k]);
        if (subgroupElect()) {
            part[k][gl_SubgroupID] = s;
        }
    }
    barrier();
    uint k = gl_LocalInvocationID.x;
    if (k < NR && r0 + k < p.rows) {
        float s = 0.0;
        for (uint i = 0u; i < gl_NumSubgroups; i++) {
            s += part[k][i];
        }
        y[p.y_off + t * p.y_stride + r0 + k] = s;
    }
}
