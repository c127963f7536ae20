// Causal attention of queries over an f16 KV cache, with GQA.
//
// q: f32 [n_tokens, n_heads, head_dim]; K and V caches: f16 [ctx, width]
// (width = n_kv_heads * head_dim, two halves per uint32 word); pos: int32
// [n_tokens], the position of each query; out: f32 [n_tokens, n_heads *
// head_dim].  Query t at position pos[t] sees cache rows 0 .. pos[t] (rows
// pos[t] - window + 1 .. pos[t] when window > 0); head h reads KV head
// h / (n_heads / n_kv_heads).  softmax(scale * q.k) in f32 (the score soft-capped
// first when softcap > 0).
//
// One work group per (head, token).  Keys go in tiles of WG, one key per
// thread for the score; the softmax is online (running max and sum, the
// output rescaled per tile), so no context length is too long for shared
// memory; for the weighted sum of V each thread owns head dimensions
// lid, lid + WG, ... (head_dim <= 4 * WG = 512).
//
// Attention sinks (gpt-oss): with has_sink, head h has a learned logit
// sinks[sink_off + h] that joins the softmax's denominator but carries no
// value: out = sum_j exp(s_j - M) v_j / (sum_j exp(s_j - M) + exp(sink - M)),
// M the max over the scores and the sink.  Folded in once after the last
// tile, as one more online-softmax step with an all-zero value.
#version 450
layout(local_size_x = 128) in;
#define WG 128u
#define MAXD 4u

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
    uint head_dim;    // even, <= 512
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
    float softcap;    // > 0: each score s becomes softcap * tanh(s / softcap) (gemma2; tanh as softcap.comp writes it)
    uint has_sink;    // 1: binding 5 holds a sink logit per head (from sink_off); 0: no sinks (binding 5 unread)
    uint sink_off;
} p;

const float NEG = -1.0e30;  // finite: exp(NEG - m) is 0 without inf arithmetic

shared float qs[4u * WG];
shared float ps[WG];
shared float red[WG];

float reduce_max(float v, uint lid) {
    red[lid] = v;
    barrier();
    for (uint s = WG / 2u; s > 0u; s >>= 1) {
        if (lid < s) {
            red[lid] = max(red[lid], red[lid + s]);
        }
        barrier();
    }
    float r = red[0];
    barrier();
    return r;
}

float reduce_sum(float v, uint lid) {
    red[lid] = v;
    barrier();
    for (uint s = WG / 2u; s > 0u; s >>= 1) {
        if (lid < s) {
            red[lid] += red[lid + s];
        }
        barrier();
    }
    float r = red[0];
    barrier();
    return r;
}

void main() {
    uint h = gl_WorkGroupID.x;
    uint t = gl_WorkGroupID.y;
    uint lid = gl_LocalInvocationID.x;
    uint hd = p.head_dim;
    uint kvh = h / (p.n_heads / p.n_kv_heads);
    int qp = pos[p.pos_off + t];
    uint n_keys = uint(clamp(qp + 1, 0, int(p.ctx)));
    uint first = (p.window > 0u && n_keys > p.window) ? n_keys - p.window : 0u;

    uint qb = p.q_off + t * p.q_stride + h * hd;
    for (uint d = lid; d < hd; d += WG) {
        qs[d] = q[qb + d] * p.scale;
    }
    barrier();

    uint head_w = (kvh * hd) >> 1;  // word offset of this KV head in a cache row
    float m = NEG, l = 0.0;
    float acc[MAXD];
    for (uint i = 0u; i < MAXD; i++) {
        acc[i] = 0.0;
    }
    for (uint base = first; base < n_keys; base += WG) {
        uint j = base + lid;
        float s = NEG;
        if (j < n_keys) {
            uint kw = p.k_off + j * p.kv_stride + head_w;
            float dot = 0.0;
            for (uint d = 0u; d < hd; d += 2u) {
                vec2 kk = unpackHalf2x16(kc[kw + (d >> 1)]);
                dot += qs[d] * kk.x + qs[d + 1u] * kk.y;
            }
            s = p.softcap > 0.0 ? p.softcap * (1.0 - 2.0 / (exp(2.0 * dot / p.softcap) + 1.0)) : dot;
        }
        float m_new = max(m, reduce_max(s, lid));
        float pj = j < n_keys ? exp(s - m_new) : 0.0;
        ps[lid] = pj;
        float corr = exp(m - m_new);
        l = l * corr + reduce_sum(pj, lid);  // its barriers also publish ps
        uint cnt = min(WG, n_keys - base);
        for (uint i = 0u; i < MAXD; i++) {
            uint d = lid + i * WG;
            if (d < hd) {
                uint vw = p.v_off + base * p.kv_stride + head_w + (d >> 1);
                uint sh = (d & 1u) << 4;
                float a = 0.0;
                for (uint jj = 0u; jj < cnt; jj++) {
                    a += ps[jj] * unpackHalf2x16(vc[vw + jj * p.kv_stride] >> sh).x;
                }
                acc[i] = acc[i] * corr + a;
            }
        }
        m = m_new;
        barrier();  // every thread is done with ps before the next tile
    }
    if (p.has_sink != 0u) {
        float sk = sinks[p.sink_off + h];
        float m_new = max(m, sk);
        float corr = exp(m - m_new);
        l = l * corr + exp(sk - m_new);
        for (uint i = 0u; i < MAXD; i++) {
            acc[i] *= corr;
        }
    }
    uint ob = p.o_off + t * p.o_stride + h * hd;
    for (uint i = 0u; i < MAXD; i++) {
        uint d = lid + i * WG;
        if (d < hd) {
            o[ob + d] = l > 0.0 ? acc[i] / l : 0.0;
        }
    }
}
