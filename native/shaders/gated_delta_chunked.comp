// The gated delta rule of Gated DeltaNet in its chunked (WY / UT-transform) form, for prefill:
// the same numbers as gated_delta.comp (its header: the inputs, the gates, the state layout),
// computed CH tokens at a time as llama.cpp's build_delta_net_chunking / the numpy reference's
// delta_rule_chunked.  One work group per value head h, the chunks in order; invocation j < S
// keeps row j of the state M (value row j) in registers, as the recurrent kernel does.
// Per chunk of cn <= CH tokens, G = cumsum(g) within the chunk, D[i, l] = e^(G_i - G_l), l <= i:
//   A[i, l] = beta_i (k_i . k_l) D[i, l] (l < i), QK[i, l] = (q_i . k_l) D[i, l] (l <= i);
//   V'[i] = beta_i (v_i - e^G_i M k_i) - sum_{l<i} A[i, l] V'[l]   (forward substitution:
//           V' = (I + A)^-1 (beta v) - (I + A)^-1 (beta e^G k) M^T);
//   out[i] = e^G_i M q_i + sum_{l<=i} QK[i, l] V'[l];
//   M <- e^G_last M + sum_l V'[l] (e^(G_last - G_l) k_l)^T.
// Each of these is a column-j computation given M's row j, so apart from q, k, A, QK (shared
// memory, the chunk's tiles) an invocation touches only its own data: its registers, column j of
// the V' tile, its outputs (which hold e^G M q until the intra-chunk part is added): a few
// barriers per chunk instead of the recurrent kernel's dozen per token, and M's row is read once
// per four tokens (M k_i and M q_i together, then the update) instead of three times per token.  The FMAs are as
// many as the recurrent form's: on lavapipe the two run at about the same speed; the gain is
// meant for GPUs, where the recurrent kernel's per-token barriers and reductions serialise.  Decays are exponentials of differences of
// G (never quotients of e^G), so strong gating underflows to zero instead of 0/0.
// Shared memory: q, k and V' tiles of CH x S <= TILE floats each, A and QK in one CMAX^2 square
// (their triangles), the gates: 28.5 KiB, inside lavapipe's 32 KiB.  CH = min(CMAX, TILE / S): 16 tokens at S = 128, 32 at S <= 64.
#version 450
layout(local_size_x = 128) in;

layout(std430, set = 0, binding = 0) readonly buffer Conv { float cv[]; };
layout(std430, set = 0, binding = 1) readonly buffer Alpha { float al[]; };
layout(std430, set = 0, binding = 2) readonly buffer Beta { float be[]; };
layout(std430, set = 0, binding = 3) readonly buffer Dt { float dt[]; };
layout(std430, set = 0, binding = 4) readonly buffer A { float av[]; };
layout(std430, set = 0, binding = 5) buffer State { float st[]; };
layout(std430, set = 0, binding = 6) buffer Out { float o[]; };   // also holds e^G M q until the output is added

layout(push_constant) uniform Params {
    uint n;         // tokens
    uint s;         // head size S <= MAXS
    uint hk;        // key heads
    uint hv;        // value heads
    float eps;
    uint c_off;     // float offsets in each binding
    uint al_off;
    uint be_off;
    uint dt_off;
    uint a_off;
    uint s_off;
    uint o_off;
    uint reset;     // 1: start from M = 0 (a sequence's start), the state unread
} p;

const uint WG = 128;
const uint MAXS = 128;
const uint CMAX = 32;
const uint TILE = 2048;
shared float sq[TILE];          // the chunk's q rows, l2-normalised and scaled by 1/sqrt(S)
shared float sk[TILE];          // its k rows, l2-normalised
shared float sv[TILE];          // V'[i * S + j]: column j is invocation j's alone
shared float saq[CMAX * CMAX];  // QK[i, l] at i * CMAX + l (l <= i), A[i, l] at l * CMAX + i (l < i)
shared float sg[CMAX];          // g, then G = its cumulative sum
shared float sb[CMAX];          // beta
shared float sn[2 * CMAX];      // per row: q's scale, then k's

void main() {
    uint h = gl_WorkGroupID.x, j = gl_LocalInvocationID.x;
    uint S = p.s, C = 2 * p.hk * S + p.hv * S, kh = h % p.hk;
    uint CH = min(CMAX, TILE / S) & ~3u;   // whole passes of four tokens
    bool live = j < S;
    float m[MAXS];
    uint base = p.s_off + (h * S + j) * S;
    for (uint i = 0; i < S; ++i) m[i] = live && p.reset == 0 ? st[base + i] : 0.0;
    float inv_sqrt_s = 1.0 / sqrt(float(S));
    for (uint c0 = 0; c0 < p.n; c0 += CH) {
        uint cn = min(CH, p.n - c0);
        uint cp = (cn + 3) / 4 * 4;   // the rows the four-token passes read: zeros past cn
        for (uint e = j; e < cp * S; e += WG) {
            bool in_chunk = e / S < cn;
            uint row = p.c_off + (c0 + e / S) * C + kh * S + e % S;
            sq[e] = in_chunk ? cv[row] : 0.0;
            sk[e] = in_chunk ? cv[row + p.hk * S] : 0.0;
        }
        if (j < cn) {
            float x = al[p.al_off + (c0 + j) * p.hv + h] + dt[p.dt_off + h];
            sg[j] = (x > 20.0 ? x : log(1.0 + exp(x))) * av[p.a_off + h];
            sb[j] = 1.0 / (1.0 + exp(-be[p.be_off + (c0 + j) * p.hv + h]));
        }
        barrier();
        if (j < cn) {
            float ss = 0.0;
            for (uint i = 0; i < S; ++i) ss += sq[j * S + i] * sq[j * S + i];
            sn[j] = inv_sqrt_s / max(sqrt(ss), p.eps);
        } else if (j >= CMAX && j < CMAX + cn) {
            uint t = j - CMAX;
            float ss = 0.0;
            for (uint i = 0; i < S; ++i) ss += sk[t * S + i] * sk[t * S + i];
            sn[j] = 1.0 / max(sqrt(ss), p.eps);
        } else if (j == WG - 1) {
            for (uint t = 1; t < cn; ++t) sg[t] += sg[t - 1];
        }
        barrier();
        for (uint e = j; e < cn * S; e += WG) {
            sq[e] *= sn[e / S];
            sk[e] *= sn[CMAX + e / S];
        }
        barrier();
        for (uint e = j; e < cn * cn; e += WG) {
            uint i = e / cn, l = e % cn;
            if (l <= i) {
                float kk = 0.0, qk = 0.0;
                for (uint x = 0; x < S; ++x) {
                    float kl = sk[l * S + x];
                    kk += sk[i * S + x] * kl;
                    qk += sq[i * S + x] * kl;
                }
                float d = exp(sg[i] - sg[l]);
                if (l < i) saq[l * CMAX + i] = sb[i] * kk * d;
                saq[i * CMAX + l] = qk * d;
            }
        }
        barrier();
        if (live) {
            // M k_i (into V') and e^G_i M q_i (into out) of the chunk-start state, four tokens
            // per pass over the state row (a private array indexed at run time: the costly
            // reads); the rows past cn are zeros, their results unused.
            for (uint i = 0; i < cn; i += 4) {
                float k0 = 0.0, k1 = 0.0, k2 = 0.0, k3 = 0.0, q0 = 0.0, q1 = 0.0, q2 = 0.0, q3 = 0.0;
                for (uint x = 0; x < S; ++x) {
                    float mx = m[x];
                    uint e = i * S + x;
                    k0 += mx * sk[e];
                    k1 += mx * sk[e + S];
                    k2 += mx * sk[e + 2 * S];
                    k3 += mx * sk[e + 3 * S];
                    q0 += mx * sq[e];
                    q1 += mx * sq[e + S];
                    q2 += mx * sq[e + 2 * S];
                    q3 += mx * sq[e + 3 * S];
                }
                uint e = i * S + j, oo = p.o_off + ((c0 + i) * p.hv + h) * S + j, os = p.hv * S;
                sv[e] = k0; sv[e + S] = k1; sv[e + 2 * S] = k2; sv[e + 3 * S] = k3;
                if (i < cn) o[oo] = exp(sg[i]) * q0;
                if (i + 1 < cn) o[oo + os] = exp(sg[i + 1]) * q1;
                if (i + 2 < cn) o[oo + 2 * os] = exp(sg[i + 2]) * q2;
                if (i + 3 < cn) o[oo + 3 * os] = exp(sg[i + 3]) * q3;
            }
            for (uint i = 0; i < cn; ++i) {
                float v = cv[p.c_off + (c0 + i) * C + 2 * p.hk * S + h * S + j];
                float r = sb[i] * (v - exp(sg[i]) * sv[i * S + j]);
                for (uint l = 0; l < i; ++l) r -= saq[l * CMAX + i] * sv[l * S + j];
                sv[i * S + j] = r;
            }
            for (uint i = 0; i < cn; ++i) {
                uint oo = p.o_off + ((c0 + i) * p.hv + h) * S + j;
                float acc = o[oo];
                for (uint l = 0; l <= i; ++l) acc += saq[i * CMAX + l] * sv[l * S + j];
                o[oo] = acc;
            }
            float gl = sg[cn - 1];
            for (uint l = 0; l < cp; ++l) sv[l * S + j] = l < cn ? sv[l * S + j] * exp(gl - sg[l]) : 0.0;
            float dl = exp(gl);
            for (uint l = 0; l < cn; l += 4) {
                float w0 = sv[l * S + j], w1 = sv[(l + 1) * S + j], w2 = sv[(l + 2) * S + j], w3 = sv[(l + 3) * S + j];
                float d = l == 0 ? dl : 1.0;
                for (uint x = 0; x < S; ++x) {
                    uint e = l * S + x;
                    m[x] = d * m[x] + w0 * sk[e] + w1 * sk[e + S] + w2 * sk[e + 2 * S] + w3 * sk[e + 3 * S];
                }
            }
        }
        barrier();   // the tiles are rewritten by the next chunk
    }
    if (live) {
        for (uint i = 0; i < S; ++i) st[base + i] = m[i];
    }
}
