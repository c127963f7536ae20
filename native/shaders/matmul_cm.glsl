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
// (dq_fetch/dq_decode below: 16 consecutive elements of a row at once, read as uint32
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
//   CM_LATE         1: the next step's weights kept as raw words and decoded after the multiplies
//   CM_F16ACC       1: f16 accumulators (0: f32)
#ifndef CM_BR
#define CM_BR 128
#define CM_BT 128
#define CM_BK 64
#define CM_SGR 32
#define CM_SGT 64
#define CM_NT 256
#define CM_PAD 2
#define CM_DB 0
#define CM_F16ACC 0
#endif
#ifndef CM_LATE   // per type, as measured on the H200 (docs/benchmarks.md, issue 15 sweep)
#if defined(TYPE_F16) || defined(TYPE_BF16) || defined(TYPE_Q8_0) || defined(TYPE_Q4_0)
#define CM_LATE 1   // F16 and Q8_0: 9-11 % less time a layer than decoding at once
#else
#define CM_LATE 0   // MXFP4: 3-7 % more time late; K-quants, Q4_1, Q5_x: decoded in fetch (DQ_EAGER) anyway
#endif
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

// A 16-element chunk of a weight row in two halves, so that its global loads can be in
// flight while the tensor cores work (CM_LATE): dq_fetch(rowb, c0, r) only loads the
// words the chunk needs into r (elements c0 .. c0 + 15 of the row at byte rowb, c0 a
// multiple of 16, all within the row; sixteen elements never cross a block, nor a
// scale's sub-block), dq_decode(rowb, c0, r, o) turns them into f16 values (address
// arithmetic again, no memory).  The K-quants and the types decoded element by element
// (Q4_1, Q5_0, Q5_1: DQ_EAGER) decode in dq_fetch into eight packed f16 words.  Every r index is a
// constant after unrolling (a dynamically indexed private array would go to memory).
uint wl(uint i) { return w[min(i, uint(w.length()) - 1u)]; }   // (the last chunk's extra word)
uint fun(uint lo, uint hi, uint a) {   // the 32 bits at byte a (mod 4) of the pair lo, hi
    uint s = (a & 3u) << 3;
    return s == 0u ? lo : (lo >> s) | (hi << (32u - s));
}
uint byte_at(uint word, uint a) { return (word >> ((a & 3u) << 3)) & 255u; }
float half_at(uint word, uint a) { return unpackHalf2x16(word >> ((a & 2u) << 3)).x; }
// r[o .. o + 4] = the five words that cover the 16 bytes at byte a, whatever a mod 4.
#define LOAD5(r, o, a) { uint i_ = (a) >> 2; [[unroll]] for (uint k_ = 0u; k_ < 5u; k_++) { r[(o) + k_] = wl(i_ + k_); } }
#define WORD5(r, o, a, k) fun(r[(o) + (k)], r[(o) + (k) + 1u], (a))   // 32-bit word k of those 16 bytes

#if defined(TYPE_F16) || defined(TYPE_BF16)
#define RAWN 9u   // 32 bytes at an even offset
void dq_fetch(uint rowb, uint c0, out uint r[RAWN]) {
    uint i = (rowb + 2u * c0) >> 2;
    [[unroll]] for (uint k = 0u; k < RAWN; k++) {
        r[k] = wl(i + k);
    }
}
void dq_decode(uint rowb, uint c0, uint r[RAWN], out f16vec4 o[4]) {
    uint a = rowb + 2u * c0;
    [[unroll]] for (uint i = 0u; i < 4u; i++) {
        uint lo = fun(r[2u * i], r[2u * i + 1u], a), hi = fun(r[2u * i + 1u], r[2u * i + 2u], a);
#if defined(TYPE_F16)
        o[i] = f16vec4(unpackFloat2x16(lo), unpackFloat2x16(hi));
#else
        o[i] = f16vec4(vec4(uintBitsToFloat(lo << 16), uintBitsToFloat(lo & 0xFFFF0000u),
                            uintBitsToFloat(hi << 16), uintBitsToFloat(hi & 0xFFFF0000u)));
#endif
    }
}
#elif defined(TYPE_Q8_0) || defined(TYPE_Q4_0)
#define RAWN 8u   // the scale's word, five quant words (and room for an edge chunk's eight)
#if defined(TYPE_Q8_0)
#define QBB 34u
#define QOFF(c0) (2u + ((c0) & 16u))
#else
#define QBB 18u
#define QOFF(c0) 2u
#endif
void dq_fetch(uint rowb, uint c0, out uint r[RAWN]) {
    uint b = rowb + (c0 >> 5) * QBB;
    r[0] = wl(b >> 2);
    LOAD5(r, 1u, b + QOFF(c0));
    r[6] = 0u;
    r[7] = 0u;
}
void dq_decode(uint rowb, uint c0, uint r[RAWN], out f16vec4 o[4]) {
    uint b = rowb + (c0 >> 5) * QBB, qa = b + QOFF(c0);
    float d = half_at(r[0], b);
#if defined(TYPE_Q4_0)
    uint sh = (c0 & 16u) >> 2;   // elements 16..31: the high nibbles
#endif
    [[unroll]] for (uint i = 0u; i < 4u; i++) {
#if defined(TYPE_Q8_0)
        int q = int(WORD5(r, 1u, qa, i));
        o[i] = f16vec4(d * vec4(bitfieldExtract(q, 0, 8), bitfieldExtract(q, 8, 8), bitfieldExtract(q, 16, 8),
                                bitfieldExtract(q, 24, 8)));
#else
        uint q = WORD5(r, 1u, qa, i) >> sh;
        o[i] = f16vec4(d * (vec4(q & 15u, (q >> 8) & 15u, (q >> 16) & 15u, (q >> 24) & 15u) - 8.0));
#endif
    }
}
#elif defined(TYPE_MXFP4)
#define RAWN 8u   // the scale byte's word, the five words covering the 16 quant bytes (any offset)
void dq_fetch(uint rowb, uint c0, out uint r[RAWN]) {
    uint b = rowb + (c0 >> 5) * 17u;
    r[0] = wl(b >> 2);
    LOAD5(r, 1u, b + 1u);
    r[6] = 0u;
    r[7] = 0u;
}
void dq_decode(uint rowb, uint c0, uint r[RAWN], out f16vec4 o[4]) {
    uint b = rowb + (c0 >> 5) * 17u;
    float d = mxfp4_scale(byte_at(r[0], b));
    uint sh = (c0 & 16u) >> 2;   // elements 16..31 of the block: the high nibbles
    [[unroll]] for (uint i = 0u; i < 4u; i++) {
        uint q = WORD5(r, 1u, b + 1u, i) >> sh;
        o[i] = f16vec4(d * vec4(MXFP4_KV[q & 15u], MXFP4_KV[(q >> 8) & 15u], MXFP4_KV[(q >> 16) & 15u],
                                MXFP4_KV[(q >> 24) & 15u]));
    }
}
#elif defined(TYPE_Q4_K) || defined(TYPE_Q5_K) || defined(TYPE_Q6_K)
// K-quants: 16 elements decoded at once from uint32 words (the scales once), packed into
// eight f16 words (DQ_EAGER).  Their raw-word form (a scale word each, five-word funnels)
// measured 9-18 % slower on the H200 (docs/benchmarks.md, issue 15 sweep).
#define RAWN 8u
#define DQ_EAGER
#if defined(TYPE_Q4_K) || defined(TYPE_Q5_K)
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
#else   // Q6_K
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
#endif
void dq_fetch(uint rowb, uint c0, out uint r[RAWN]) {
    f16vec4 o[4];
    dq16(rowb, c0, o);
    [[unroll]] for (uint i = 0u; i < 4u; i++) {
        r[2u * i] = packFloat2x16(o[i].xy);
        r[2u * i + 1u] = packFloat2x16(o[i].zw);
    }
}
void dq_decode(uint rowb, uint c0, uint r[RAWN], out f16vec4 o[4]) {
    [[unroll]] for (uint i = 0u; i < 4u; i++) {
        o[i] = f16vec4(unpackFloat2x16(r[2u * i]), unpackFloat2x16(r[2u * i + 1u]));
    }
}
#else   // Q4_1, Q5_0, Q5_1: element by element, decoded at once
#define RAWN 8u
#define DQ_EAGER
void dq_fetch(uint rowb, uint c0, out uint r[RAWN]) {
    [[unroll]] for (uint i = 0u; i < 8u; i++) {
        uint c = c0 + 2u * i;
        r[i] = packHalf2x16(vec2(elem(rowb, c), elem(rowb, c + 1u)));
    }
}
void dq_decode(uint rowb, uint c0, uint r[RAWN], out f16vec4 o[4]) {
    [[unroll]] for (uint i = 0u; i < 4u; i++) {
        o[i] = f16vec4(unpackFloat2x16(r[2u * i]), unpackFloat2x16(r[2u * i + 1u]));
    }
}
#endif

#define CM_A coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA>
#define CM_B coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB>
#define CM_C32 coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>
#if CM_F16ACC
#define CM_C coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>
#else
#define CM_C CM_C32
#endif

shared f16vec4 ws[NB * BR * LD4];   // W tile(s), row-major: element (r, k) in ws[r * LD4 + k / 4]
shared f16vec4 xs[NB * BT * LD4];   // X tile(s), a token per row (B, column-major)
shared float st[NSG * 256u];        // per subgroup: one 16 x 16 result, st[t * 16 + r]

// This thread's chunks of the loads: chunk h of W is tile row lr + h * RSTEP, columns
// lc .. lc + 15 (of X likewise); consecutive threads read consecutive chunks of a row.
uint lr, lc, r0, t0;

// The next step's tiles in registers, so that the global loads of step k + 1 are in
// flight while the tensor cores work on step k.  CM_LATE 0: decoded to f16 in fetch
// (each decode waits for its loads before the tensor cores start); 1: fetch keeps the
// raw words (wraw: dq_fetch's; wpk: bit h set where chunk h is eight packed f16 words
// instead, an edge chunk; xraw: x as f32) and put decodes them, after the multiplies.
uint fk0;   // the columns' start of what fetch holds
#if CM_LATE
uint wraw[WCH][RAWN];
uint wpk;
vec4 xraw[XCH][4];
#else
f16vec4 wr[WCH][4], xr[XCH][4];
#endif

void fetch(uint k0) {
    fk0 = k0;
    uint c0 = k0 + lc;
#if CM_LATE
    wpk = 0u;
#endif
    [[unroll]] for (uint h = 0u; h < WCH; h++) {
        uint r = r0 + lr + h * RSTEP;
        bool wrow = r < p.rows;
        uint wrowb = p.w_off + r * ROW_BYTES(p.cols);
        if (wrow && c0 + 16u <= p.cols) {
            uint raw[RAWN];
            dq_fetch(wrowb, c0, raw);
#if CM_LATE && !defined(DQ_EAGER)
            wraw[h] = raw;
#elif CM_LATE
            wraw[h] = raw;
            wpk |= 1u << h;
#else
            dq_decode(wrowb, c0, raw, wr[h]);
#endif
        } else {   // past the last row, or the ragged end of an f16/bf16 row
            [[unroll]] for (uint i = 0u; i < 4u; i++) {
                vec4 v = vec4(0.0);
                [[unroll]] for (uint e = 0u; e < 4u; e++) {
                    if (wrow && c0 + 4u * i + e < p.cols) {
                        v[e] = elem(wrowb, c0 + 4u * i + e);
                    }
                }
#if CM_LATE
                wraw[h][2u * i] = packHalf2x16(v.xy);
                wraw[h][2u * i + 1u] = packHalf2x16(v.zw);
#else
                wr[h][i] = f16vec4(v);
#endif
            }
#if CM_LATE
            wpk |= 1u << h;
#endif
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
#if CM_LATE
            xraw[h][i] = v;
#else
            xr[h][i] = f16vec4(v);
#endif
        }
    }
}

void put(uint buf) {
    [[unroll]] for (uint h = 0u; h < WCH; h++) {
        uint sb = buf * BR * LD4 + (lr + h * RSTEP) * LD4 + lc / 4u;
#if CM_LATE
        f16vec4 o[4];
        if ((wpk & (1u << h)) != 0u) {
            [[unroll]] for (uint i = 0u; i < 4u; i++) {
                o[i] = f16vec4(unpackFloat2x16(wraw[h][2u * i]), unpackFloat2x16(wraw[h][2u * i + 1u]));
            }
        } else {
            uint r = r0 + lr + h * RSTEP;
            dq_decode(p.w_off + r * ROW_BYTES(p.cols), fk0 + lc, wraw[h], o);
        }
#else
        f16vec4 o[4] = wr[h];
#endif
        [[unroll]] for (uint i = 0u; i < 4u; i++) {
            ws[sb + i] = o[i];
        }
    }
    [[unroll]] for (uint h = 0u; h < XCH; h++) {
        uint sb = buf * BT * LD4 + (lr + h * RSTEP) * LD4 + lc / 4u;
        [[unroll]] for (uint i = 0u; i < 4u; i++) {
#if CM_LATE
            xs[sb + i] = f16vec4(xraw[h][i]);
#else
            xs[sb + i] = xr[h][i];
#endif
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
    fetch(0u);
#if CM_DB
    put(0u);
    barrier();
#endif
    uint buf = 0u;
    for (uint k0 = 0u; k0 < p.cols; k0 += BK) {
#if !CM_DB
        put(0u);
        barrier();
#endif
        bool more = k0 + BK < p.cols;
        if (more) {
            fetch(k0 + BK);
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
            put(buf);   // the other buffer: its last readers passed the barrier below a step ago
        }
#endif
        barrier();
    }
    uint base = sg * 256u;
    [[unroll]] for (uint i = 0u; i < MI; i++) {
        [[unroll]] for (uint j = 0u; j < NJ; j++) {
            coopMatStore(CM_C32(acc[i][j]), st, base, 16u, gl_CooperativeMatrixLayoutColumnMajor);
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
