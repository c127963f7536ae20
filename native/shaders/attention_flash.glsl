// Causal flash attention of a chunk of queries (prefill) over the f16 KV cache, with GQA.
//
// The same contract and push constants as attention.comp (q f32 [n_tokens,
// n_heads, head_dim]; K, V caches f16 [ctx, n_kv_heads * head_dim] as
// kv_write / rope_kv_write lay them out; query t at pos[t] sees rows
// 0 .. pos[t], or the last `window` of them; softcap > 0 caps each score),
// for head_dim <= 256.
//
// One work group per (KV head, tile of R query rows), a row being a
// (token, q head of this KV group) pair: rows i0 .. i0 + R - 1 of the
// pairs t * G + g (G = n_heads / n_kv_heads), so the G query heads that
// read one KV head share every K/V tile the group loads, and so do the
// R / G tokens of the tile (any G works: a group larger than R spreads over
// work groups).  R = 64, 32, 16 rows for head_dim <= 64, 128, 256: the Q
// tile is then at most 16.5 KiB of f32 whatever the head size, and each of
// the TPR = 256 / R threads of a row owns head_dim / (2 TPR) <= 8 word
// pairs of the output.  Keys go through shared memory BK = 16 rows at a
// time (f16, as the cache holds them), the K tile and then the V tile in the
// same array; the softmax is online per row (running max and sum, the
// output rescaled per tile), so no score matrix is ever larger than R x BK
// and any context works.  The key span of a work group is the union of its
// rows' spans (their causal/window masks applied per score), so the tiles
// before a window or after the last query are never read.
//
// Shared memory: 16.5 (Q) + 8.1 (K/V) + 4.3 (scores) KiB with BK = 16
// (attention_flash.comp), under the 32 KiB lavapipe offers; 16.5 + 16.1 +
// 8.3 = 40.9 KiB with BK = 32 (attention_flash_k32.comp: half the tiles and
// barriers per key, for devices with 48 KiB such as the H200; Ops picks it
// by maxComputeSharedMemorySize).  f16 loads, f32 math.
// Banks: rows are padded by one element (QP, KP, SP), so in the score loop
// the rows of a warp read Q words 2 * QP apart (distinct banks) and its
// lanes K rows KP = 129 words apart (bank lane + w), and in the P.V loop a
// warp reads one probability (a broadcast) and consecutive V words: no loop
// of a tile is bank-conflicted (only the score stores, once a tile, can
// meet two ways).
// MAXR and BK are defines so that other tiles can be tried; Ops.attention's
// flash_rows follows MAXR (on lavapipe 32 rows x 32 keys was 1.2-1.45x
// slower than 64 x 16).
//
// Attention sinks (gpt-oss) as attention.comp takes them (binding 5,
// has_sink, sink_off): head h's logit sinks[sink_off + h] joins each row's
// denominator without a value, folded in after the last key tile as one more
// online-softmax step with an all-zero value.
layout(local_size_x = 256) in;
#define WG 256u
#ifndef BK
#define BK 16u
#endif
#ifndef MAXR
#define MAXR 64u             // rows of a tile at most (head_dim <= 64; half that <= 128, a quarter <= 256)
#endif
#define MAXW 128u            // words (two halves) of a head, at most: head_dim <= 256
#define QTILE (MAXR * 33u)   // vec2 of the Q tile at most: R * (head_dim / 2 + 1) for each R
#define KP (MAXW + 1u)       // padded word row of the K/V tile
#define SP (BK + 1u)         // padded row of the scores
#define WPT (MAXR / 8u)      // output words per thread at most: (head_dim / 2) / TPR
#define KPT (BK * MAXR / WG) // scores per thread at most: BK / TPR

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
    uint head_dim;    // even, <= 256
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

shared vec2 qs[QTILE];
shared uint kvs[BK * KP];   // the K tile, then the V tile (two halves a word)
shared float ss[MAXR * SP]; // scores, then exp(score - running max) in place

// The keys query t sees: [first, end).
void span_of(uint t, out uint first, out uint end) {
    int qp = pos[p.pos_off + t];
    end = uint(clamp(qp + 1, 0, int(p.ctx)));
    first = (p.window > 0u && end > p.window) ? end - p.window : 0u;
}

void main() {
    uint kvh = gl_WorkGroupID.x;
    uint tid = gl_LocalInvocationID.x;
    uint hw = p.head_dim >> 1;
    uint R = p.head_dim <= 64u ? MAXR : (p.head_dim <= 128u ? MAXR / 2u : MAXR / 4u);
    uint TPR = WG / R;
    uint G = p.n_heads / p.n_kv_heads;
    uint n_pairs = p.n_tokens * G;
    uint i0 = gl_WorkGroupID.y * R;
    uint QP = hw + 1u;
    uint r = tid / TPR, lane = tid % TPR;

    // This thread's row; a row past the last pair sees no key (end 0).
    uint pi = i0 + r;
    bool live = pi < n_pairs;
    uint t = live ? pi / G : 0u;
    uint h = kvh * G + (live ? pi % G : 0u);
    uint row_first = 0u, row_end = 0u;
    if (live) {
        span_of(t, row_first, row_end);
    }
    // The work group's key span: the union of its tokens' (the same in every thread).
    uint lo = p.ctx, hi = 0u;
    uint t_last = (min(i0 + R, n_pairs) - 1u) / G;
    for (uint tt = i0 / G; tt <= t_last; tt++) {
        uint f, e;
        span_of(tt, f, e);
        if (e > f) {
            lo = min(lo, f);
            hi = max(hi, e);
        }
    }

    // The Q tile, scaled; rows past the last pair are zeros.
    for (uint i = tid; i < R * hw; i += WG) {
        uint rr = i / hw, w = i % hw;
        uint pr = i0 + rr;
        vec2 v2 = vec2(0.0);
        if (pr < n_pairs) {
            uint qb = p.q_off + (pr / G) * p.q_stride + (kvh * G + pr % G) * p.head_dim + 2u * w;
            v2 = vec2(q[qb], q[qb + 1u]) * p.scale;
        }
        qs[rr * QP + w] = v2;
    }

    uint head_w = kvh * hw;  // word offset of this KV head in a cache row
    float m = NEG, l = 0.0;
    vec2 acc[WPT];
    for (uint i = 0u; i < WPT; i++) {
        acc[i] = vec2(0.0);
    }
    for (uint k0 = lo; k0 < hi; k0 += BK) {
        uint cnt = min(BK, hi - k0);
        for (uint i = tid; i < BK * hw; i += WG) {
            uint jj = i / hw, w = i % hw;
            kvs[jj * KP + w] = jj < cnt ? kc[p.k_off + (k0 + jj) * p.kv_stride + head_w + w] : 0u;
        }
        barrier();  // K tile (and, the first time, the Q tile) published
        // Scores of keys lane, lane + TPR, ...: each q element read once for all of them.
        uint nk = BK / TPR;
        float dots[KPT];
        for (uint i = 0u; i < KPT; i++) {
            dots[i] = 0.0;
        }
        for (uint w = 0u; w < hw; w++) {
            vec2 qq = qs[r * QP + w];
            for (uint i = 0u; i < KPT; i++) {
                if (i < nk) {
                    vec2 kk = unpackHalf2x16(kvs[(lane + i * TPR) * KP + w]);
                    dots[i] += qq.x * kk.x + qq.y * kk.y;
                }
            }
        }
        for (uint i = 0u; i < KPT; i++) {
            if (i < nk) {
                uint c = lane + i * TPR;
                float d = dots[i];
                float s = p.softcap > 0.0 ? p.softcap * (1.0 - 2.0 / (exp(2.0 * d / p.softcap) + 1.0)) : d;
                uint j = k0 + c;
                ss[r * SP + c] = (j >= row_first && j < row_end) ? s : NEG;
            }
        }
        barrier();  // scores written; every read of the K tile done
        // The V tile over the K tile (zeros past the span: 0 * garbage could be NaN).
        for (uint i = tid; i < BK * hw; i += WG) {
            uint jj = i / hw, w = i % hw;
            kvs[jj * KP + w] = jj < cnt ? vc[p.v_off + (k0 + jj) * p.kv_stride + head_w + w] : 0u;
        }
        float mt = m;
        for (uint c = 0u; c < BK; c++) {
            mt = max(mt, ss[r * SP + c]);
        }
        barrier();  // the row's max read by all its threads before the scores become probabilities
        for (uint c = lane; c < BK; c += TPR) {
            float s = ss[r * SP + c];
            // A masked key is 0 even where the row has seen no key yet (mt = NEG).
            ss[r * SP + c] = s > 0.5 * NEG ? exp(s - mt) : 0.0;
        }
        barrier();  // V tile and probabilities published
        float corr = exp(m - mt);  // 0 once the first real key arrives (m = NEG)
        float lt = 0.0;
        for (uint c = 0u; c < BK; c++) {
            lt += ss[r * SP + c];
        }
        l = l * corr + lt;
        for (uint i = 0u; i < WPT; i++) {
            acc[i] *= corr;
        }
        for (uint c = 0u; c < cnt; c++) {  // each probability read once for all the thread's words
            float pc = ss[r * SP + c];
            for (uint i = 0u; i < WPT; i++) {
                uint w = lane + i * TPR;
                if (w < hw) {
                    acc[i] += pc * unpackHalf2x16(kvs[c * KP + w]);
                }
            }
        }
        m = mt;
        barrier();  // every thread is done with the tiles before the next ones
    }

    if (live && p.has_sink != 0u) {
        // A row that saw no key (m = NEG) ends at 0: corr is 0, l the sink's own 1.
        float sk = sinks[p.sink_off + h];
        float m_new = max(m, sk);
        float corr = exp(m - m_new);
        l = l * corr + exp(sk - m_new);
        for (uint i = 0u; i < WPT; i++) {
            acc[i] *= corr;
        }
    }
    if (live) {
        uint ob = p.o_off + t * p.o_stride + h * p.head_dim;
        for (uint i = 0u; i < WPT; i++) {
            uint w = lane + i * TPR;
            if (w < hw) {
                vec2 r2 = l > 0.0 ? acc[i] / l : vec2(0.0);
                o[ob + 2u * w] = r2.x;
                o[ob + 2u * w + 1u] = r2.y;
            }
        }
    }
}
