// The gated delta rule of Gated DeltaNet (llama.cpp's build_delta_net_autoregressive, token by
// token; the chunked form computes the same numbers), one work group per value head h.
// conv holds each token's convolved channels [q (H_k S) | k (H_k S) | v (H_v S)]; value head h
// reads key head h % H_k (ggml tiles the repeat).  Per token t:
//   q, k l2-normalised (x / max(|x|, eps)), q scaled by 1/sqrt(S);
//   g = softplus(alpha[t, h] + dt[h]) * a[h] (softplus(x) = x above 20), beta = sigmoid(beta[t, h]);
//   M <- e^g M;  M <- M + beta (v - M k) k^T;  out[t, h] = M q.
// M [S, S] (value row j, key column i) is the state, state[h][j][i] f32, read at the start and
// written back at the end.  Invocation j < S keeps row j of M in registers.
// seq_state > 0 (a decode step of parallel slots): work-group y is token t, one token of
// sequence seq[t] = seq_ids[seq_off + t], whose state starts seq[t] * seq_state floats on.
// The reference form: GPUs take gated_delta_split.comp (these numbers, a head over several work
// groups; vramd/engine/deltanet.py split_form), CPU devices this one.
#version 450
layout(local_size_x = 128) in;

layout(std430, set = 0, binding = 0) readonly buffer Conv { float cv[]; };
layout(std430, set = 0, binding = 1) readonly buffer Alpha { float al[]; };
layout(std430, set = 0, binding = 2) readonly buffer Beta { float be[]; };
layout(std430, set = 0, binding = 3) readonly buffer Dt { float dt[]; };
layout(std430, set = 0, binding = 4) readonly buffer A { float av[]; };
layout(std430, set = 0, binding = 5) buffer State { float st[]; };
layout(std430, set = 0, binding = 6) writeonly buffer Out { float o[]; };
layout(std430, set = 0, binding = 7) readonly buffer Seq { int seq_ids[]; };

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
    uint seq_off;   // int offset of seq[0] in binding 7 (read where seq_state > 0)
    uint seq_state; // floats from one sequence's state to the next; 0: one sequence, every token
} p;

const uint MAXS = 128;
shared float sq[MAXS];
shared float sk[MAXS];
shared float red[2 * MAXS];

void main() {
    uint h = gl_WorkGroupID.x, j = gl_LocalInvocationID.x;
    uint S = p.s, C = 2 * p.hk * S + p.hv * S, kh = h % p.hk;
    bool live = j < S;
    float m[MAXS];
    uint t0 = 0, t1 = p.n, sb = p.s_off;
    if (p.seq_state > 0) {
        t0 = gl_WorkGroupID.y;
        t1 = t0 + 1;
        sb += uint(seq_ids[p.seq_off + t0]) * p.seq_state;
    }
    uint base = sb + (h * S + j) * S;
    for (uint i = 0; i < S; ++i) m[i] = live && p.reset == 0 ? st[base + i] : 0.0;
    float inv_sqrt_s = 1.0 / sqrt(float(S));
    for (uint t = t0; t < t1; ++t) {
        uint row = p.c_off + t * C;
        float qj = live ? cv[row + kh * S + j] : 0.0;
        float kj = live ? cv[row + p.hk * S + kh * S + j] : 0.0;
        red[j] = qj * qj;
        red[MAXS + j] = kj * kj;
        barrier();
        for (uint w = MAXS / 2; w > 0; w >>= 1) {
            if (j < w) {
                red[j] += red[j + w];
                red[MAXS + j] += red[MAXS + j + w];
            }
            barrier();
        }
        float qn = max(sqrt(red[0]), p.eps), kn = max(sqrt(red[MAXS]), p.eps);
        sq[j] = qj / qn * inv_sqrt_s;
        sk[j] = kj / kn;
        barrier();
        float x = al[p.al_off + t * p.hv + h] + dt[p.dt_off + h];
        float g = (x > 20.0 ? x : log(1.0 + exp(x))) * av[p.a_off + h];
        float beta = 1.0 / (1.0 + exp(-be[p.be_off + t * p.hv + h]));
        if (live) {
            float decay = exp(g), mk = 0.0;
            for (uint i = 0; i < S; ++i) {
                m[i] *= decay;
                mk += m[i] * sk[i];
            }
            float u = beta * (cv[row + 2 * p.hk * S + h * S + j] - mk);
            float acc = 0.0;
            for (uint i = 0; i < S; ++i) {
                m[i] += u * sk[i];
                acc += m[i] * sq[i];
            }
            o[p.o_off + (t * p.hv + h) * S + j] = acc;
        }
        barrier();   // sq, sk and red are rewritten by the next token
    }
    if (live) {
        for (uint i = 0; i < S; ++i) st[base + i] = m[i];
    }
}
