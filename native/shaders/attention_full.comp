// Non-causal softmax attention (the ViT's): every query sees every key.
//
// q, k, v: f32 [n_tokens, n_heads * head_dim] (token rows *_stride floats
// apart, so views of a fused QKV buffer work); out: f32 [n_tokens, o_stride],
//   out[t, h*hd + d] = sum_j softmax_j(scale * q[t, h] . k[j, h]) v[j, h, d].
// No mask, no KV cache, no GQA (the encoder's heads are all full heads).
//
// A flash-attention style tiling in f32: one work group per (head, tile of
// BQ queries); the queries stay in shared memory, keys and values go through
// it BK rows at a time.  For each key tile: scores S = Q K^T (2 per thread),
// then each query row's running max, p = exp(s - max) and the online
// softmax rescale of the running sum and output (so any n_tokens works in
// fixed shared memory).  Thread tid works on query row tid / 8: scores for
// keys tid % 8 and tid % 8 + 8, outputs for head dimensions tid % 8 + 8 i.
// Shared memory (BQ = 32, BK = 16, head_dim <= 128): 16.5 + 8.3 + 2 x 2.2
// KB, within the 32 KB lavapipe offers.  Rows of the tiles are padded by
// one float so a column walk falls in different banks.
#version 450
layout(local_size_x = 256) in;
#define WG 256u
#define BQ 32u
#define BK 16u
#define TPR 8u              // threads per query row (WG / BQ)
#define MAXD 128u           // head_dim limit
#define DPT (MAXD / TPR)    // output dimensions per thread, at most
#define QP (MAXD + 1u)      // padded row of the Q and K/V tiles
#define SP (BK + 1u)        // padded row of the score tiles

layout(std430, set = 0, binding = 0) readonly buffer Q { float q[]; };
layout(std430, set = 0, binding = 1) readonly buffer K { float k[]; };
layout(std430, set = 0, binding = 2) readonly buffer V { float v[]; };
layout(std430, set = 0, binding = 3) buffer Out { float o[]; };

layout(push_constant) uniform Params {
    uint n_tokens;
    uint n_heads;
    uint head_dim;    // <= 128
    uint q_off;       // float offset of row 0 in each binding, and its row stride
    uint q_stride;
    uint k_off;
    uint k_stride;
    uint v_off;
    uint v_stride;
    uint o_off;
    uint o_stride;
    float scale;
} p;

const float NEG = -1.0e30;  // finite: exp(NEG - m) is 0 without inf arithmetic

shared float qs[BQ * QP];
shared float kvs[BK * QP];   // the K tile, then the V tile
shared float ss[BQ * SP];    // scores
shared float ps[BQ * SP];    // exp(score - running max)

void main() {
    uint h = gl_WorkGroupID.x;
    uint q0 = gl_WorkGroupID.y * BQ;
    uint tid = gl_LocalInvocationID.x;
    uint hd = p.head_dim;
    uint col = h * hd;       // this head's first float in a token row
    uint r = tid / TPR;      // the query row this thread works on
    uint lane = tid % TPR;

    // Q tile, scaled; rows past n_tokens are zeros (their output is not written).
    for (uint i = tid; i < BQ * hd; i += WG) {
        uint rr = i / hd, d = i % hd;
        uint t = q0 + rr;
        qs[rr * QP + d] = t < p.n_tokens ? q[p.q_off + t * p.q_stride + col + d] * p.scale : 0.0;
    }

    float m = NEG, l = 0.0;
    float acc[DPT];
    for (uint i = 0u; i < DPT; i++) {
        acc[i] = 0.0;
    }

    for (uint k0 = 0u; k0 < p.n_tokens; k0 += BK) {
        // K tile (keys past n_tokens are zeros; their scores are masked below)
        for (uint i = tid; i < BK * hd; i += WG) {
            uint j = i / hd, d = i % hd;
            uint t = k0 + j;
            kvs[j * QP + d] = t < p.n_tokens ? k[p.k_off + t * p.k_stride + col + d] : 0.0;
        }
        barrier();  // also publishes the Q tile on the first pass
        {   // keys lane and lane + TPR (BK = 2 TPR): each q element read once for both
            uint c0 = lane, c1 = lane + TPR;
            float s0 = 0.0, s1 = 0.0;
            for (uint d = 0u; d < hd; d++) {
                float qd = qs[r * QP + d];
                s0 += qd * kvs[c0 * QP + d];
                s1 += qd * kvs[c1 * QP + d];
            }
            ss[r * SP + c0] = k0 + c0 < p.n_tokens ? s0 : NEG;
            ss[r * SP + c1] = k0 + c1 < p.n_tokens ? s1 : NEG;
        }
        barrier();  // scores written; every read of the K tile done
        // V tile over the K tile (zeros past n_tokens: 0 * garbage could be NaN)
        for (uint i = tid; i < BK * hd; i += WG) {
            uint j = i / hd, d = i % hd;
            uint t = k0 + j;
            kvs[j * QP + d] = t < p.n_tokens ? v[p.v_off + t * p.v_stride + col + d] : 0.0;
        }
        // The row's new running max (the TPR threads of a row compute the same value).
        float mt = m;
        for (uint c = 0u; c < BK; c++) {
            mt = max(mt, ss[r * SP + c]);
        }
        for (uint c = lane; c < BK; c += TPR) {
            ps[r * SP + c] = exp(ss[r * SP + c] - mt);  // masked keys: exp(NEG - mt) = 0
        }
        barrier();  // V tile and probabilities published
        float corr = exp(m - mt);  // 0 on the first tile (m = NEG)
        float lt = 0.0;
        for (uint c = 0u; c < BK; c++) {
            lt += ps[r * SP + c];
        }
        l = l * corr + lt;
        for (uint i = 0u; i < DPT; i++) {
            acc[i] *= corr;
        }
        for (uint c = 0u; c < BK; c++) {  // each probability read once for all the thread's dimensions
            float pc = ps[r * SP + c];
            for (uint i = 0u; i < DPT; i++) {
                uint d = lane + i * TPR;
                if (d < hd) {
                    acc[i] += pc * kvs[c * QP + d];
                }
            }
        }
        m = mt;
        barrier();  // every thread is done with the tiles before the next ones
    }

    uint t = q0 + r;
    if (t < p.n_tokens) {
        uint ob = p.o_off + t * p.o_stride + col;
        for (uint i = 0u; i < DPT; i++) {
            uint d = lane + i * TPR;
            if (d < hd) {
                o[ob + d] = acc[i] / l;
            }
        }
    }
}
