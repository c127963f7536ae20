// Final logit soft-capping (Gemma 2, some Gemma 3 conversions):
// out[i] = cap * tanh(a[i] / cap).  tanh as 1 - 2 / (e^{2z} + 1), which
// saturates cleanly for large |z|.  Bindings may alias.  Same layout as
// scale.comp (s = cap).
#version 450
layout(local_size_x = 256) in;

layout(std430, set = 0, binding = 0) readonly buffer A { float a[]; };
layout(std430, set = 0, binding = 1) buffer Out { float o[]; };

layout(push_constant) uniform Params {
    uint n;
    uint a_off;
    uint o_off;
    float s;
} p;

void main() {
    uint i = gl_GlobalInvocationID.y * (gl_NumWorkGroups.x * gl_WorkGroupSize.x) + gl_GlobalInvocationID.x;
    if (i < p.n) {
        float z = a[p.a_off + i] / p.s;
        o[p.o_off + i] = p.s * (1.0 - 2.0 / (exp(2.0 * z) + 1.0));
    }
}
