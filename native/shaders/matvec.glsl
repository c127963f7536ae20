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
// 4-byte word at a time.  All loads of a loop trip are issued before any is
// used (memory latency).
//
// Quantized types (the interface a type in dequant*.glsl uses): a type
// defines ROW_BYTES(cols) and `float elem(uint rowb, uint c)` (one element);
// that alone works (the generic path below, one element per lane at a
// time).  The fast form: also define MV_UNIT (elements per unit, a block or
// a part of one; cols is a multiple of it) and
//     float mv_unit(uint rowb, uint u, uint xb)
// returning sum_e W[row, u * MV_UNIT + e] * x[xb + u * MV_UNIT + e]; lanes
// stride over the units of a row.  mv_unit reads x through x[] or xvec4().
//
// A word per lane (MV_WORDS, the matvec_w_<type> kernels for Q8_0, Q4_K and
// Q6_K; Ops uses them when rows start on 16 bytes and are a multiple of 16
// bytes long, i.e. nearly always).  Quant blocks are 34-210 bytes: a lane
// decoding a whole block (mv_unit) reads words a block apart from its
// neighbours', so each warp-wide load touches ~9-32 cache lines for 128
// useful bytes, and x (4 bytes an element) is read again for each row: on
// the H200 that held Q8_0 to 1.5 TB/s and Q4_K to 0.46 while F16's 16-byte
// coalesced loads reached 3.7.  Here lane l takes quant word l of the row
// (4 int8 or 8 nibbles: neighbouring lanes, neighbouring words: one warp
// load reads 128 contiguous bytes), the block header is the same for 8-32
// neighbouring lanes (one broadcast), and the x values a word multiplies
// are loaded once for the NR rows of a work group (MW_NR, 4 or 8), whose
// 128 threads share each row.
// Q4_K goes further: a thread takes 16 bytes of quants (32 elements), one
// uvec4 load, with the block header (one uvec4, the same for 8 threads).
// The type defines MW_WPB (units of a thread per block: a quant word, or
// 16 bytes for Q4_K), MW_WU (units a thread has in flight: enough to cover
// the latency, few enough that 4096-column rows waste none), a struct MwX (the x values a unit multiplies, and
// anything derived from x alone, e.g. their sum) and
//     MwX mw_x(uint blk, uint j, uint xb)
//     MwW mw_w(uint rowb, uint blk, uint j)
//     float mw_dot(MwW wv, MwX xv)
// unit j of block blk: its x values, that unit of the row at byte rowb
// (loaded and decoded), and the two dotted, scales applied.
//
// Several tokens (MV_NT > 1: matvec_t<NT>_<type> and matvec_w_t<NT>_<type>,
// NT 4, 8 or 16; Ops takes them for a step's decode rows, one token of each
// of several sequences: vramd/engine/linear.py per_token_kernel).  Work-group
// z is a group of NT tokens (z * NT ..; past the last token: it again,
// computed and not stored); each weight load, and its decoding, serves the
// NT tokens (the MV_WORDS hooks split in two for it: MwW mw_w(rowb, blk, j),
// the unit's weights decoded, and float mw_dot(MwW, MwX), their dot with one
// token's x), so a step of NT sequences reads the weights once where the
// lone kernel, a token per z, read them NT times.  Each token's result is
// bit for bit the lone kernel's (matvec_<type>, matvec_w_<type>: the same
// source with MV_NT 1), so that a request's numbers do not depend on what
// shares its step: a row's sum depends only on the lane -> unit assignment
// (lanes, or the work group's threads, striding over the row), the order
// of a lane's units and the operations on each (the same functions), the
// subgroupAdd and the shared-memory sum over subgroups in order; none of
// these depends on NR, RPW, UNROLL or MW_WU (a unit past the end adds
// keep * 0 to a sum that is never -0), so the NT forms choose their own:
// NT x NR accumulators a thread (at most 32 for matvec_w_t, whose shared
// sums are NT x NR x WG/4: subgroups of 4 lanes or more, Ops checks).
// What would differ is a token whose x alignment picks another load path
// than its lone kernel's (F32/F16/BF16: vec4 or word loads, different
// sums): Ops takes these kernels there only when x_stride % 4 == 0 (every
// token aligned as the first); for the other types x_aligned (all the
// group's tokens aligned) only picks how the same values are loaded.  The
// generic mv_unit path would call the hook per token (the words loaded and
// decoded again for each unless the compiler merges the calls, and NT x NR
// inlined copies: lavapipe took over a minute to compile Q5_K's at NT 4), so
// no matvec_t<NT> is built for the quantized types (per_token_kernel keeps
// their lone kernel); splitting their hooks as MV_WORDS's would give one.
// Both kernels must run with one subgroup size (Ops takes these only where
// the device's is fixed).  Not under MV_ID.  The driver's compiler must also treat a token's
// operations alike in both kernels (contracting a * b + c into an fma the
// same way): test_matvec_tokens.py's native_gpu test checks that on a GPU.
//
// Expert-indexed (MV_ID, the matvec_id_<type> and matvec_id_w_<type>
// kernels of mixture-of-experts models): binding 0 holds stacked expert
// matrices (ggml's [n_expert, rows, cols], expert e's matrix at byte
// e * slab_bytes) and work-group z is a slot (an expert chosen for a token)
// instead of a token: slot z multiplies the matrix of expert ids[id_off + z]
// (binding 3, written on the GPU by moe_route.comp, so a recorded decode
// step needs no readback to pick experts) with x row z / x_div (x_div =
// experts per token: a token's slots share its x for gate and up; 1 for
// down, each slot its own row) into y row z.  A binding may not cover a
// large stack (maxStorageBufferRange), so Ops binds it in runs of experts
// (e_first, e_count) and a slot whose expert is in another run leaves at
// once (the whole work group: z is uniform).
#extension GL_EXT_control_flow_attributes : enable
#extension GL_KHR_shader_subgroup_basic : enable
#extension GL_KHR_shader_subgroup_arithmetic : enable
#ifdef MV_ROWLANE
layout(local_size_x = MC_WG) in;  // MV_ROWLANE: a row per invocation (matvec_c_<type>.comp sets MC_WG)
#define WG MC_WG
#else
layout(local_size_x = 128) in;
#define WG 128u
#endif
#ifndef MV_NT
#define MV_NT 1  // tokens a work group computes (MV_NT > 1: matvec_t<NT>_<type>, matvec_w_t<NT>_<type>)
#endif
#if MV_NT > 1 && defined(MV_ID)
#error "MV_NT > 1 is for dense matrices (a slot per z under MV_ID)"
#endif
#define NT uint(MV_NT)
#ifdef MV_WORDS
#define NR MW_NR  // rows a work group computes together (they share x loads): set by matvec_w_<type>.comp
#define RPW MW_NR // rows per work group (Ops: linear.MATVEC_ROWS_W, MATVEC_ROWS_WT)
#elif MV_NT > 1
#define NR 4u     // (a row's sum does not depend on NR, RPW or UNROLL: see "Several tokens")
#define RPW 16u   // (Ops: linear.MATVEC_ROWS_T)
#else
#define NR 2u
#define RPW 8u    // (Ops: linear.MATVEC_ROWS)
#endif
#if MV_NT > 1
#define UNROLL 2u // vector loads in flight per row per lane (float types; fewer: NT x NR accumulators)
#else
#define UNROLL 4u
#endif

layout(std430, set = 0, binding = 0) readonly buffer Weights { uint w[]; };
layout(std430, set = 0, binding = 0) readonly buffer Weights4 { uvec4 w4[]; };
#ifdef MV_ROWLANE
layout(std430, set = 0, binding = 0) readonly buffer Weights2 { uvec2 w2[]; };
#endif
layout(std430, set = 0, binding = 1) readonly buffer Input { float x[]; };
layout(std430, set = 0, binding = 1) readonly buffer Input4 { vec4 x4[]; };
layout(std430, set = 0, binding = 2) buffer Output { float y[]; };
#ifdef MV_ID
layout(std430, set = 0, binding = 3) readonly buffer Ids { uint ids[]; };
#endif

layout(push_constant) uniform Params {
    uint rows;      // weight rows in this dispatch
    uint cols;      // elements per row (quantized: a multiple of the block)
    uint n_tokens;
    uint w_off;     // byte offset of this dispatch's row 0 in binding 0
    uint x_off;     // float offset of X[0, 0] in binding 1
    uint x_stride;  // floats from X[t, 0] to X[t + 1, 0]
    uint y_off;     // float offset of Y[0, row 0] in binding 2
    uint y_stride;  // floats from Y[t, 0] to Y[t + 1, 0]
#ifdef MV_ID
    uint id_off;     // uint offset of slot 0's expert id in binding 3
    uint slab_bytes; // bytes of one expert's matrix (rows * ROW_BYTES(cols))
    uint e_first;    // binding 0 holds experts e_first .. e_first + e_count - 1,
    uint e_count;    // e_first's row 0 at byte w_off
    uint x_div;      // slots per x row
#endif
} p;

#include "dequant.glsl"

#ifdef MV_ID
// Slot z's expert, if it is in this dispatch's run: the byte offset of its
// matrix in binding 0.  Unsigned: an id below e_first wraps past e_count.
bool expert_matrix(uint z, out uint wb) {
    uint e = ids[p.id_off + z] - p.e_first;
    wb = p.w_off + e * p.slab_bytes;
    return e < p.e_count;
}
#define W_BASE wb
#else
#define W_BASE p.w_off
#endif

bool x_aligned;  // this token's x row starts at a multiple of 4 floats (16 bytes; Ops aligns bindings to 16)

// x[i .. i+3]; i is a multiple of 4.
vec4 xvec4(uint i) {
    if (x_aligned) {
        return x4[i >> 2];
    }
    return vec4(x[i], x[i + 1u], x[i + 2u], x[i + 3u]);
}

// Adds the dot products of rows rowb[k] (byte offsets) with the x rows at
// float offsets xb[t] into acc[t][k]; lane `lane` of `sg` lanes.  Each
// weight load (and its decoding) serves the NT tokens; token t's sums
// take the same operations in the same order whatever NT is.
void dot_rows(uint rowb[NR], uint xb[NT], uint lane, uint sg, inout float acc[NT][NR]) {
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
#if defined(TYPE_F32)
                    [[unroll]] for (uint t = 0u; t < NT; t++) {
                        vec4 xa = x4[(xb[t] + j * EPV) >> 2];
                        [[unroll]] for (uint k = 0u; k < NR; k++) {
                            acc[t][k] += dot(uintBitsToFloat(q[un][k]), xa);
                        }
                    }
#else
                    vec4 a[NR], b[NR];
                    [[unroll]] for (uint k = 0u; k < NR; k++) {
                        uvec4 v = q[un][k];
#if defined(TYPE_F16)
                        a[k] = vec4(unpackHalf2x16(v.x), unpackHalf2x16(v.y));
                        b[k] = vec4(unpackHalf2x16(v.z), unpackHalf2x16(v.w));
#else
                        a[k] = uintBitsToFloat(uvec4(v.x << 16, v.x & 0xFFFF0000u, v.y << 16, v.y & 0xFFFF0000u));
                        b[k] = uintBitsToFloat(uvec4(v.z << 16, v.z & 0xFFFF0000u, v.w << 16, v.w & 0xFFFF0000u));
#endif
                    }
                    [[unroll]] for (uint t = 0u; t < NT; t++) {
                        uint c = (xb[t] + j * EPV) >> 2;
                        vec4 xa = x4[c], xc = x4[c + 1u];
                        [[unroll]] for (uint k = 0u; k < NR; k++) {
                            acc[t][k] += dot(a[k], xa) + dot(b[k], xc);
                        }
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
            [[unroll]] for (uint t = 0u; t < NT; t++) {
                acc[t][k] += dot(v, vec2(x[xb[t] + 2u * j], x[xb[t] + 2u * j + 1u]));
            }
        }
    }
    if ((p.cols & 1u) != 0u && lane == 0u) {
        [[unroll]] for (uint k = 0u; k < NR; k++) {
            float e = elem(rowb[k], p.cols - 1u);
            [[unroll]] for (uint t = 0u; t < NT; t++) {
                acc[t][k] += e * x[xb[t] + p.cols - 1u];
            }
        }
    }
#elif defined(MV_UNIT) && !(defined(MC_NT) && MC_NT == 4)  // (matmul_c: the hook sums 4 tokens; dot_rows unused)
    // A unit per call (NT 1 only: see "Several tokens").
    uint nu = p.cols / MV_UNIT;
    for (uint u = lane; u < nu; u += sg) {
        [[unroll]] for (uint k = 0u; k < NR; k++) {
            [[unroll]] for (uint t = 0u; t < NT; t++) {
                acc[t][k] += mv_unit(rowb[k], u, xb[t]);
            }
        }
    }
#else
    // Generic: one element per lane at a time (F32 unaligned, and any type
    // that defines only elem()).
    for (uint c = lane; c < p.cols; c += sg) {
        float xv[NT];
        [[unroll]] for (uint t = 0u; t < NT; t++) {
            xv[t] = x[xb[t] + c];
        }
        [[unroll]] for (uint k = 0u; k < NR; k++) {
            float e = elem(rowb[k], c);
            [[unroll]] for (uint t = 0u; t < NT; t++) {
                acc[t][k] += e * xv[t];
            }
        }
    }
#endif
}

// The first x offset of the group's tokens (past the last token: it again,
// computed and not stored) and whether all of them are 16-byte aligned.
void token_rows(out uint xb[NT]) {
    uint t0 = gl_WorkGroupID.z * NT;
    x_aligned = true;
    [[unroll]] for (uint t = 0u; t < NT; t++) {
        xb[t] = p.x_off + min(t0 + t, p.n_tokens - 1u) * p.x_stride;
        x_aligned = x_aligned && (xb[t] & 3u) == 0u;
    }
}

#ifdef MV_WORDS
#if MV_NT > 1
shared float part[NT * NR][WG / 4u];  // per-subgroup sums (Ops: subgroups of 4 lanes or more)
#else
shared float part[NR][WG];  // per-subgroup sums (at most WG subgroups)
#endif

// main for matvec_w_<type>: the whole work group on NR rows, its threads
// striding over their units, MW_WU units a trip, all loads of a trip
// before any arithmetic (branch-free: a word past the end is recomputed and
// counted as 0).  Splitting a row over 128 threads rather than one
// subgroup keeps short matrices (1024 x 4096: 256 groups) from leaving the
// GPU waiting on a few long chains of loads.  Subgroup sums meet in shared
// memory.  A unit's weights are decoded once (mw_w) for the NT tokens.
void matvec_words() {
    uint wg = gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x;
    uint t0 = gl_WorkGroupID.z * NT;
    uint xb[NT];
#ifdef MV_ID
    uint wb;
    if (!expert_matrix(t0, wb)) {
        return;  // the whole group: uniform
    }
    xb[0] = p.x_off + (t0 / p.x_div) * p.x_stride;
    x_aligned = (xb[0] & 3u) == 0u;
#else
    token_rows(xb);
#endif
    uint r0 = wg * RPW;
    if (r0 >= p.rows) {
        return;  // the whole group: uniform
    }
    uint rowb[NR];
    float acc[NT][NR];
    [[unroll]] for (uint k = 0u; k < NR; k++) {
        rowb[k] = W_BASE + min(r0 + k, p.rows - 1u) * ROW_BYTES(p.cols);  // past the end: the last row again
        [[unroll]] for (uint t = 0u; t < NT; t++) {
            acc[t][k] = 0.0;
        }
    }
    uint nw = (p.cols / BLOCK_ELEMS) * MW_WPB;
    for (uint w0 = gl_LocalInvocationID.x; w0 < nw; w0 += MW_WU * WG) {
        [[unroll]] for (uint u = 0u; u < MW_WU; u++) {
            uint wi = w0 + u * WG;
            float keep = wi < nw ? 1.0 : 0.0;
            wi = min(wi, nw - 1u);
            uint blk = wi / MW_WPB, j = wi % MW_WPB;
            MwW wv[NR];
            [[unroll]] for (uint k = 0u; k < NR; k++) {
                wv[k] = mw_w(rowb[k], blk, j);
            }
            [[unroll]] for (uint t = 0u; t < NT; t++) {
                MwX xv = mw_x(blk, j, xb[t]);
                [[unroll]] for (uint k = 0u; k < NR; k++) {
                    acc[t][k] += keep * mw_dot(wv[k], xv);
                }
            }
        }
    }
    [[unroll]] for (uint t = 0u; t < NT; t++) {
        [[unroll]] for (uint k = 0u; k < NR; k++) {
            float s = subgroupAdd(acc[t][k]);
            if (subgroupElect()) {
                part[t * NR + k][gl_SubgroupID] = s;
            }
        }
    }
    barrier();
    uint i = gl_LocalInvocationID.x, t = i / NR, k = i % NR;
    if (i < NT * NR && r0 + k < p.rows && t0 + t < p.n_tokens) {
        float s = 0.0;
        for (uint g = 0u; g < gl_NumSubgroups; g++) {
            s += part[i][g];
        }
        y[p.y_off + (t0 + t) * p.y_stride + r0 + k] = s;
    }
}
#endif

#ifdef MV_ROWLANE
// main for matvec_c_<type> (CPU devices: linear.select() picks it by the
// device type).  A CPU driver such as lavapipe runs a work group's
// invocations as a loop over SIMD lanes, executes both sides of any branch
// some lane takes, and turns a load whose address differs per lane into one
// scalar load per lane, while a load whose address is the same for every
// lane is one load.  So here each invocation computes one whole row alone:
// the x it reads depends only on the loop counter (one load serves every
// lane), the row's weights are its own, and there is no subgroup sum, no
// shared memory and no barrier; the work group is a few SIMD widths of
// rows, so each CPU thread gets long runs of plain loops.
#ifndef MV_XAT
#define MV_XAT(u, i) ((u) * MV_UNIT + 4u * (i))  // x index of mvx[i] for unit u: units are contiguous
#endif
#ifndef MC_NT
#define MC_NT 1  // tokens an invocation multiplies (matmul_c_<type>.comp: 4, work-group z a 4-token group)
#endif
// x[t][i .. i+3] for the invocation's tokens (first x offsets xt[]): a vec4, or (MC_NT 4) the
// mat4 of the 4 tokens (dequant.glsl's MV_XV).  Every lane reads the same x: one load for all.
MV_XV x_at(uint xt[MC_NT], uint i) {
#if MC_NT == 4
    return mat4(xvec4(xt[0] + i), xvec4(xt[1] + i), xvec4(xt[2] + i), xvec4(xt[3] + i));
#else
    return xvec4(xt[0] + i);
#endif
}
void matvec_rowlane() {
    uint wg = gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x;
    uint t0 = gl_WorkGroupID.z * MC_NT;
    uint xt[MC_NT];
    [[unroll]] for (uint j = 0u; j < MC_NT; j++) {
        xt[j] = p.x_off + min(t0 + j, p.n_tokens - 1u) * p.x_stride;  // past the last token: it again, not stored
    }
    x_aligned = (xt[0] & 3u) == 0u && (MC_NT == 1 || (p.x_stride & 3u) == 0u);
    uint nu = p.cols / MV_UNIT;
    uint r0 = wg * WG * MC_NR;
    if (r0 >= p.rows) {
        return;  // the whole group
    }
    uint rowb[MC_NR];
    MV_ACC acc[MC_NR];
    [[unroll]] for (uint k = 0u; k < MC_NR; k++) {
        rowb[k] = W_BASE + min(r0 + k * WG + gl_LocalInvocationID.x, p.rows - 1u) * ROW_BYTES(p.cols);
        acc[k] = MV_ACC(0.0);  // (past the end: the last row again, not stored)
    }
    for (uint u = 0u; u < nu; u++) {
        [[unroll]] for (uint i = 0u; i < MV_UNIT / 4u; i++) {
            mvx[i] = x_at(xt, MV_XAT(u, i));
        }
        [[unroll]] for (uint k = 0u; k < MC_NR; k++) {
            acc[k] += mv_unit(rowb[k], u, 0u);
        }
    }
    [[unroll]] for (uint k = 0u; k < MC_NR; k++) {
        uint r = r0 + k * WG + gl_LocalInvocationID.x;
        [[unroll]] for (uint j = 0u; j < MC_NT; j++) {
            if (r < p.rows && t0 + j < p.n_tokens) {
#if MC_NT == 4
                y[p.y_off + (t0 + j) * p.y_stride + r] = acc[k][j];
#else
                y[p.y_off + (t0 + j) * p.y_stride + r] = acc[k];
#endif
            }
        }
    }
}
#endif

void main() {
#ifdef MV_ROWLANE
    matvec_rowlane();
    return;
#endif
#ifdef MV_WORDS
    matvec_words();
    return;
#endif
    uint wg = gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x;
    uint t0 = gl_WorkGroupID.z * NT;
    uint xb[NT];
#ifdef MV_ID
    uint wb;
    if (!expert_matrix(t0, wb)) {
        return;
    }
    xb[0] = p.x_off + (t0 / p.x_div) * p.x_stride;
    x_aligned = (xb[0] & 3u) == 0u;
#else
    token_rows(xb);  // (NT > 1, float types: Ops requires x_stride % 4 == 0, so that every
                     // token takes the load path its lone kernel takes)
#endif
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
        float acc[NT][NR];
        [[unroll]] for (uint k = 0u; k < NR; k++) {
            rowb[k] = W_BASE + min(r0 + k, p.rows - 1u) * rb;  // past the end: recompute the last row
            [[unroll]] for (uint t = 0u; t < NT; t++) {
                acc[t][k] = 0.0;
            }
        }
        dot_rows(rowb, xb, lane, sg, acc);
        [[unroll]] for (uint t = 0u; t < NT; t++) {
            [[unroll]] for (uint k = 0u; k < NR; k++) {
                float s = subgroupAdd(acc[t][k]);
                if (lane == 0u && r0 + k < p.rows && t0 + t < p.n_tokens) {
                    y[p.y_off + (t0 + t) * p.y_stride + r0 + k] = s;
                }
            }
        }
    }
}
