// Decode attention, part 2 of 2: combines attention_split.comp's per-range
// partial softmax states of each head into its output:
//   M = max_s m_s,  L = sum_s exp(m_s - M) l_s,
//   out[h, d] = sum_s exp(m_s - M) acc_s[d] / L
// (empty ranges carry m = -1e30, l = 0 and weigh nothing).  One work group
// per head, a thread per output dimension.
#version 450
layout(local_size_x = 128) in;
#define WG 128u

layout(std430, set = 0, binding = 0) readonly buffer Part { float part[]; };
layout(std430, set = 0, binding = 1) buffer Out { float o[]; };

layout(push_constant) uniform Params {
    uint head_dim;
    uint n_splits;
    uint part_off;  // float offset of the partials in binding 0
    uint o_off;     // float offset of out[0, 0] in binding 1
    uint pad;
} p;

void main() {
    uint h = gl_WorkGroupID.x;
    uint lid = gl_LocalInvocationID.x;
    uint stride = p.head_dim + 2u;
    uint hb = p.part_off + h * p.n_splits * stride;
    float M = -1.0e30;
    for (uint s = 0u; s < p.n_splits; s++) {
        M = max(M, part[hb + s * stride]);
    }
    float L = 0.0;
    for (uint s = 0u; s < p.n_splits; s++) {
        L += exp(part[hb + s * stride] - M) * part[hb + s * stride + 1u];
    }
    for (uint d = lid; d < p.head_dim; d += WG) {
        float a = 0.0;
        for (uint s = 0u; s < p.n_splits; s++) {
            a += exp(part[hb + s * stride] - M) * part[hb + s * stride + 2u + d];
        }
        o[p.o_off + h * p.head_dim + d] = L > 0.0 ? a / L : 0.0;
    }
}
