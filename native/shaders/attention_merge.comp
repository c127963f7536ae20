// Decode attention, part 2 of 2: combines attention_split.comp's per-range
// partial softmax states of each head into its output:
//   M = max_s m_s,  L = sum_s exp(m_s - M) l_s,
//   out[h, d] = sum_s exp(m_s - M) acc_s[d] / L
// (empty ranges carry m = -1e30, l = 0 and weigh nothing).  One work group
// per head; several query tokens (parallel slots' decode): work-group z is the
// token, its partials n_heads * n_splits rows after the one before, its output
// row o_stride floats after.  With has_sink (gpt-oss) the head's sink logit sinks[sink_off + h]
// is one more partial: m = sink, l = 1, acc = 0 (it joins M and L only).
//
// Why this shape: a range is 32 keys, so a long context has many (8192 keys:
// 256).  The first form ran three serial loops over the ranges in every
// thread, each trip a dependent load (6.5 us a layer at 5 ranges on the
// H200, and linear in the ranges).  Here the threads share the ranges: M
// and L are group reductions, the weights exp(m_s - M) of a tile of WG ranges
// go to shared memory once, and each thread sums its output dimensions over
// the tile with UL loads in flight (only the passes k that hold dimensions:
// the loop of the head_dim > 128 passes ran, clamped, for every head).
#version 450
#extension GL_EXT_control_flow_attributes : enable
#extension GL_KHR_shader_subgroup_basic : enable
#extension GL_KHR_shader_subgroup_arithmetic : enable
layout(local_size_x = 128) in;
#define WG 128u
#define MAXD 4u   // output dimensions per thread: head_dim <= 512
#define UL 16u    // partial rows in flight per thread (8: twice the trips at 64 ranges)

layout(std430, set = 0, binding = 0) readonly buffer Part { float part[]; };
layout(std430, set = 0, binding = 1) buffer Out { float o[]; };
layout(std430, set = 0, binding = 2) readonly buffer Sinks { float sinks[]; };

layout(push_constant) uniform Params {
    uint head_dim;
    uint n_splits;
    uint part_off;  // float offset of the partials in binding 0
    uint o_off;     // float offset of out[0, 0] in binding 1
    uint has_sink;  // 1: binding 2 holds a sink logit per head (from sink_off); 0: binding 2 unread
    uint sink_off;
    uint o_stride;  // floats from token t's output row to t + 1's (work-group z)
} p;

shared float red[WG];
shared float wt[WG];

// max (is_max) or sum of v over the work group; every thread gets it.
float group_reduce(float v, bool is_max) {
    float s = is_max ? subgroupMax(v) : subgroupAdd(v);
    if (subgroupElect()) {
        red[gl_SubgroupID] = s;
    }
    barrier();
    float t = red[0];
    for (uint i = 1u; i < gl_NumSubgroups; i++) {
        t = is_max ? max(t, red[i]) : t + red[i];
    }
    barrier();  // red is reused by the next reduction
    return t;
}

void main() {
    uint h = gl_WorkGroupID.x;
    uint lid = gl_LocalInvocationID.x;
    uint stride = p.head_dim + 2u;
    uint t = gl_WorkGroupID.z;
    uint hb = p.part_off + (t * gl_NumWorkGroups.x + h) * p.n_splits * stride;
    float m = -1.0e30;
    for (uint s = lid; s < p.n_splits; s += WG) {
        m = max(m, part[hb + s * stride]);
    }
    float M = group_reduce(m, true);
    float sk = p.has_sink != 0u ? sinks[p.sink_off + h] : -1.0e30;
    M = max(M, sk);
    float l = 0.0;
    for (uint s = lid; s < p.n_splits; s += WG) {
        l += exp(part[hb + s * stride] - M) * part[hb + s * stride + 1u];
    }
    float L = group_reduce(l, false) + (p.has_sink != 0u ? exp(sk - M) : 0.0);
    float a[MAXD];
    [[unroll]] for (uint k = 0u; k < MAXD; k++) {
        a[k] = 0.0;
    }
    for (uint base = 0u; base < p.n_splits; base += WG) {
        uint n = min(WG, p.n_splits - base);
        wt[lid] = lid < n ? exp(part[hb + (base + lid) * stride] - M) : 0.0;
        barrier();
        [[unroll]] for (uint k = 0u; k < MAXD; k++) {
            if (k * WG >= p.head_dim) {
                break;   // uniform: no thread has dimensions there (head_dim <= 128: one pass)
            }
            uint d = min(lid + k * WG, p.head_dim - 1u);  // clamped; written only where valid
            for (uint i0 = 0u; i0 < n; i0 += UL) {
                float v[UL];
                [[unroll]] for (uint u = 0u; u < UL; u++) {
                    v[u] = part[hb + (base + min(i0 + u, n - 1u)) * stride + 2u + d];
                }
                [[unroll]] for (uint u = 0u; u < UL; u++) {
                    a[k] += i0 + u < n ? wt[i0 + u] * v[u] : 0.0;
                }
            }
        }
        barrier();  // wt is rewritten by the next tile
    }
    [[unroll]] for (uint k = 0u; k < MAXD; k++) {
        uint d = lid + k * WG;
        if (d < p.head_dim) {
            o[p.o_off + t * p.o_stride + h * p.head_dim + d] = L > 0.0 ? a[k] / L : 0.0;
        }
    }
}
