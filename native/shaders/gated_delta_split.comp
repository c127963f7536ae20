// The gated delta rule's split form: gated_delta.comp's numbers (its header has the rule), with
// each value head's state spread over several work groups.  Work group x = h * NB + b holds rows
// [b ROWS, (b + 1) ROWS) of head h's M (value row j, key column i; NB = ceil(S / ROWS)); a row
// is LANES invocations', invocation l keeping M[j][i] for i = l, l + LANES, ... (EPT floats) in
// registers.  Rows are independent (M k and M q are per-row dot products over the key
// dimension), so a work group needs only its rows' v and the key head's whole q and k, which
// each group loads and l2-normalises itself (S floats each, against the S x ROWS state floats it
// moves).  The row's dot products are LANES partial sums added in shared memory in lane order,
// so every lane of a row gets the same bits; they add in another order than gated_delta's one
// running sum over i, the only difference from it (f32 rounding: tests/engine/
// test_deltanet_kernels.py holds the two to each other).
// seq_state > 0: work-group y is token t, of sequence seq_ids[seq_off + t] (gated_delta's).
//
// Why: the reference form is one work group of S invocations per value head, each walking its
// whole state row: a decode step's layer is 48 work groups (Qwen3.5-27B: 48 heads of 128) on
// the H200's 132 SMs, 4 warps each, every warp-wide state load touching 32 rows 512 bytes
// apart, and its loops over the row run to the push constant S (m[] indexed at run time:
// local memory to a compiler that does not unroll them).  Here 48 x 8 = 384 groups of 4 warps,
// LANES = 8 consecutive invocations read 8 consecutive floats of a row (each load a whole
// 32-byte sector, the state read once and written once), and every loop over a row's floats
// runs to the constant EPT, unrolled: m[] stays in registers.  On lavapipe this form is 2x
// slower (vramd/engine/deltanet.py split_form): CPU devices keep gated_delta.
#version 450
#extension GL_EXT_control_flow_attributes : enable
#extension GL_KHR_shader_subgroup_basic : enable
#extension GL_KHR_shader_subgroup_arithmetic : enable
layout(local_size_x = 128) in;
#define WG 128u
#define LANES 8u              // invocations of one state row
#define ROWS (WG / LANES)     // state rows of a work group
#define MAXS 128u             // head size: at most WG (one q and k element an invocation)
#define EPT (MAXS / LANES)    // state floats an invocation holds

layout(std430, set = 0, binding = 0) readonly buffer Conv { float cv[]; };
layout(std430, set = 0, binding = 1) readonly buffer Alpha { float al[]; };
layout(std430, set = 0, binding = 2) readonly buffer Beta { float be[]; };
layout(std430, set = 0, binding = 3) readonly buffer Dt { float dt[]; };
layout(std430, set = 0, binding = 4) readonly buffer A { float av[]; };
layout(std430, set = 0, binding = 5) buffer State { float st[]; };
layout(std430, set = 0, binding = 6) writeonly buffer Out { float o[]; };
layout(std430, set = 0, binding = 7) readonly buffer Seq { int seq_ids[]; };

layout(push_constant) uniform Params {   // gated_delta.comp's, field for field
    uint n;
    uint s;
    uint hk;
    uint hv;
    float eps;
    uint c_off;
    uint al_off;
    uint be_off;
    uint dt_off;
    uint a_off;
    uint s_off;
    uint o_off;
    uint reset;
    uint seq_off;
    uint seq_state;
} p;

shared float sq[MAXS];
shared float sk[MAXS];
shared float nq[WG];      // per-subgroup sums of q^2 and k^2 (at most WG subgroups)
shared float nk[WG];
shared float rmk[WG];     // per-invocation partials of M k, then of M q
shared float rmq[WG];

void main() {
    uint S = p.s, nb = (S + ROWS - 1u) / ROWS;
    uint h = gl_WorkGroupID.x / nb, b = gl_WorkGroupID.x % nb;
    uint tid = gl_LocalInvocationID.x, r = tid / LANES, l = tid % LANES;
    uint j = b * ROWS + r;                       // this invocation's value row
    uint C = 2u * p.hk * S + p.hv * S, kh = h % p.hk;
    bool live = j < S;
    uint t0 = 0u, t1 = p.n, sb = p.s_off;
    if (p.seq_state > 0u) {
        t0 = gl_WorkGroupID.y;
        t1 = t0 + 1u;
        sb += uint(seq_ids[p.seq_off + t0]) * p.seq_state;
    }
    uint base = sb + (h * S + j) * S;
    float m[EPT];
    [[unroll]] for (uint e = 0u; e < EPT; e++) {
        uint i = l + e * LANES;
        m[e] = live && i < S && p.reset == 0u ? st[base + i] : 0.0;
    }
    float inv_sqrt_s = 1.0 / sqrt(float(S));
    for (uint t = t0; t < t1; ++t) {
        uint row = p.c_off + t * C;
        bool in_s = tid < S;
        float qj = in_s ? cv[row + kh * S + tid] : 0.0;
        float kj = in_s ? cv[row + p.hk * S + kh * S + tid] : 0.0;
        float vj = live ? cv[row + 2u * p.hk * S + h * S + j] : 0.0;
        float x = al[p.al_off + t * p.hv + h] + dt[p.dt_off + h];
        float g = (x > 20.0 ? x : log(1.0 + exp(x))) * av[p.a_off + h];
        float beta = 1.0 / (1.0 + exp(-be[p.be_off + t * p.hv + h]));
        float s2q = subgroupAdd(qj * qj), s2k = subgroupAdd(kj * kj);
        if (subgroupElect()) {
            nq[gl_SubgroupID] = s2q;
            nk[gl_SubgroupID] = s2k;
        }
        barrier();
        float tq = 0.0, tk = 0.0;
        for (uint i = 0u; i < gl_NumSubgroups; i++) {
            tq += nq[i];
            tk += nk[i];
        }
        float qn = max(sqrt(tq), p.eps), kn = max(sqrt(tk), p.eps);
        sq[tid] = qj / qn * inv_sqrt_s;   // zero past S: the padded m[e] and these meet as 0 x 0
        sk[tid] = kj / kn;
        barrier();
        float decay = exp(g), mk = 0.0;
        [[unroll]] for (uint e = 0u; e < EPT; e++) {
            m[e] *= decay;
            mk += m[e] * sk[l + e * LANES];
        }
        rmk[tid] = mk;
        barrier();
        mk = 0.0;
        [[unroll]] for (uint i = 0u; i < LANES; i++) {
            mk += rmk[r * LANES + i];
        }
        float u = beta * (vj - mk);
        float acc = 0.0;
        [[unroll]] for (uint e = 0u; e < EPT; e++) {
            float ki = sk[l + e * LANES];
            m[e] += u * ki;
            acc += m[e] * sq[l + e * LANES];
        }
        rmq[tid] = acc;
        barrier();
        if (live && l == 0u) {
            acc = 0.0;
            [[unroll]] for (uint i = 0u; i < LANES; i++) {
                acc += rmq[r * LANES + i];
            }
            o[p.o_off + (t * p.hv + h) * S + j] = acc;
        }
        barrier();   // sq, sk, nq/nk, rmk and rmq are rewritten by the next token
    }
    [[unroll]] for (uint e = 0u; e < EPT; e++) {
        uint i = l + e * LANES;
        if (live && i < S) {
            st[base + i] = m[e];
        }
    }
}
