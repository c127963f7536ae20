// out[i] = a[i] + b[i % b_len]: a residual add (b_len = n) or a bias
// broadcast over token rows (b_len = width).  Bindings may alias.
#version 450
layout(local_size_x = 256) in;

layout(std430, set = 0, binding = 0) readonly buffer A { float a[]; };
layout(std430, set = 0, binding = 1) readonly buffer B { float b[]; };
layout(std430, set = 0, binding = 2) buffer Out { float o[]; };

layout(push_constant) uniform Params {
    uint n;
    uint a_off;  // float offsets in each binding
    uint b_off;
    uint b_len;
    uint o_off;
} p;

void main() {
    uint i = gl_GlobalInvocationID.y * (gl_NumWorkGroups.x * gl_WorkGroupSize.x) + gl_GlobalInvocationID.x;
    if (i < p.n) {
        o[p.o_off + i] = a[p.a_off + i] + b[p.b_off + i % p.b_len];
    }
}
