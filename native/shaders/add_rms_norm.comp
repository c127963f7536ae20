// The residual add and the RMSNorm after it, in one dispatch (decode runs
// two of these pairs per layer; each dispatch and the barrier after it cost
// GPU time of their own):
//   x[t] += a[t];  y[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w
// per token row (rows of `width` floats, contiguous).  One work group per
// row; each thread adds, squares and later scales the same elements, so a
// and y may be the same buffer (the layer's h: the addend, then the norm).
// x must not alias a or y.
#version 450
layout(local_size_x = 256) in;
#define WG 256u

layout(std430, set = 0, binding = 0) buffer X { float x[]; };
layout(std430, set = 0, binding = 1) readonly buffer A { float a[]; };
layout(std430, set = 0, binding = 2) readonly buffer Weight { float w[]; };
layout(std430, set = 0, binding = 3) buffer Output { float y[]; };

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

shared float red[WG];

void main() {
    uint t = gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x;
    if (t >= p.n_tokens) {
        return;
    }
    uint lid = gl_LocalInvocationID.x;
    uint xb = p.x_off + t * p.width, ab = p.a_off + t * p.width, yb = p.y_off + t * p.width;
    float s = 0.0;
    for (uint c = lid; c < p.width; c += WG) {
        float v = x[xb + c] + a[ab + c];
        x[xb + c] = v;
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
    for (uint c = lid; c < p.width; c += WG) {
        y[yb + c] = x[xb + c] * inv * w[p.w_off + c];
    }
}
