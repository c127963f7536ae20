// The residual add and the RMSNorm after it, in one dispatch (decode runs
// two of these pairs per layer; each dispatch and the barrier after it cost
// GPU time of their own):
//   x[t] += a[t];  y[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w
// per token row (rows of `width` floats, contiguous).  One work group per
// row (rms_row.glsl); each thread adds, squares and later scales the same
// elements, so a and y may be the same buffer (the layer's h: the addend,
// then the norm).  x must not alias a or y.
#version 450
#extension GL_GOOGLE_include_directive : require
layout(local_size_x = 256) in;
#define WG 256u
#define ADD_ADDEND

layout(std430, set = 0, binding = 0) buffer X { float x[]; };
layout(std430, set = 0, binding = 0) buffer X4 { vec4 x4[]; };
layout(std430, set = 0, binding = 1) readonly buffer A { float a[]; };
layout(std430, set = 0, binding = 1) readonly buffer A4 { vec4 a4[]; };
layout(std430, set = 0, binding = 2) readonly buffer Weight { float w[]; };
layout(std430, set = 0, binding = 2) readonly buffer Weight4 { vec4 w4[]; };
layout(std430, set = 0, binding = 3) buffer Output { float y[]; };
layout(std430, set = 0, binding = 3) buffer Output4 { vec4 y4[]; };

layout(push_constant) uniform Params {
    uint width;
    uint n_tokens;
    float eps;
    uint x_off;     // float offsets of row 0 in each binding; rows are width floats apart
    uint a_off;
    uint w_off;
    uint y_off;
    uint pad;
} p;

#include "rms_row.glsl"

void main() {
    uint t = gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x;
    if (t >= p.n_tokens) {
        return;
    }
    uint o = t * p.width;
    rms_row(p.width, p.eps, p.x_off + o, p.a_off + o, p.w_off, p.y_off + o);
}
