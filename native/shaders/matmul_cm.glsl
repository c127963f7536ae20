// Y[t, r] = sum_c W[r, c] * X[t, c] for many tokens (prefill) on the tensor
// cores: KHR cooperative matrices (16 x 16 x 16, f16 inputs, f32
// accumulators).  Included by matmul_cm_<type>.comp, which enables the
// extensions (GL_KHR_cooperative_matrix there is also what makes
// vramd/gpu/kernels.py compile it with glslang) and defines one TYPE_<name>.
// Same bindings and push constants as matmul.glsl / matvec.glsl, so
// Ops.matvec dispatches it unchanged; vramd/engine/linear.py chooses it.
//
// A work group (by default 256 threads = 8 subgroups of 32: the pipeline
// requires 32 lanes where the device can be asked, VK_EXT_subgroup_size_control,
// else linear.py chooses it only on devices of 32) computes 128 weight rows x
// 128 tokens (the defaults below), stepping through
// the columns BK at a time: each step dequantizes a 128 x BK tile of W
// (dq16 below: 16 consecutive elements of a row at once, read as uint32
// words with the block's scales decoded once; dequant.glsl's elem() one by
// one for the rarer types and the ragged end of an f16 row) and converts a
// 128 x BK tile of X to f16 in shared memory (as f16vec4s), then each
// subgroup multiplies its 32 rows x 64 tokens (2 x 4 accumulators) from
// there.  Each weight element is read and decoded once per 128 tokens.  The
// next step's tiles are loaded into registers while the tensor cores work
// on this one (fetch), then stored to shared memory between two barriers.  Edges (rows,
// tokens, columns past the ends) are zeros in the tiles; results go through
// a per-subgroup 16 x 16 staging area in shared memory and are written with
// bounds checks, so y needs no alignment and any stride works.
// Work-group x (+ y * width) is the row tile, z the token tile.
//
// The tile shape is set by the defines below (defaults: the committed kernel;
// vramd/bench/matmul.py --sweep compiles others with -D to compare them):
//   CM_BR x CM_BT   rows x tokens of a work group, CM_BK columns a step
//   CM_SGR x CM_SGT rows x tokens of a subgroup ((CM_SGR/16) x (CM_SGT/16) accumulators)
//   CM_NT           threads: 32 per subgroup tile (BR/SGR) x (BT/SGT)
//   CM_PAD          f16vec4s of padding per shared tile row (bank spread; even: 16-byte rows)
//   CM_DB           1: two shared buffers, the next step stored into the other (one barrier a step)
#ifndef CM_BR
#define CM_BR 128
#define CM_BT 128
#define CM_BK 64
#define CM_SGR 32
#define CM_SGT 64
#define CM_NT 256
#define CM_PAD 2
#define CM_DB 0
#endif
layout(local_size_x = CM_NT) in;
#define BR uint(CM_BR)
#define BT uint(CM_BT)
#define BK uint(CM_BK)
#define SGR uint(CM_SGR)
#define SGT uint(CM_SGT)
#define NT uint(CM_NT)
#define NSG (NT / 32u)
#define LD4 (BK / 4u + uint(CM_PAD))   // f16vec4s per tile row: 16-byte aligned (coopMatLoad), rows in other banks
#define CPR (BK / 16u)                 // 16-column chunks per tile row
#define WCH (BR * CPR / NT)            // chunks of the W tile each thread loads
#define XCH (BT * CPR / NT)            // and of the X tile
#define RSTEP (NT / CPR)               // tile rows between a thread's chunks
#define NB (CM_DB + 1)                 // shared buffers

layout(std430, set = 0, binding = 0) readonly buffer Weights { uint w[]; };
layout(std430, set = 0, binding = 1) readonly buffer Input { float x[]; };
layout(std430, set = 0, binding = 1) readonly buffer InputV { vec4 xv[]; };   // x where 16-byte aligned
layout(std430, set = 0, binding = 2) buffer Output { float y[]; };

layout(push_constant) uniform Params {
    uint rows;      // weight rows in this dispatch
    uint cols;      // elements per row (quantized: a multiple of 32)
    uint n_tokens;
    uint w_off;     // byte offset of this dispatch's row 0 in binding 0
    uint x_off;     // float offset of X[0, 0] in binding 1
    uint x_stride;  // floats from X[t, 0] to X[t + 1, 0]
    uint y_off;     // float offset of Y[0, row 0] in binding 2
    uint y_stride;  // floats from Y[t, 0] to Y[t + 1, 0]
} p;

#include "dequant.glsl"

// dq16(rowb, c0, o): elements c0 .. c0 + 15 (c0 a multiple of 16, all within the row) of
// the row at byte rowb.  Sixteen elements never cross a block, nor a scale's sub-block.
#if defined(TYPE_F16) || defined(TYPE_BF16)
void dq16(uint rowb, uint c0, out f16vec4 o[4]) {
    uint b = rowb + 2u * c0;
    [[unroll]] for (uint i = 0u; i < 4u; i++) {
        uint lo = w_u32a2(b + 8u * i), hi = w_u32a2(b + 8u * i + 4u);
#if defined(TYPE_F16)
        o[i] = f16vec4(unpackFloat2x16(lo), unpackFloat2x16(hi));
#else
        o[i] = f16vec4(vec4(uintBitsToFloat(lo << 16), uintBitsToFloat(lo & 0xFFFF0000u),
                            uintBitsToFloat(hi << 16), uintBitsToFloat(hi & 0xFFFF0000u)));
#endif
    }
}
#elif defined(TYPE_Q8_0)
void dq16(uint rowb, uint c0, out f16vec4 o[4]) {
    uint b = rowb + (c0 >> 5) * 34u;
    float d = w_f16(b);
    uint qb = b + 2u + (c0 & 16u);
    [[unroll]] for (uint i = 0u; i < 4u; i++) {
        int q = int(w_u32a2(qb + 4u * i));
        o[i] = f16vec4(d * vec4(bitfieldExtract(q, 0, 8), bitfieldExtract(q, 8, 8), bitfieldExtract(q, 16, 8),
                                bitfieldExtract(q, 24, 8)));
    }
}
#elif defined(TYPE_Q4_0)
void dq16(uint rowb, uint c0, out f16vec4 o[4]) {
    uint b = rowb + (c0 >> 5) * 18u;
    float d = w_f16(b);
    uint sh = (c0 & 16u) >> 2;   // elements 16..31: the high nibbles
    [[unroll]] for (uint i = 0u; i < 4u; i++) {
        uint q = w_u32a2(b + 2u + 4u * i) >> sh;
        o[i] = f16vec4(d * (vec4(q & 15u, (q >> 8) & 15u, (q >> 16) & 15u, (q >> 24) & 15u) - 8.0));
    }
}
#elif defined(TYPE_Q4_K) || defined(TYPE_Q5_K)
void dq16(uint rowb, uint c0, out f16vec4 o[4]) {
#if defined(TYPE_Q4_K)
    uint b = rowb + (c0 >> 8) * 144u, qs = 16u;
#else
    uint b = rowb + (c0 >> 8) * 176u, qs = 48u;
#endif
    uint j = c0 & 255u, s = j >> 5, l0 = j & 31u;
    float sc, mn;
    k4_scale_min(b, s, sc, mn);
    float d = w_f16(b) * sc, m = w_f16(b + 2u) * mn;
    uint sh = (s & 1u) << 2;   // odd sub-blocks: the high nibbles
    uint qb = b + qs + ((j >> 6) << 5) + l0;
    [[unroll]] for (uint i = 0u; i < 4u; i++) {
        uint q = (w_u32a2(qb + 4u * i) >> sh) & 0x0F0F0F0Fu;
#if defined(TYPE_Q5_K)
        q |= ((w_u32a2(b + 16u + l0 + 4u * i) >> s) & 0x01010101u) << 4;   // bit s of qh[l]: the 5th bit
#endif
        o[i] = f16vec4(d * vec4(q & 255u, (q >> 8) & 255u, (q >> 16) & 255u, q >> 24) - m);
    }
}
#elif defined(TYPE_Q6_K)
void dq16(uint rowb, uint c0, out f16vec4 o[4]) {
    uint b = rowb + (c0 >> 8) * 210u;
    uint j = c0 & 255u, n = j >> 7, g = (j >> 5) & 3u, l0 = j & 31u;
    int sc = int(w_u8(b + 192u + (n << 3) + (l0 >> 4) + 2u * g) << 24) >> 24;
    float d = w_f16(b + 208u) * float(sc);
    uint qlb = b + (n << 6) + ((g & 1u) << 5) + l0, qhb = b + 128u + (n << 5) + l0;
    uint sh = g < 2u ? 0u : 4u;
    [[unroll]] for (uint i = 0u; i < 4u; i++) {
        uint q = ((w_u32a2(qlb + 4u * i) >> sh) & 0x0F0F0F0Fu) | (((w_u32a2(qhb + 4u * i) >> (2u * g)) & 0x03030303u) << 4);
        o[i] = f16vec4(d * (vec4(q & 255u, (q >> 8) & 255u, (q >> 16) & 255u, q >> 24) - 32.0));
    }
}
#else   // Q4_1, Q5_0, Q5_1: element by element
void dq16(uint rowb, uint c0, out f16vec4 o[4]) {
    [[unroll]] for (uint i = 0u; i < 4u; i++) {
        uint c = c0 + 4u * i;
        o[i] = f16vec4(elem(rowb, c), elem(rowb, c + 1u), elem(rowb, c + 2u), elem(rowb, c + 3u));
    }
}
#endif

#define CM_A coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA>
#define CM_B coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB>
#define CM_C coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>

shared f16vec4 ws[NB * BR * LD4];   // W tile(s), row-major: element (r, k) in ws[r * LD4 + k / 4]
shared f16vec4 xs[NB * BT * LD4];   // X tile(s), a token per row (B, column-major)
shared float st[NSG * 256u];        // per subgroup: one 16 x 16 result, st[t * 16 + r]

// This thread's chunks of the loads: chunk h of W is tile row lr + h * RSTEP, columns
// lc .. lc + 15 (of X likewise); consecutive threads read consecutive chunks of a row.
uint lr, lc, r0, t0;

// The next step's tiles into registers (wr: W, xr: X, 16 columns a chunk), so that the
// global loads of step k + 1 are in flight while the tensor cores work on step k.
void fetch(uint k0, out f16vec4 wr[WCH][4], out f16vec4 xr[XCH][4]) {
    uint c0 = k0 + lc;
    [[unroll]] for (uint h = 0u; h < WCH; h++) {
        uint r = r0 + lr + h * RSTEP;
        bool wrow = r < p.rows;
        uint wrowb = p.w_off + r * ROW_BYTES(p.cols);
        if (wrow && c0 + 16u <= p.cols) {
            dq16(wrowb, c0, wr[h]);
        } else {   // past the last row, or the ragged end of an f16/bf16 row
            [[unroll]] for (uint i = 0u; i < 4u; i++) {
                vec4 v = vec4(0.0);
                [[unroll]] for (uint e = 0u; e < 4u; e++) {
                    if (wrow && c0 + 4u * i + e < p.cols) {
                        v[e] = elem(wrowb, c0 + 4u * i + e);
                    }
                }
                wr[h][i] = f16vec4(v);
            }
        }
    }
    [[unroll]] for (uint h = 0u; h < XCH; h++) {
        uint t = t0 + lr + h * RSTEP;
        bool xrow = t < p.n_tokens;
        uint xrow0 = p.x_off + t * p.x_stride;
        bool xvec = (xrow0 & 3u) == 0u;
        [[unroll]] for (uint i = 0u; i < 4u; i++) {
            uint c = c0 + 4u * i;
            vec4 v = vec4(0.0);
            if (xrow && c + 4u <= p.cols) {
                v = xvec ? xv[(xrow0 + c) >> 2]
                         : vec4(x[xrow0 + c], x[xrow0 + c + 1u], x[xrow0 + c + 2u], x[xrow0 + c + 3u]);
            } else if (xrow) {
                [[unroll]] for (uint e = 0u; e < 4u; e++) {
                    if (c + e < p.cols) {
                        v[e] = x[xrow0 + c + e];
                    }
                }
            }
            xr[h][i] = f16vec4(v);
        }
    }
}

void put(uint buf, f16vec4 wr[WCH][4], f16vec4 xr[XCH][4]) {
    [[unroll]] for (uint h = 0u; h < WCH; h++) {
        uint sb = buf * BR * LD4 + (lr + h * RSTEP) * LD4 + lc / 4u;
        [[unroll]] for (uint i = 0u; i < 4u; i++) {
            ws[sb + i] = wr[h][i];
        }
    }
    [[unroll]] for (uint h = 0u; h < XCH; h++) {
        uint sb = buf * BT * LD4 + (lr + h * RSTEP) * LD4 + lc / 4u;
        [[unroll]] for (uint i = 0u; i < 4u; i++) {
            xs[sb + i] = xr[h][i];
        }
    }
}

#define MI (SGR / 16u)
#define NJ (SGT / 16u)

void main() {
    uint tile = gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x;
    r0 = tile * BR;
    if (r0 >= p.rows) {
        return;  // the whole work group
    }
    t0 = gl_WorkGroupID.z * BT;
    uint lid = gl_LocalInvocationID.x;
    uint sg = lid >> 5, lane = lid & 31u;   // subgroups of 32 (required at pipeline creation, or the device's)
    uint sr = (sg % (BR / SGR)) * SGR;   // this subgroup's rows sr .. sr+SGR-1 of the tile
    uint sn = (sg / (BR / SGR)) * SGT;   // and tokens sn .. sn+SGT-1
    CM_C acc[MI][NJ];
    [[unroll]] for (uint i = 0u; i < MI; i++) {
        [[unroll]] for (uint j = 0u; j < NJ; j++) {
            acc[i][j] = CM_C(0.0);
        }
    }
    lr = lid / CPR;
    lc = (lid % CPR) * 16u;
    f16vec4 wr[WCH][4], xr[XCH][4];
    fetch(0u, wr, xr);
#if CM_DB
    put(0u, wr, xr);
    barrier();
#endif
    uint buf = 0u;
    for (uint k0 = 0u; k0 < p.cols; k0 += BK) {
#if !CM_DB
        put(0u, wr, xr);
        barrier();
#endif
        bool more = k0 + BK < p.cols;
        if (more) {
            fetch(k0 + BK, wr, xr);
        }
        uint wb = buf * BR * LD4, xb = buf * BT * LD4;
        [[unroll]] for (uint kk = 0u; kk < BK / 4u; kk += 4u) {   // 16 columns = 4 f16vec4s a step
            CM_A a[MI];
            [[unroll]] for (uint i = 0u; i < MI; i++) {
                coopMatLoad(a[i], ws, wb + (sr + 16u * i) * LD4 + kk, LD4, gl_CooperativeMatrixLayoutRowMajor);
            }
            [[unroll]] for (uint j = 0u; j < NJ; j++) {
                CM_B b;
                coopMatLoad(b, xs, xb + (sn + 16u * j) * LD4 + kk, LD4, gl_CooperativeMatrixLayoutColumnMajor);
                [[unroll]] for (uint i = 0u; i < MI; i++) {
                    acc[i][j] = coopMatMulAdd(a[i], b, acc[i][j]);
                }
            }
        }
#if CM_DB
        if (more) {
            buf ^= 1u;
            put(buf, wr, xr);   // the other buffer: its last readers passed the barrier below a step ago
        }
#endif
        barrier();
    }
    uint base = sg * 256u;
    [[unroll]] for (uint i = 0u; i < MI; i++) {
        [[unroll]] for (uint j = 0u; j < NJ; j++) {
            coopMatStore(acc[i][j], st, base, 16u, gl_CooperativeMatrixLayoutColumnMajor);
            subgroupMemoryBarrierShared();
            subgroupBarrier();
            uint rr = r0 + sr + 16u * i, tt = t0 + sn + 16u * j;
            [[unroll]] for (uint m = 0u; m < 8u; m++) {
                uint e = lane + 32u * m;
                uint r = rr + (e & 15u), t = tt + (e >> 4);
                if (r < p.rows && t < p.n_tokens) {
                    y[p.y_off + t * p.y_stride + r] = st[base + e];
                }
            }
            subgroupBarrier();   // st is rewritten by the next store
        }
    }
}
