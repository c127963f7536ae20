// out[i] = x[i] * sigmoid(gate[i]): the output gate of Qwen3.5's attention.  Bindings may alias.
#version 450
layout(local_size_x = 256) in;

layout(std430, set = 0, binding = 0) readonly buffer Gate { float g[]; };
layout(std430, set = 0, binding = 1) readonly buffer X { float x[]; };
layout(std430, set = 0, binding = 2) buffer Out { float o[]; };

layout(push_constant) uniform Params {
    uint n;
    uint g_off;  // float offsets in each binding
    uint x_off;
    uint o_off;
} p;

void main() {
    uint i = gl_GlobalInvocationID.y * (gl_NumWorkGroups.x * gl_WorkGroupSize.x) + gl_GlobalInvocationID.x;
    if (i < p.n) {
        o[p.o_off + i] = x[p.x_off + i] / (1.0 + exp(-g[p.g_off + i]));
    }
}
