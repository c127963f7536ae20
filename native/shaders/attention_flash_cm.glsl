// Causal flash attention of a chunk of queries (prefill) over the f16 KV cache,
// with GQA, on the tensor cores: KHR cooperative matrices (16 x 16 x 16, f16
// inputs, f32 accumulators).  Included by attention_flash_cm_d<D>.comp, which
// enables the extensions (GL_KHR_cooperative_matrix there is also what makes
// vramd/gpu/kernels.py compile it with glslang) and defines HD, the head size.
//
// The contract of attention_flash.comp (bindings 0-4, push constants, grid, the
// causal / window / softcap semantics) plus attention.comp's sinks (binding 5,
// has_sink / sink_off: gpt-oss's logit per head in each softmax's denominator,
// here the online softmax's starting state: max = sink, sum = 1, O = 0): a work group per
// (KV head, tile of BR = 64 query rows), a row being a (token, q head of this
// KV group) pair, rows i0 .. i0 + 63 of the pairs t * G + g, so the G q heads
// of a KV head and the tile's tokens share every K/V tile (the M dimension of
// both products).  4 subgroups of 32 lanes (required at pipeline creation,
// as for matmul_cm), each owning 16 rows:
//   - the Q tile (scaled, f16) goes through shared memory once, then each
//     subgroup keeps its 16 x HD rows as HD/16 A matrices in registers;
//   - keys BC = 32 at a time: the K tile (rows 0 .. 31 of kvs) and the V tile
//     (rows 32 .. 63) in f16 as the cache holds them, over the Q tile's space;
//   - S = Q K^T: BC/16 accumulators per subgroup, stored to shared (st) as f32;
//   - mask (causal/window per row), softcap, online softmax per row: two lanes
//     a row (16 keys each, combined by a shuffle), P written as f16 (ps), the
//     row's correction exp(m_old - m_new) to shared (cs); the row's reference
//     max moves only when a score passes it by more than 8 (exact either way:
//     P <= e^8 fits f16), so that the rescale below is rare;
//   - O (HD/16 accumulators, registers) rescaled per row through a 16 x 16
//     staging area (st) where a correction is not 1 (a row's max moved), then
//     O += P V.
// The key span of a work group is the union of its rows' spans, as in
// attention_flash.comp.  Out-of-span keys are zeros in the tiles (0 * garbage
// could be NaN) and masked; rows past the last pair see no key and are not written.
//
// Shared memory (f16vec4 rows padded by CM_PAD): kvs 64 x (HD/4 + 2) f16vec4,
// st 4 x 16 x 36 f32, ps 4 x 16 x (32/4 + 2) f16vec4, cs/ls 2 x 64 f32:
// HD 64: 20.5 KiB, 128: 29.5 KiB, 256: 47.5 KiB (H200: 48).
layout(local_size_x = 128) in;
#define BR 64u
#define BC 32u
#define NSG 4u
#define NDF (uint(HD) / 16u)      // 16-wide fragments of a head
#define LD4 (uint(HD) / 4u + 2u)  // f16vec4s per K/V/Q tile row: 16-byte aligned, rows in other banks
#define SLD (BC + 4u)             // floats per S row (f32 staging)
#define PLD4 (BC / 4u + 2u)       // f16vec4s per P row
#define SSG (16u * SLD)           // floats of st per subgroup (>= 256: also O's staging)
#define PSG (16u * PLD4)

layout(std430, set = 0, binding = 0) readonly buffer Q { float q[]; };
layout(std430, set = 0, binding = 1) readonly buffer KCache { uint kc[]; };
layout(std430, set = 0, binding = 2) readonly buffer VCache { uint vc[]; };
layout(std430, set = 0, binding = 3) readonly buffer Pos { int pos[]; };
layout(std430, set = 0, binding = 4) buffer Out { float o[]; };
layout(std430, set = 0, binding = 5) readonly buffer Sinks { float sinks[]; };

layout(push_constant) uniform Params {
    uint n_tokens;
    uint n_heads;
    uint n_kv_heads;
    uint head_dim;    // == HD (Ops.attention picks the variant)
    uint q_off;       // float offset of q[0, 0, 0] in binding 0
    uint q_stride;    // floats from token t to t + 1
    uint k_off;       // word offset of K[0, 0] in binding 1
    uint v_off;       // word offset of V[0, 0] in binding 2
    uint kv_stride;   // words from cache row j to j + 1 (both caches)
    uint pos_off;     // int offset of pos[0] in binding 3
    uint o_off;       // float offset of out[0, 0] in binding 4
    uint o_stride;    // floats from token t to t + 1
    uint ctx;         // cache rows: keys at or beyond are never read
    uint window;      // 0: full causal; else a sliding window of that many keys
    float scale;
    float softcap;    // > 0: each score s becomes softcap * tanh(s / softcap) (tanh as softcap.comp writes it)
    uint has_sink;    // 1: binding 5 holds a sink logit per head (from sink_off); 0: no sinks (binding 5 unread)
    uint sink_off;
} p;

const float NEG = -1.0e30;  // finite: exp(NEG - m) is 0 without inf arithmetic
const float LAZY = 8.0;     // see the softmax below

#define CM_A coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA>
#define CM_B coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB>
#define CM_C coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>

shared f16vec4 kvs[BR * LD4];    // the Q tile first; then K (rows 0 .. BC-1) and V (rows BC .. 2BC-1)
shared float st[NSG * SSG];      // per subgroup: its 16 x BC scores, or a 16 x 16 O staging
shared f16vec4 ps[NSG * PSG];    // per subgroup: its 16 x BC probabilities
shared float cs[BR];             // per row: this step's correction of O
shared float ls[BR];             // per row: the softmax's denominator, at the end

// The keys query t sees: [first, end).
void span_of(uint t, out uint first, out uint end) {
    int qp = pos[p.pos_off + t];
    end = uint(clamp(qp + 1, 0, int(p.ctx)));
    first = (p.window > 0u && end > p.window) ? end - p.window : 0u;
}

void main() {
    uint kvh = gl_WorkGroupID.x;
    uint tid = gl_LocalInvocationID.x;
    uint sg = tid >> 5, lane = tid & 31u;
    uint G = p.n_heads / p.n_kv_heads;
    uint n_pairs = p.n_tokens * G;
    uint i0 = gl_WorkGroupID.y * BR;
    const uint hw = uint(HD) / 2u;   // words of a head
    const uint h4 = uint(HD) / 4u;   // f16vec4s of a head

    // This lane's row of the softmax: row sg*16 + rr, keys half*16 .. half*16 + 15 of a step.
    uint rr = lane & 15u, half_ = lane >> 4;
    uint row = sg * 16u + rr;
    uint pi = i0 + row;
    uint row_first = 0u, row_end = 0u;
    float m = NEG, l = 0.0;
    if (pi < n_pairs) {
        span_of(pi / G, row_first, row_end);
        if (p.has_sink != 0u) {
            m = sinks[p.sink_off + kvh * G + pi % G];   // a key of value 0 seen first
            l = 1.0;
        }
    }
    // The work group's key span: the union of its tokens' (the same in every thread).
    uint lo = p.ctx, hi = 0u;
    uint t_last = (min(i0 + BR, n_pairs) - 1u) / G;
    for (uint tt = i0 / G; tt <= t_last; tt++) {
        uint f, e;
        span_of(tt, f, e);
        if (e > f) {
            lo = min(lo, f);
            hi = max(hi, e);
        }
    }

    // The Q tile, scaled, as f16; rows past the last pair are zeros.
    for (uint i = tid; i < BR * h4; i += 128u) {
        uint r = i / h4, c = i % h4;
        uint pr = i0 + r;
        vec4 v = vec4(0.0);
        if (pr < n_pairs) {
            uint qb = p.q_off + (pr / G) * p.q_stride + (kvh * G + pr % G) * uint(HD) + 4u * c;
            v = vec4(q[qb], q[qb + 1u], q[qb + 2u], q[qb + 3u]) * p.scale;
        }
        kvs[r * LD4 + c] = f16vec4(v);
    }
    barrier();
    CM_A qa[NDF];
    [[unroll]] for (uint d = 0u; d < NDF; d++) {
        coopMatLoad(qa[d], kvs, (sg * 16u) * LD4 + 4u * d, LD4, gl_CooperativeMatrixLayoutRowMajor);
    }
    CM_C acc[NDF];
    [[unroll]] for (uint d = 0u; d < NDF; d++) {
        acc[d] = CM_C(0.0);
    }
    barrier();  // every subgroup has its Q rows before K/V overwrite them

    uint head_w = kvh * hw;  // word offset of this KV head in a cache row
    uint sb = sg * SSG, pb = sg * PSG;
    for (uint k0 = lo; k0 < hi; k0 += BC) {
        uint cnt = min(BC, hi - k0);
        // K rows 0 .. BC-1, V rows BC .. 2BC-1: two cache words an f16vec4
        for (uint i = tid; i < 2u * BC * h4; i += 128u) {
            uint r = i / h4, c = i % h4;
            uint jj = r % BC;
            f16vec4 v = f16vec4(0.0);
            if (jj < cnt) {
                uint wb = (k0 + jj) * p.kv_stride + head_w + 2u * c;
                uvec2 w2 = r < BC ? uvec2(kc[p.k_off + wb], kc[p.k_off + wb + 1u])
                                  : uvec2(vc[p.v_off + wb], vc[p.v_off + wb + 1u]);
                v = f16vec4(unpackFloat2x16(w2.x), unpackFloat2x16(w2.y));
            }
            kvs[r * LD4 + c] = v;
        }
        barrier();  // K/V tiles published

        // S = Q K^T for this subgroup's 16 rows: K as B (d x key), column-major in kvs.
        [[unroll]] for (uint j = 0u; j < BC / 16u; j++) {
            CM_C s = CM_C(0.0);
            [[unroll]] for (uint d = 0u; d < NDF; d++) {
                CM_B kb;
                coopMatLoad(kb, kvs, (16u * j) * LD4 + 4u * d, LD4, gl_CooperativeMatrixLayoutColumnMajor);
                s = coopMatMulAdd(qa[d], kb, s);
            }
            coopMatStore(s, st, sb + 16u * j, SLD, gl_CooperativeMatrixLayoutRowMajor);
        }
        subgroupMemoryBarrierShared();
        subgroupBarrier();

        // Mask, softcap, online softmax: this lane's 16 keys of its row, the pair of lanes combined.
        float sv[16];
        float mt = NEG;
        [[unroll]] for (uint c = 0u; c < 16u; c++) {
            uint cc = half_ * 16u + c;
            float d = st[sb + rr * SLD + cc];
            float s = p.softcap > 0.0 ? p.softcap * (1.0 - 2.0 / (exp(2.0 * d / p.softcap) + 1.0)) : d;
            uint j = k0 + cc;
            s = (j >= row_first && j < row_end) ? s : NEG;
            sv[c] = s;
            mt = max(mt, s);
        }
        mt = max(mt, subgroupShuffleXor(mt, 16u));
        // The reference max moves only when a score passes it by more than LAZY: the
        // probabilities stay <= e^LAZY (f16 holds them) and O's rescale is rarely needed.
        mt = mt > m + LAZY ? mt : m;
        float lt = 0.0;
        [[unroll]] for (uint c = 0u; c < 16u; c += 4u) {
            vec4 e;
            [[unroll]] for (uint k = 0u; k < 4u; k++) {
                // A masked key is 0 even where the row has seen no key yet (mt = NEG).
                e[k] = sv[c + k] > 0.5 * NEG ? exp(sv[c + k] - mt) : 0.0;
            }
            lt += e.x + e.y + e.z + e.w;
            ps[pb + rr * PLD4 + (half_ * 16u + c) / 4u] = f16vec4(e);
        }
        lt += subgroupShuffleXor(lt, 16u);
        float corr = exp(m - mt);  // 0 once the first real key arrives (m = NEG); 1 while none has
        l = l * corr + lt;
        m = mt;
        if (half_ == 0u) {
            cs[row] = corr;
        }
        subgroupMemoryBarrierShared();
        subgroupBarrier();  // P and the corrections published; S read (st free for O's staging)

        // O *= corr per row, through the 16 x 16 staging area, where some row's max moved.
        if (!subgroupAll(corr == 1.0)) {
            [[unroll]] for (uint d = 0u; d < NDF; d++) {
                coopMatStore(acc[d], st, sb, 16u, gl_CooperativeMatrixLayoutRowMajor);
                subgroupMemoryBarrierShared();
                subgroupBarrier();
                [[unroll]] for (uint e = lane; e < 256u; e += 32u) {
                    st[sb + e] *= cs[sg * 16u + (e >> 4)];
                }
                subgroupMemoryBarrierShared();
                subgroupBarrier();
                coopMatLoad(acc[d], st, sb, 16u, gl_CooperativeMatrixLayoutRowMajor);
                subgroupBarrier();  // loaded before the next fragment's store
            }
        }

        // O += P V: P as A (row x key), V as B (key x d), row-major in kvs.
        CM_A pa[BC / 16u];
        [[unroll]] for (uint kk = 0u; kk < BC / 16u; kk++) {
            coopMatLoad(pa[kk], ps, pb + 4u * kk, PLD4, gl_CooperativeMatrixLayoutRowMajor);
        }
        [[unroll]] for (uint d = 0u; d < NDF; d++) {
            [[unroll]] for (uint kk = 0u; kk < BC / 16u; kk++) {
                CM_B vb;
                coopMatLoad(vb, kvs, (BC + 16u * kk) * LD4 + 4u * d, LD4, gl_CooperativeMatrixLayoutRowMajor);
                acc[d] = coopMatMulAdd(pa[kk], vb, acc[d]);
            }
        }
        barrier();  // every subgroup is done with the K/V tiles (and its P, st) before the next step
    }

    // out = O / l per row, through the staging area; rows past the last pair are not written.
    if (half_ == 0u) {
        ls[row] = l;
    }
    subgroupMemoryBarrierShared();
    subgroupBarrier();
    [[unroll]] for (uint d = 0u; d < NDF; d++) {
        coopMatStore(acc[d], st, sb, 16u, gl_CooperativeMatrixLayoutRowMajor);
        subgroupMemoryBarrierShared();
        subgroupBarrier();
        [[unroll]] for (uint e = lane; e < 256u; e += 32u) {
            uint r = sg * 16u + (e >> 4), pr = i0 + r;
            if (pr < n_pairs) {
                float lr = ls[r];
                uint ob = p.o_off + (pr / G) * p.o_stride + (kvh * G + pr % G) * uint(HD) + 16u * d + (e & 15u);
                o[ob] = lr > 0.0 ? st[sb + e] / lr : 0.0;
            }
        }
        subgroupBarrier();  // read before the next fragment's store
    }
}
