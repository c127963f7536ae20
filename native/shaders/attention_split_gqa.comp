// Decode attention, part 1 of 2, for grouped-query attention: as
// attention_split.comp (one query token, its keys cut into n_splits ranges,
// each range's partial softmax state m, l, acc[d] written for
// attention_merge.comp), but one work group per (KV head, range) computes
// the G = n_heads / n_kv_heads query heads that share the KV head, so each
// K and V row is read from memory once for the G heads instead of once per
// head.  Why: at long context the split form's G groups per KV head each
// streamed the same rows (gpt-oss: G = 8, 16 MiB of K/V per full layer at
// 8,000 keys), and decode fell to 0.65x llama.cpp on the H200 (2026-12-02).
//
// Partials land where attention_split.comp puts them, at
// part[(h * n_splits + s) * (head_dim + 2) ..] for q head h, so the merge
// is the same.  Same push constants and bindings, same range rule (from the
// position, for a step recorded once for every position), ranges at least
// TK keys (a tile) unless capped by `chunk`.  Requires G <= MAXG and
// G * head_dim / 2 <= MAXQW (Ops.attention checks; else attention_split).
//
// A tile of TK keys: scores by thread (key j = lid % TK, heads lid / TK +
// 4i), each reading its key's row once for its heads (the other three
// threads of the key hit the cache); softmax bookkeeping per head; then
// every thread accumulates (head, V word) items over the tile's keys, the
// threads of one head reading consecutive words of a row.
#version 450
#extension GL_EXT_control_flow_attributes : enable
layout(local_size_x = 128) in;
#define WG 128u
#define TK 32u
#define HPT 4u      // WG / TK: threads per key in the score pass
#define MAXG 16u    // query heads per KV head
#define MAXQW 2048u // G * head_dim / 2 words of q (and V items) per group
#define NI 16u      // MAXQW / WG: V items per thread
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
    float softcap;    // > 0: each score s becomes softcap * tanh(s / softcap)
    uint q_stride;    // floats from token t's q row to t + 1's (work-group z)
    uint seq_off;     // int offset of seq[0] in binding 3 (read where seq_rows > 0)
    uint seq_rows;    // cache rows from one sequence to the next; 0: one sequence
} p;

const float NEG = -1.0e30;

shared vec2 qs[MAXQW];       // [g][w]: the G heads' q, scaled
shared float sc[MAXG * TK];  // [g][j]: scores, then exp(score - m)
shared float mh[MAXG], lh[MAXG], corr[MAXG];

void main() {
    uint kvh = gl_WorkGroupID.x;
    uint s = gl_WorkGroupID.y;
    uint lid = gl_LocalInvocationID.x;
    uint W = p.head_dim >> 1;
    uint G = p.n_heads / p.n_kv_heads;
    uint h0 = kvh * G;       // this group's first q head
    uint t = gl_WorkGroupID.z;   // several tokens (parallel slots' decode): attention_split.comp's rule
    int qp = pos[p.pos_off + t];
    uint row0 = p.seq_rows > 0u ? uint(pos[p.seq_off + t]) * p.seq_rows : 0u;  // the sequence's first row
    uint hb = t * p.n_heads;     // token t's partials: n_heads * n_splits rows on
    uint n_keys = uint(clamp(qp + 1, 0, int(p.ctx)));
    uint first = (p.window > 0u && n_keys > p.window) ? n_keys - p.window : 0u;
    uint per = min(p.chunk, max(TK, (n_keys - first + p.n_splits - 1u) / p.n_splits));
    uint lo = min(first + s * per, n_keys);
    uint hi = min(lo + per, n_keys);
    uint stride = p.head_dim + 2u;
    if (lo >= hi) {  // an empty range (the whole group: no barrier waits)
        for (uint g = 0u; g < G; g++) {
            uint pb = p.part_off + ((hb + h0 + g) * p.n_splits + s) * stride;
            if (lid == 0u) {
                part[pb] = NEG;
                part[pb + 1u] = 0.0;
            }
            for (uint d = lid; d < p.head_dim; d += WG) {
                part[pb + 2u + d] = 0.0;
            }
        }
        return;
    }
    uint GW = G * W;
    for (uint i = lid; i < GW; i += WG) {
        uint qb = p.q_off + t * p.q_stride + h0 * p.head_dim + 2u * i;   // heads h0.. are consecutive rows of q
        qs[i] = vec2(q[qb], q[qb + 1u]) * p.scale;
    }
    if (lid < G) {
        mh[lid] = NEG;
        lh[lid] = 0.0;
    }
    barrier();
    uint head_w = kvh * W;   // word offset of this KV head in a cache row
    vec2 acc[NI];
    [[unroll]] for (uint i = 0u; i < NI; i++) {
        acc[i] = vec2(0.0);
    }
    uint key = lid % TK, g0 = lid / TK;
    for (uint base = lo; base < hi; base += TK) {
        uint cnt = min(TK, hi - base);
        // Scores: this thread's key against heads g0, g0 + HPT, ... (each K word read once for them).
        uint kw = p.k_off + (row0 + base + min(key, cnt - 1u)) * p.kv_stride + head_w;
        float d[MAXG / HPT];
        [[unroll]] for (uint i = 0u; i < MAXG / HPT; i++) {
            d[i] = 0.0;
        }
        for (uint w0 = 0u; w0 < W; w0 += UL) {
            uint kk[UL];
            [[unroll]] for (uint u = 0u; u < UL; u++) {
                kk[u] = kc[kw + min(w0 + u, W - 1u)];
            }
            [[unroll]] for (uint u = 0u; u < UL; u++) {
                vec2 kf = unpackHalf2x16(kk[u]);
                bool in_row = w0 + u < W;
                [[unroll]] for (uint i = 0u; i < MAXG / HPT; i++) {
                    uint g = g0 + HPT * i;
                    if (g < G && in_row) {
                        d[i] += dot(qs[g * W + w0 + u], kf);
                    }
                }
            }
        }
        [[unroll]] for (uint i = 0u; i < MAXG / HPT; i++) {
            uint g = g0 + HPT * i;
            if (g < G) {
                float v = d[i];
                v = p.softcap > 0.0 ? p.softcap * (1.0 - 2.0 / (exp(2.0 * v / p.softcap) + 1.0)) : v;
                sc[g * TK + key] = key < cnt ? v : NEG;
            }
        }
        barrier();
        if (lid < G) {   // the head's new max, and the factor its sums so far are rescaled by
            float m_new = mh[lid];
            for (uint j = 0u; j < cnt; j++) {
                m_new = max(m_new, sc[lid * TK + j]);
            }
            corr[lid] = exp(mh[lid] - m_new);
            mh[lid] = m_new;
        }
        barrier();
        for (uint e = lid; e < G * TK; e += WG) {
            uint g = e / TK, j = e % TK;
            sc[e] = j < cnt ? exp(sc[e] - mh[g]) : 0.0;
        }
        barrier();
        if (lid < G) {
            float lsum = 0.0;
            for (uint j = 0u; j < cnt; j++) {
                lsum += sc[lid * TK + j];
            }
            lh[lid] = lh[lid] * corr[lid] + lsum;
        }
        // V: items (g, w) = lid + WG * i; a thread's items of one head read consecutive row words.
        uint vw = p.v_off + (row0 + base) * p.kv_stride + head_w;
        [[unroll]] for (uint i = 0u; i < NI; i++) {
            uint item = lid + WG * i;
            if (item < GW) {
                uint g = item / W, w = item % W;
                vec2 a = vec2(0.0);
                for (uint j0 = 0u; j0 < cnt; j0 += UL) {
                    uint vv[UL];
                    [[unroll]] for (uint u = 0u; u < UL; u++) {
                        vv[u] = vc[vw + min(j0 + u, cnt - 1u) * p.kv_stride + w];
                    }
                    [[unroll]] for (uint u = 0u; u < UL; u++) {
                        float pj = j0 + u < cnt ? sc[g * TK + min(j0 + u, TK - 1u)] : 0.0;
                        a += pj * unpackHalf2x16(vv[u]);
                    }
                }
                acc[i] = acc[i] * corr[g] + a;
            }
        }
        barrier();  // sc, corr and lh are reused by the next tile
    }
    for (uint g = lid; g < G; g += WG) {
        uint pb = p.part_off + ((hb + h0 + g) * p.n_splits + s) * stride;
        part[pb] = mh[g];
        part[pb + 1u] = lh[g];
    }
    [[unroll]] for (uint i = 0u; i < NI; i++) {
        uint item = lid + WG * i;
        if (item < GW) {
            uint g = item / W, w = item % W;
            uint pb = p.part_off + ((hb + h0 + g) * p.n_splits + s) * stride + 2u + 2u * w;
            part[pb] = acc[i].x;
            part[pb + 1u] = acc[i].y;
        }
    }
}
