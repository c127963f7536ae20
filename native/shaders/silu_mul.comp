// The SiLU-gated FFN's middle: out[i] = silu(gate[i]) * up[i], silu(g) = g / (1 + e^-g).
// Bindings may alias (out over gate, say).
#version 450
layout(local_size_x = 256) in;

layout(std430, set = 0, binding = 0) readonly buffer Gate { float g[]; };
layout(std430, set = 0, binding = 1) readonly buffer Up { float u[]; };
layout(std430, set = 0, binding = 2) buffer Out { float o[]; };

layout(push_constant) uniform Params {
    uint n;
    uint g_off;  // float offsets in each binding
    uint u_off;
    uint o_off;
} p;

void main() {
    uint i = gl_GlobalInvocationID.y * (gl_NumWorkGroups.x * gl_WorkGroupSize.x) + gl_GlobalInvocationID.x;
    if (i < p.n) {
        float a = g[p.g_off + i];
        o[p.o_off + i] = a / (1.0 + exp(-a)) * u[p.u_off + i];
    }
}
