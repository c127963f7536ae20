// out[i] = x[i] * sigmoid(gate[i]): the output gate of Qwen3.5's attention.  Bindings may alias.
// The gate's element i is g[g_off + (i / g_run) * g_stride + i % g_run]: runs of g_run floats
// g_stride apart (g_run = g_stride = 1: contiguous), so that the gate is read where the
// projection left it, each head's hd gate rows after its hd query rows (no qgate_split copy).
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
    uint g_run;
    uint g_stride;
} p;

void main() {
    uint i = gl_GlobalInvocationID.y * (gl_NumWorkGroups.x * gl_WorkGroupSize.x) + gl_GlobalInvocationID.x;
    if (i < p.n) {
        float gate = g[p.g_off + (i / p.g_run) * p.g_stride + i % p.g_run];
        o[p.o_off + i] = x[p.x_off + i] / (1.0 + exp(-gate));
    }
}
