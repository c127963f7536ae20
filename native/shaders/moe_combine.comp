// The end of a mixture-of-experts FFN, into the residual stream:
//   x[t, i] += sum_j w[t, j] * down[t * k + j, i]
//            (+ sigmoid(g[t]) * shared[t, i]   with a shared expert, qwen2moe)
// or, with flags bit 1, x[t, i] = the sum (gemma4 norms the experts' output on its own)
// w: the routing weights moe_route.comp wrote; down: matvec_id's output, a
// row per slot; g: the shared expert's gate logit (a one-row matvec).  The
// weights are read on the GPU, so the step needs no readback.  A thread per
// element of x; the k slots are summed in order j = 0 .. k-1.
#version 450
layout(local_size_x = 256) in;

layout(std430, set = 0, binding = 0) buffer X { float x[]; };
layout(std430, set = 0, binding = 1) readonly buffer Down { float down[]; };
layout(std430, set = 0, binding = 2) readonly buffer W { float w[]; };
layout(std430, set = 0, binding = 3) readonly buffer Shared { float sh[]; };
layout(std430, set = 0, binding = 4) readonly buffer Gate { float g[]; };

layout(push_constant) uniform Params {
    uint width;       // floats per token row of x, down and shared
    uint n_tokens;
    uint k;           // slots per token
    uint x_off;       // float offsets in each binding
    uint d_off;
    uint w_off;
    uint s_off;
    uint g_off;
    uint flags;       // bit 0: a shared expert (else bindings 3 and 4 are not read);
                      // bit 1: x = the sum instead of x += (gemma4: the experts' own buffer)
} p;

void main() {
    uint i = gl_GlobalInvocationID.y * (gl_NumWorkGroups.x * gl_WorkGroupSize.x) + gl_GlobalInvocationID.x;
    if (i >= p.n_tokens * p.width) {
        return;
    }
    uint t = i / p.width, c = i % p.width;
    float acc = 0.0;
    for (uint j = 0u; j < p.k; j++) {
        uint slot = t * p.k + j;
        acc += w[p.w_off + slot] * down[p.d_off + slot * p.width + c];
    }
    if ((p.flags & 1u) != 0u) {
        acc += sh[p.s_off + i] / (1.0 + exp(-g[p.g_off + t]));
    }
    if ((p.flags & 2u) != 0u) {
        x[p.x_off + i] = acc;
    } else {
        x[p.x_off + i] += acc;
    }
}
