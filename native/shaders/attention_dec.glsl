// Decode attention, part 1 of 2, the long-context form (Ops._attention_split,
// the default; VRAMD_DECODE_ATTN=old takes attention_split.comp instead): one work group
// per (KV head, block of up to MAXG of its q heads, key range, token).  It
// writes the same partial softmax states as attention_split.comp, at the same
// place (q head h, range s: part[((t * n_heads + h) * n_splits + s) *
// (head_dim + 2) ..] = m, l, acc[0 .. head_dim-1]), so attention_merge.comp
// combines them; same push constants, bindings, range rule (the present keys
// first .. pos[t] cut from the position into n_splits ranges of at most
// `chunk`: a step is recorded once for every position), window, softcap and
// sequence ids (seq_rows > 0: token t reads rows seq[t] * seq_rows on).
//
// Why: decode at 8,000 keys fell to 0.85x llama.cpp (8B) and 0.64x
// (gpt-oss-20b) on the H200 (2026-12-02).  As attention_split.comp reads (not
// profiled), its groups walk their range in tiles of 32 keys with about six
// dependent memory trips and four barriers a tile (K slices of 4-byte words,
// a shared-memory score reduction, V one 4-byte word per thread with half the
// threads idle at head_dim 128), so a group's time is latency, linear in its
// keys; gpt-oss's 64 q heads leave it 16 ranges of 500 keys at 8,000.  llama.cpp's Vulkan
// flash-attention decode (flash_attn.comp, its keys split over work groups:
// split_k) reads K/V rows as 4-half vectors (f16vec4), D_split threads a key,
// and lets the q heads of a KV group share each row read (the group's heads
// are the rows of its Q tile, kept in shared memory).  Here:
//   - a key lane is LPK = 8 neighbouring invocations of one subgroup, each
//     holding NC 16-byte pieces (uvec4, 8 halves) of a row: piece c * 8 + r
//     for lane invocation r, so the lane's eight loads of a piece are 128
//     contiguous bytes; the WG / LPK = 16 lanes of a group take keys
//     base + u * 16 + lane, u < UL;
//   - every K and V row of the batch (UL * NC pieces of each) is loaded
//     before any is used: one memory trip per UL * 16 keys;
//   - the score of a (key, q head) is summed over the lane's 8 invocations
//     by three subgroupShuffleXor steps (no shared memory, no barrier), and
//     each lane keeps its own online softmax (m, l, acc) for its keys and the
//     block's q heads, the q slices in registers (scaled once);
//   - the 16 lanes' states are combined once at the end (their maxima and
//     sums through shared memory, acc by a tree of 4 halving steps).
// The loop's trip count is the group's (uniform), keys past the range are
// clamped loads with their terms dropped, so every shuffle and barrier is in
// uniform control flow.  The lane's invocations come from gl_SubgroupID and
// gl_SubgroupInvocationID (any subgroup size >= 8 and a power of two:
// NVIDIA 32, lavapipe 8).  Requires head_dim % 8 == 0 and <= 64 * NC, the
// K/V offsets and row stride multiples of 4 words (Ops checks; else
// attention_split.comp).
//
// A range holds a trip of keys at least, so while the context is short only
// the first groups have keys (the rest write empty partials and exit).
// Each token's numbers depend on its own position, ctx, window and n_splits
// only (Ops sizes n_splits by the keys, not the tokens), so a token's decode
// gives the same bits whatever shares the step.
// Measured so far on lavapipe (scripts/decode_attn_ab.py: 2-7x the old
// form's speed, docs/benchmarks.md); the H200 A/B is native/dattn_h200.sh.
//
// The variant files set NC (pieces a thread per row: head_dim <= 64 NC),
// MAXG (q heads a group) and UL (keys a lane per trip), NC * MAXG = 8 and
// NC * UL = 4 (the registers: q and acc 64 floats each, 32 words in flight);
// the _qs variants also QSH: the q slices in shared memory, read each trip
// (VRAMD_DEC_Q=shared, for an A/B against the registers' occupancy).
#extension GL_EXT_control_flow_attributes : enable
#extension GL_KHR_shader_subgroup_basic : enable
#extension GL_KHR_shader_subgroup_shuffle : enable
layout(local_size_x = 128) in;
#define WG 128u
#define LPK 8u          // invocations a key lane
#define KL 16u          // WG / LPK: key lanes a group
#define HALF 64u        // WG / 2: the tree's first step
#define NV (2u * NC)    // vec4 of q / acc a thread per head

layout(std430, set = 0, binding = 0) readonly buffer Q { float q[]; };
layout(std430, set = 0, binding = 1) readonly buffer KCache { uvec4 kc[]; };
layout(std430, set = 0, binding = 2) readonly buffer VCache { uvec4 vc[]; };
layout(std430, set = 0, binding = 3) readonly buffer Pos { int pos[]; };
layout(std430, set = 0, binding = 4) buffer Part { float part[]; };

layout(push_constant) uniform Params {
    uint n_heads;
    uint n_kv_heads;
    uint head_dim;    // % 8 == 0, <= 64 * NC
    uint q_off;       // float offset of q[0, 0] in binding 0
    uint k_off;       // word offset of K[0, 0] in binding 1 (a multiple of 4)
    uint v_off;       // word offset of V[0, 0] in binding 2 (a multiple of 4)
    uint kv_stride;   // words from cache row j to j + 1 (a multiple of 4)
    uint pos_off;     // int offset of pos[0] in binding 3
    uint part_off;    // float offset of the partials in binding 4
    uint ctx;
    uint window;      // 0: full causal
    uint chunk;       // keys per range at most (the full context's cut)
    uint n_splits;
    float scale;
    float softcap;    // > 0: each score s becomes softcap * tanh(s / softcap)
    uint q_stride;    // floats from token t's q row to t + 1's (work-group z)
    uint seq_off;     // int offset of seq[0] in binding 3 (read where seq_rows > 0)
    uint seq_rows;    // cache rows from one sequence to the next; 0: one sequence
} p;

const float NEG = -1.0e30;

shared float sm[MAXG * KL];             // each lane's max per head
shared float sl[MAXG * KL];             // each lane's sum per head (rescaled)
shared vec4 red[MAXG * NV * HALF];      // the tree's upper half of acc

#ifdef QSH   // the q slices in shared memory (the _qs variants: 64 registers fewer a thread)
shared vec4 qsh[MAXG * NV * LPK];
#define QV(g, i) qsh[((g) * NV + (i)) * LPK + r]
#else
#define QV(g, i) qr[g][i]
#endif

vec4 lo4(uvec4 w) { return vec4(unpackHalf2x16(w.x), unpackHalf2x16(w.y)); }
vec4 hi4(uvec4 w) { return vec4(unpackHalf2x16(w.z), unpackHalf2x16(w.w)); }

void main() {
    uint G = p.n_heads / p.n_kv_heads;
    uint nb = (G + MAXG - 1u) / MAXG;           // head blocks per KV head
    uint kvh = gl_WorkGroupID.x / nb;
    uint hs = kvh * G + (gl_WorkGroupID.x % nb) * MAXG;   // the block's first q head
    uint ng = min(MAXG, kvh * G + G - hs);       // its heads
    uint s = gl_WorkGroupID.y;
    uint t = gl_WorkGroupID.z;
    uint r = gl_SubgroupInvocationID % LPK;
    uint slot = gl_SubgroupID * gl_SubgroupSize + gl_SubgroupInvocationID;   // lane * LPK + r
    uint lane = slot / LPK;
    uint W4 = p.head_dim / 8u;                    // 16-byte pieces of a head's row
    int qp = pos[p.pos_off + t];
    uint row0 = p.seq_rows > 0u ? uint(pos[p.seq_off + t]) * p.seq_rows : 0u;
    uint n_keys = uint(clamp(qp + 1, 0, int(p.ctx)));
    uint first = (p.window > 0u && n_keys > p.window) ? n_keys - p.window : 0u;
    // A range holds a trip of keys at least (while the context is short, fewer groups
    // than n_splits have keys: the rest exit at once instead of each taking a trip for
    // a few keys); still min(chunk, ..) >= the even cut, so the ranges cover the keys.
    uint per = min(p.chunk, max(KL * UL, (n_keys - first + p.n_splits - 1u) / p.n_splits));
    uint lo = min(first + s * per, n_keys);
    uint hi = min(lo + per, n_keys);
    uint prow = p.head_dim + 2u;
    uint pb0 = p.part_off + ((t * p.n_heads + hs) * p.n_splits + s) * prow;   // head hs; + g * n_splits * prow
    if (lo >= hi) {  // an empty range (the whole group: no barrier waits)
        for (uint i = gl_LocalInvocationIndex; i < ng * prow; i += WG) {
            uint g = i / prow, e = i % prow;
            part[pb0 + g * p.n_splits * prow + e] = e == 0u ? NEG : 0.0;
        }
        return;
    }
#ifdef QSH
    if (lane == 0u) {   // lane 0 writes the pieces every lane reads (invocation r: its own)
#else
    vec4 qr[MAXG][NV];
    {
#endif
        [[unroll]] for (uint g = 0u; g < MAXG; g++) {
            [[unroll]] for (uint c = 0u; c < NC; c++) {
                uint w4 = c * LPK + r;
                bool ok = g < ng && w4 < W4;
                uint b = p.q_off + t * p.q_stride + (hs + min(g, ng - 1u)) * p.head_dim + 8u * min(w4, W4 - 1u);
                vec4 a = vec4(q[b], q[b + 1u], q[b + 2u], q[b + 3u]);
                vec4 z = vec4(q[b + 4u], q[b + 5u], q[b + 6u], q[b + 7u]);
                QV(g, 2u * c) = ok ? a * p.scale : vec4(0.0);        // zero: a piece past the head adds nothing
                QV(g, 2u * c + 1u) = ok ? z * p.scale : vec4(0.0);
            }
        }
    }
#ifdef QSH
    barrier();
#endif
    float m[MAXG], l[MAXG];
    vec4 acc[MAXG][NV];
    [[unroll]] for (uint g = 0u; g < MAXG; g++) {
        m[g] = NEG;
        l[g] = 0.0;
        [[unroll]] for (uint i = 0u; i < NV; i++) {
            acc[g][i] = vec4(0.0);
        }
    }
    uint st4 = p.kv_stride / 4u;
    uint kb = p.k_off / 4u + kvh * W4, vb = p.v_off / 4u + kvh * W4;
    for (uint base = lo; base < hi; base += KL * UL) {
        uvec4 kk[UL][NC], vv[UL][NC];
        [[unroll]] for (uint u = 0u; u < UL; u++) {
            uint row = (row0 + min(base + u * KL + lane, hi - 1u)) * st4;
            [[unroll]] for (uint c = 0u; c < NC; c++) {
                uint w4 = min(c * LPK + r, W4 - 1u);
                kk[u][c] = kc[kb + row + w4];
                vv[u][c] = vc[vb + row + w4];
            }
        }
        float sc[UL][MAXG];
        [[unroll]] for (uint u = 0u; u < UL; u++) {
            bool ok = base + u * KL + lane < hi;
            [[unroll]] for (uint g = 0u; g < MAXG; g++) {
                float d = 0.0;
                [[unroll]] for (uint c = 0u; c < NC; c++) {
                    d += dot(QV(g, 2u * c), lo4(kk[u][c])) + dot(QV(g, 2u * c + 1u), hi4(kk[u][c]));
                }
                d += subgroupShuffleXor(d, 1u);
                d += subgroupShuffleXor(d, 2u);
                d += subgroupShuffleXor(d, 4u);
                d = p.softcap > 0.0 ? p.softcap * (1.0 - 2.0 / (exp(2.0 * d / p.softcap) + 1.0)) : d;
                sc[u][g] = ok ? d : NEG;
            }
        }
        [[unroll]] for (uint g = 0u; g < MAXG; g++) {
            float mx = m[g];
            [[unroll]] for (uint u = 0u; u < UL; u++) {
                mx = max(mx, sc[u][g]);
            }
            float corr = exp(m[g] - mx);
            l[g] *= corr;
            [[unroll]] for (uint i = 0u; i < NV; i++) {
                acc[g][i] *= corr;
            }
            [[unroll]] for (uint u = 0u; u < UL; u++) {
                float pj = base + u * KL + lane < hi ? exp(sc[u][g] - mx) : 0.0;
                l[g] += pj;
                [[unroll]] for (uint c = 0u; c < NC; c++) {
                    acc[g][2u * c] += pj * lo4(vv[u][c]);
                    acc[g][2u * c + 1u] += pj * hi4(vv[u][c]);
                }
            }
            m[g] = mx;
        }
    }
    // The lanes' states: the group's max M per head, each lane's sum and acc
    // rescaled to it, then summed.
    if (r == 0u) {
        [[unroll]] for (uint g = 0u; g < MAXG; g++) {
            sm[g * KL + lane] = m[g];
        }
    }
    barrier();
    float M[MAXG];
    [[unroll]] for (uint g = 0u; g < MAXG; g++) {
        M[g] = NEG;
        for (uint i = 0u; i < KL; i++) {
            M[g] = max(M[g], sm[g * KL + i]);
        }
        float f = exp(m[g] - M[g]);
        l[g] *= f;
        [[unroll]] for (uint i = 0u; i < NV; i++) {
            acc[g][i] *= f;
        }
    }
    if (r == 0u) {
        [[unroll]] for (uint g = 0u; g < MAXG; g++) {
            sl[g * KL + lane] = l[g];
        }
    }
    [[unroll]] for (uint h = HALF; h >= LPK; h >>= 1) {
        if (slot >= h && slot < 2u * h) {
            [[unroll]] for (uint g = 0u; g < MAXG; g++) {
                [[unroll]] for (uint i = 0u; i < NV; i++) {
                    red[(g * NV + i) * HALF + slot - h] = acc[g][i];
                }
            }
        }
        barrier();
        if (slot < h) {
            [[unroll]] for (uint g = 0u; g < MAXG; g++) {
                [[unroll]] for (uint i = 0u; i < NV; i++) {
                    acc[g][i] += red[(g * NV + i) * HALF + slot];
                }
            }
        }
        barrier();
    }
    if (slot < LPK) {   // lane 0: the sums
        [[unroll]] for (uint g = 0u; g < MAXG; g++) {
            if (g < ng) {
                uint pb = pb0 + g * p.n_splits * prow;
                if (r == 0u) {
                    float L = 0.0;
                    for (uint i = 0u; i < KL; i++) {
                        L += sl[g * KL + i];
                    }
                    part[pb] = M[g];
                    part[pb + 1u] = L;
                }
                [[unroll]] for (uint c = 0u; c < NC; c++) {
                    uint w4 = c * LPK + r;
                    if (w4 < W4) {
                        uint o = pb + 2u + 8u * w4;
                        vec4 a = acc[g][2u * c], z = acc[g][2u * c + 1u];
                        part[o] = a.x; part[o + 1u] = a.y; part[o + 2u] = a.z; part[o + 3u] = a.w;
                        part[o + 4u] = z.x; part[o + 5u] = z.y; part[o + 6u] = z.z; part[o + 7u] = z.w;
                    }
                }
            }
        }
    }
}
