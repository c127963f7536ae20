// out[i] = a[i] * s.  Bindings may alias.
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
        o[p.o_off + i] = a[p.a_off + i] * p.s;
    }
}
