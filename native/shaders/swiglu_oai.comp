// gpt-oss's clamped SwiGLU (ggml's swiglu_oai): out[i] = g' * sigmoid(alpha g') * (u' + 1),
// g' = min(gate[i], limit), u' = clamp(up[i], -limit, limit).  Bindings may alias.
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
    float alpha;
    float limit;
} p;

void main() {
    uint i = gl_GlobalInvocationID.y * (gl_NumWorkGroups.x * gl_WorkGroupSize.x) + gl_GlobalInvocationID.x;
    if (i < p.n) {
        float a = min(g[p.g_off + i], p.limit);
        float b = clamp(u[p.u_off + i], -p.limit, p.limit);
        o[p.o_off + i] = a / (1.0 + exp(-p.alpha * a)) * (b + 1.0);
    }
}
