// RMSNorm per token row: y = x / sqrt(mean(x^2) + eps) * w (w: f32 [width]).
// One work group per row; a shared-memory tree sums the squares.  x and y
// may be the same buffer (each thread reads its elements before writing them).
#version 450
layout(local_size_x = 256) in;
#define WG 256u

layout(std430, set = 0, binding = 0) readonly buffer Input { float x[]; };
layout(std430, set = 0, binding = 1) readonly buffer Weight { float w[]; };
layout(std430, set = 0, binding = 2) buffer Output { float y[]; };

layout(push_constant) uniform Params {
    uint width;
    uint n_tokens;
    float eps;
    uint x_off;     // float offsets and row strides of each binding
    uint x_stride;
    uint w_off;
    uint y_off;
    uint y_stride;
} p;

shared float red[WG];

void main() {
    uint t = gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x;
    if (t >= p.n_tokens) {
        return;
    }
    uint lid = gl_LocalInvocationID.x;
    uint xb = p.x_off + t * p.x_stride;
    float s = 0.0;
    for (uint c = lid; c < p.width; c += WG) {
        float v = x[xb + c];
        s += v * v;
    }
    red[lid] = s;
    barrier();
    for (uint k = WG / 2u; k > 0u; k >>= 1) {
        if (lid < k) {
            red[lid] += red[lid + k];
        }
        barrier();
    }
    float inv = inversesqrt(red[0] / float(p.width) + p.eps);
    uint yb = p.y_off + t * p.y_stride;
    for (uint c = lid; c < p.width; c += WG) {
        y[yb + c] = x[xb + c] * inv * w[p.w_off + c];
    }
}
