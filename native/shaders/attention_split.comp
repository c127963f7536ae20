// Decode attention, part 1 of 2 (split-K, "flash decoding"): one query
// token, its keys cut into n_splits ranges of `chunk` keys, one work group
// per (head, range), so that many work groups share the key reads instead
// of one per head (attention.comp), which leaves most of the GPU idle at
// batch 1.  Each group writes its range's partial softmax state: the max
// score m, the sum l of exp(score - m), and acc[d] = sum exp(score - m) V[d]
// (unnormalized) to part[(h * n_splits + s) * (head_dim + 2) ..]: m, l,
// acc[0 .. head_dim-1].  attention_merge.comp combines the ranges.
//
// Same cache layout, GQA and window rule as attention.comp: the query at
// position pos[0] sees rows first .. pos[0], first = pos[0] + 1 - window
// when window > 0 (else 0).  The keys present, first .. pos[0], are cut
// into n_splits equal ranges here, from the position: the step is recorded
// once for every position, with n_splits sized for the whole context, and
// ranges cut for the whole context would leave most groups empty and the
// rest with up to `chunk` keys each while the context fills.
// Several query tokens (a decode step of parallel slots): work-group z is the
// token, its q row q_stride floats after the one before, its partials
// n_heads * n_splits rows after; seq_rows > 0: token t reads its sequence's
// rows, seq[t] * seq_rows on, seq[t] = pos[seq_off + t] (the sequence ids
// beside the positions in binding 3).
// Keys go in tiles of TK: TPK threads per key for the score (each a slice of
// the row's words, the slices of neighbouring threads adjacent), then every
// thread one word (two dimensions) of V, or two for head_dim > 256.
#version 450
#extension GL_EXT_control_flow_attributes : enable
layout(local_size_x = 128) in;
#define WG 128u
#define TK 32u
#define TPK 4u      // WG / TK
#define MAXW 256u   // words per head row: head_dim <= 512
#define UL 8u       // cache words in flight per thread

layout(std430, set = 0, binding = 0) readonly buffer Q { float q[]; };
layout(std430, set = 0, binding = 1) readonly buffer KCache { uint kc[]; };
layout(std430, set = 0, binding = 2) readonly buffer VCache { uint vc[]; };
layout(std430, set = 0, binding = 3) readonly buffer Pos { int pos[]; };
layout(std430, set = 0, binding = 4) buffer Part { float part[]; };

layout(push_constant) uniform Params {
    uint n_heads;
    uint n_kv_heads;
    uint head_dim;    // even, <= 512
    uint q_off;       // float offset of q[0, 0] in binding 0
    uint k_off;       // word offset of K[0, 0] in binding 1
    uint v_off;       // word offset of V[0, 0] in binding 2
    uint kv_stride;   // words from cache row j to j + 1
    uint pos_off;     // int offset of pos[0] in binding 3
    uint part_off;    // float offset of the partials in binding 4
    uint ctx;
    uint window;      // 0: full causal
    uint chunk;       // keys per range at most (the full context's cut)
    uint n_splits;
    float scale;
    float softcap;    // > 0: each score s becomes softcap * tanh(s / softcap) (gemma2; tanh as softcap.comp writes it)
    uint q_stride;    // floats from token t's q row to t + 1's (work-group z)
    uint seq_off;     // int offset of seq[0] in binding 3 (read where seq_rows > 0)
    uint seq_rows;    // cache rows from one sequence to the next; 0: one sequence
} p;

const float NEG = -1.0e30;

shared vec2 qs[MAXW];
shared float red[WG];
shared float score[TK];

void main() {
    uint h = gl_WorkGroupID.x;
    uint s = gl_WorkGroupID.y;
    uint lid = gl_LocalInvocationID.x;
    uint W = p.head_dim >> 1;
    uint kvh = h / (p.n_heads / p.n_kv_heads);
    uint t = gl_WorkGroupID.z;
    int qp = pos[p.pos_off + t];
    uint row0 = p.seq_rows > 0u ? uint(pos[p.seq_off + t]) * p.seq_rows : 0u;  // the sequence's first row
    uint n_keys = uint(clamp(qp + 1, 0, int(p.ctx)));
    uint first = (p.window > 0u && n_keys > p.window) ? n_keys - p.window : 0u;
    uint per = min(p.chunk, max(1u, (n_keys - first + p.n_splits - 1u) / p.n_splits));
    uint lo = min(first + s * per, n_keys);
    uint hi = min(lo + per, n_keys);
    uint pb = p.part_off + ((t * p.n_heads + h) * p.n_splits + s) * (p.head_dim + 2u);
    if (lo >= hi) {  // an empty range (the whole group: no barrier waits)
        if (lid == 0u) {
            part[pb] = NEG;
            part[pb + 1u] = 0.0;
        }
        for (uint d = lid; d < p.head_dim; d += WG) {
            part[pb + 2u + d] = 0.0;
        }
        return;
    }
    uint qb = p.q_off + t * p.q_stride + h * p.head_dim;
    for (uint w = lid; w < W; w += WG) {
        qs[w] = vec2(q[qb + 2u * w], q[qb + 2u * w + 1u]) * p.scale;
    }
    barrier();
    uint head_w = kvh * W;  // word offset of this KV head in a cache row
    float m = NEG, l = 0.0;
    vec2 acc0 = vec2(0.0), acc1 = vec2(0.0);  // words lid and lid + WG of V
    uint key = lid / TPK, slice = lid % TPK;
    for (uint base = lo; base < hi; base += TK) {
        // Loads in batches of UL, issued before any is used: the KV cache
        // comes from memory, and a loop of dependent trips waited for each
        // (the H200 profile: 14 us a layer for 160 keys).  Indices past the
        // end are clamped and their terms dropped.
        uint j = base + key;
        uint kw = p.k_off + (row0 + min(j, hi - 1u)) * p.kv_stride + head_w;
        float dot_ = 0.0;
        for (uint w0 = slice; w0 < W; w0 += UL * TPK) {
            uint kk[UL];
            [[unroll]] for (uint u = 0u; u < UL; u++) {
                kk[u] = kc[kw + min(w0 + u * TPK, W - 1u)];
            }
            [[unroll]] for (uint u = 0u; u < UL; u++) {
                uint w = w0 + u * TPK;
                dot_ += w < W ? dot(qs[min(w, W - 1u)], unpackHalf2x16(kk[u])) : 0.0;
            }
        }
        red[lid] = j < hi ? dot_ : 0.0;
        barrier();
        if (lid < TK) {
            float sc = 0.0;
            for (uint i = 0u; i < TPK; i++) {
                sc += red[lid * TPK + i];
            }
            sc = p.softcap > 0.0 ? p.softcap * (1.0 - 2.0 / (exp(2.0 * sc / p.softcap) + 1.0)) : sc;
            score[lid] = base + lid < hi ? sc : NEG;
        }
        barrier();
        uint cnt = min(TK, hi - base);
        float m_new = m;
        for (uint i = 0u; i < cnt; i++) {
            m_new = max(m_new, score[i]);
        }
        float corr = exp(m - m_new);
        float lsum = 0.0;
        vec2 a0 = vec2(0.0), a1 = vec2(0.0);
        uint vw = p.v_off + (row0 + base) * p.kv_stride + head_w;
        uint w0 = min(lid, W - 1u), w1 = min(lid + WG, W - 1u);  // clamped; a0/a1 kept only where valid
        for (uint i0 = 0u; i0 < cnt; i0 += UL) {
            uint v0[UL], v1[UL];
            [[unroll]] for (uint u = 0u; u < UL; u++) {
                uint row = vw + min(i0 + u, cnt - 1u) * p.kv_stride;
                v0[u] = vc[row + w0];
                v1[u] = W > WG ? vc[row + w1] : 0u;
            }
            [[unroll]] for (uint u = 0u; u < UL; u++) {
                float pj = i0 + u < cnt ? exp(score[min(i0 + u, TK - 1u)] - m_new) : 0.0;
                lsum += pj;
                a0 += pj * unpackHalf2x16(v0[u]);
                a1 += pj * unpackHalf2x16(v1[u]);
            }
        }
        a0 = lid < W ? a0 : vec2(0.0);
        a1 = lid + WG < W ? a1 : vec2(0.0);
        l = l * corr + lsum;
        acc0 = acc0 * corr + a0;
        acc1 = acc1 * corr + a1;
        m = m_new;
        barrier();  // red and score are reused by the next tile
    }
    if (lid == 0u) {
        part[pb] = m;
        part[pb + 1u] = l;
    }
    if (lid < W) {
        part[pb + 2u + 2u * lid] = acc0.x;
        part[pb + 3u + 2u * lid] = acc0.y;
    }
    if (lid + WG < W) {
        part[pb + 2u + 2u * (lid + WG)] = acc1.x;
        part[pb + 3u + 2u * (lid + WG)] = acc1.y;
    }
}
