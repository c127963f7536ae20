// Y[t, r] = sum_c W[r, c] * X[t, c] in f32, W dequantized on the fly (see
// dequant.glsl); included by matvec_<type>.comp.
//
// One work group of WG threads per weight row; the threads stride over the
// row's columns (quantized: its 32-element blocks) and a shared-memory tree
// sums their partial dot products.  Up to TT tokens share one read of the
// row (work-group z is the tile of tokens), which is the prefill form;
// decode is the same kernel with one token.  Rows run over a 2-D grid
// (x + y * width) because a grid dimension may stop at 65535 and a vocabulary
// is larger.
layout(local_size_x = 128) in;
#define WG 128u
#define TT 8u

layout(std430, set = 0, binding = 0) readonly buffer Weights { uint w[]; };
layout(std430, set = 0, binding = 1) readonly buffer Input { float x[]; };
layout(std430, set = 0, binding = 2) buffer Output { float y[]; };

layout(push_constant) uniform Params {
    uint rows;      // weight rows in this dispatch
    uint cols;      // elements per row (quantized: a multiple of 32)
    uint n_tokens;
    uint w_off;     // byte offset of this dispatch's row 0 in binding 0
    uint x_off;     // float offset of X[0, 0] in binding 1
    uint x_stride;  // floats from X[t, 0] to X[t + 1, 0]
    uint y_off;     // float offset of Y[0, row 0] in binding 2
    uint y_stride;  // floats from Y[t, 0] to Y[t + 1, 0]
} p;

#include "dequant.glsl"

shared float red[TT * WG];

void main() {
    uint row = gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x;
    if (row >= p.rows) {
        return;  // the whole work group: no barrier is left waiting
    }
    uint lid = gl_LocalInvocationID.x;
    uint t0 = gl_WorkGroupID.z * TT;
    uint nt = min(TT, p.n_tokens - t0);
    float acc[TT];
    for (uint k = 0u; k < TT; k++) {
        acc[k] = 0.0;
    }
    uint rowb = p.w_off + row * ROW_BYTES(p.cols);
#ifdef QUANT
    uint nb = p.cols >> 5;
    for (uint blk = lid; blk < nb; blk += WG) {
        float v[32];
        dequant_block(rowb + blk * BLOCK_BYTES, v);
        for (uint k = 0u; k < TT; k++) {
            if (k < nt) {
                uint xb = p.x_off + (t0 + k) * p.x_stride + (blk << 5);
                float s = 0.0;
                for (uint j = 0u; j < 32u; j++) {
                    s += v[j] * x[xb + j];
                }
                acc[k] += s;
            }
        }
    }
#else
    for (uint c = lid; c < p.cols; c += WG) {
        float v = elem(rowb, c);
        for (uint k = 0u; k < TT; k++) {
            if (k < nt) {
                acc[k] += v * x[p.x_off + (t0 + k) * p.x_stride + c];
            }
        }
    }
#endif
    for (uint k = 0u; k < TT; k++) {
        red[k * WG + lid] = acc[k];
    }
    barrier();
    for (uint s = WG / 2u; s > 0u; s >>= 1) {
        if (lid < s) {
            for (uint k = 0u; k < TT; k++) {
                red[k * WG + lid] += red[k * WG + lid + s];
            }
        }
        barrier();
    }
    if (lid < nt) {
        y[p.y_off + (t0 + lid) * p.y_stride + row] = red[lid * WG];
    }
}
