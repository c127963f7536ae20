// LayerNorm per token row (the ViT's norms):
//   y = (x - mean(x)) / sqrt(var(x) + eps) * w + b
// with the biased variance mean((x - mean)^2), as ggml_norm; w and b are f32
// [width] and each optional (a flag: a norm without weight or bias).
// One work group per row.  Two passes over the row (the mean, then the
// squared deviations from it): no cancellation when |mean| >> std.  x and y
// may be the same buffer (the last pass reads each element before the same
// thread writes it, after every read of the first two passes).
#version 450
layout(local_size_x = 256) in;
#define WG 256u

layout(std430, set = 0, binding = 0) readonly buffer Input { float x[]; };
layout(std430, set = 0, binding = 1) readonly buffer Weight { float w[]; };
layout(std430, set = 0, binding = 2) readonly buffer Bias { float b[]; };
layout(std430, set = 0, binding = 3) buffer Output { float y[]; };

layout(push_constant) uniform Params {
    uint width;
    uint n_tokens;
    float eps;
    uint x_off;     // float offsets and row strides of each binding
    uint x_stride;
    uint w_off;
    uint b_off;
    uint y_off;
    uint y_stride;
    uint has_w;     // 0: no weight (w = 1), binding 1 unread
    uint has_b;     // 0: no bias (b = 0), binding 2 unread
} p;

shared float red[WG];

float reduce_sum(float v, uint lid) {
    red[lid] = v;
    barrier();
    for (uint k = WG / 2u; k > 0u; k >>= 1) {
        if (lid < k) {
            red[lid] += red[lid + k];
        }
        barrier();
    }
    float r = red[0];
    barrier();  // every thread has read red[0] before it is reused
    return r;
}

void main() {
    uint t = gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x;
    if (t >= p.n_tokens) {
        return;  // the whole work group
    }
    uint lid = gl_LocalInvocationID.x;
    uint xb = p.x_off + t * p.x_stride;
    float s = 0.0;
    for (uint c = lid; c < p.width; c += WG) {
        s += x[xb + c];
    }
    float mean = reduce_sum(s, lid) / float(p.width);
    float s2 = 0.0;
    for (uint c = lid; c < p.width; c += WG) {
        float d = x[xb + c] - mean;
        s2 += d * d;
    }
    float inv = inversesqrt(reduce_sum(s2, lid) / float(p.width) + p.eps);
    uint yb = p.y_off + t * p.y_stride;
    for (uint c = lid; c < p.width; c += WG) {
        float v = (x[xb + c] - mean) * inv;
        if (p.has_w != 0u) {
            v *= w[p.w_off + c];
        }
        if (p.has_b != 0u) {
            v += b[p.b_off + c];
        }
        y[yb + c] = v;
    }
}
