// Mixture-of-experts routing on the GPU, one work group per token: from the
// router's logits (n_expert floats), the k experts of highest softmax
// probability and their weights, as vramd/engine/moe.py's route():
//   p = softmax(logits); ids = the k largest p, by decreasing p, ties: the
//   lower id first (numpy's stable argsort of -p); w = p[ids], divided by
//   their sum when `renormalize` (qwen3moe, mixtral; qwen2moe keeps p), then
//   times a per-expert scale where `scaled` (gemma4's ffn_down_exps.scale: the
//   expert's output times it, the same product moe_combine takes).
// The ids drive matvec_id_<type> (which expert matrix a slot reads) and the
// weights moe_combine, so a decode step needs no readback to route and is
// recorded once and replayed.
//
// Selection is on the logits, not the probabilities: softmax is monotone,
// so the order is the same, but two logits a rounding apart can give the
// same f32 exp() and then a different tie order than route()'s float64 one.
// Expert e's rank is the number of experts before it in that order (higher
// logit, or equal logit and lower id); the experts of rank < k are the
// chosen, and the rank is their slot.  n_expert^2 / WG comparisons (128
// experts: 128 per thread, independent, from shared memory) instead of k
// rounds of an arg-max reduction.  The max and the softmax denominator are
// subgroup reductions.  NaN counts as -inf, so the ranks stay a permutation
// and the ids valid whatever the logits hold.
#version 450
#extension GL_KHR_shader_subgroup_basic : enable
#extension GL_KHR_shader_subgroup_arithmetic : enable
layout(local_size_x = 128) in;
#define WG 128u
#define MAX_EXPERT 1024u  // Ops: ROUTE_MAX_EXPERTS
#define MAX_USED 64u      // Ops: ROUTE_MAX_USED

layout(std430, set = 0, binding = 0) readonly buffer Logits { float logits[]; };
layout(std430, set = 0, binding = 1) buffer Ids { uint ids[]; };
layout(std430, set = 0, binding = 2) buffer Weights { float weights[]; };
layout(std430, set = 0, binding = 3) readonly buffer Scale { float scale[]; };

layout(push_constant) uniform Params {
    uint n_expert;
    uint k;            // experts used per token
    uint n_tokens;
    uint l_off;        // float offset of token 0's logits in binding 0 (rows n_expert apart)
    uint i_off;        // offset of token 0's ids in binding 1 (rows k apart)
    uint w_off;        // float offset of token 0's weights in binding 2 (rows k apart)
    uint renormalize;
    uint scaled;       // 1: each weight times scale[s_off + its expert] (gemma4's ffn_down_exps.scale)
    uint s_off;
    uint pad;
} p;

shared float lg[MAX_EXPERT];
shared uint chosen[MAX_USED];
shared float prob[MAX_USED];
shared float part[WG];  // per-subgroup partial results (at most WG subgroups)

// llama.cpp's build_moe_ffn clamps the sum it divides by (the smallest
// normal f16); the top k of n_expert probabilities sum to at least
// k / n_expert, so it only matters for logits that are not finite.
const float SUM_MIN = 6.103515625e-5;

// The max / the sum of v over the work group, the same value in every
// thread: a subgroup reduction, then the subgroups' results in shared
// memory, read back in one order.
float group_max(float v) {
    v = subgroupMax(v);
    if (subgroupElect()) {
        part[gl_SubgroupID] = v;
    }
    barrier();
    float r = part[0];
    for (uint i = 1u; i < gl_NumSubgroups; i++) {
        r = max(r, part[i]);
    }
    barrier();  // part[] is reused
    return r;
}

float group_sum(float v) {
    v = subgroupAdd(v);
    if (subgroupElect()) {
        part[gl_SubgroupID] = v;
    }
    barrier();
    float r = 0.0;
    for (uint i = 0u; i < gl_NumSubgroups; i++) {
        r += part[i];
    }
    return r;
}

void main() {
    uint t = gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x;
    if (t >= p.n_tokens) {
        return;  // the whole group: uniform
    }
    uint n = p.n_expert, tid = gl_LocalInvocationID.x;
    const float NEG_INF = uintBitsToFloat(0xFF800000u);
    float m = NEG_INF;
    for (uint e = tid; e < n; e += WG) {
        float v = logits[p.l_off + t * n + e];
        v = isnan(v) ? NEG_INF : v;
        lg[e] = v;
        m = max(m, v);
    }
    m = group_max(m);   // its barrier also makes lg[] visible to every thread
    float s = 0.0;
    for (uint e = tid; e < n; e += WG) {
        s += exp(lg[e] - m);
    }
    s = group_sum(s);
    for (uint e = tid; e < n; e += WG) {
        float v = lg[e];
        uint rank = 0u;
        for (uint f = 0u; f < n; f++) {
            float u = lg[f];
            rank += (u > v || (u == v && f < e)) ? 1u : 0u;
        }
        if (rank < p.k) {
            chosen[rank] = e;
            prob[rank] = exp(v - m) / s;
        }
    }
    barrier();
    if (tid < p.k) {
        float w = prob[tid];
        if (p.renormalize != 0u) {
            float z = 0.0;
            for (uint j = 0u; j < p.k; j++) {
                z += prob[j];
            }
            w /= max(z, SUM_MIN);
        }
        if (p.scaled != 0u) {
            w *= scale[p.s_off + chosen[tid]];
        }
        ids[p.i_off + t * p.k + tid] = chosen[tid];
        weights[p.w_off + t * p.k + tid] = w;
    }
}
