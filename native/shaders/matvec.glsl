// Y[t, r] = sum_c W[r, c] * X[t, c] in f32, W dequantized on the fly (see
// dequant.glsl); included by matvec_<type>.comp.
//
// One work group of WG threads per weight row; the threads stride over the
// row's columns (quantized: one word of a block's quants per thread at a
// time, UNROLL of them per loop trip, loaded before any is used so the
// loads overlap) and subgroup
// adds plus one shared-memory step sum their partial dot products (subgroup
// arithmetic: lavapipe and NVIDIA both have it, Ops checks).  TT tokens
// share one read of the row (work-group z is the tile of tokens);
// matvec_<type>.comp uses TT = 1 (decode: several tokens run as several z
// groups); prefill uses matmul.glsl.  Loops over the tile have constant
// bounds and no branches (a partial tile recomputes its last token), so they
// unroll and the accumulators stay in registers.  Rows run over a 2-D grid
// (x + y * width) because a grid dimension may stop at 65535 and a
// vocabulary is larger.
#extension GL_EXT_control_flow_attributes : enable
#extension GL_KHR_shader_subgroup_basic : enable
#extension GL_KHR_shader_subgroup_arithmetic : enable
layout(local_size_x = 128) in;
#define WG 128u
#define UNROLL 8u  // independent weight loads in flight per thread (memory latency)
#ifndef TT
#define TT 1u
#endif

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
    uint xrow[TT];
    float acc[TT];
    [[unroll]] for (uint k = 0u; k < TT; k++) {
        acc[k] = 0.0;
        xrow[k] = p.x_off + (t0 + min(k, nt - 1u)) * p.x_stride;
    }
    uint rowb = p.w_off + row * ROW_BYTES(p.cols);
#ifdef QUANT
    // Each thread takes one word of a block's quants at a time (Q8_0: 8 per
    // block, Q4_0: 4), so neighbouring threads read neighbouring weight words
    // and neighbouring x values (coalesced); the scale is a shared read.
#if defined(TYPE_Q8_0)
    const uint WPB = 8u;
#else
    const uint WPB = 4u;
#endif
    uint units = (p.cols >> 5) * WPB;
    for (uint u0 = lid; u0 < units; u0 += UNROLL * WG) {
        // All loads of the trip first (indices clamped, so unconditional and
        // independent), then the arithmetic: UNROLL loads in flight.
        uint qw[UNROLL];
        float dd[UNROLL];
        [[unroll]] for (uint un = 0u; un < UNROLL; un++) {
            uint u = min(u0 + un * WG, units - 1u);
            uint b = rowb + (u / WPB) * BLOCK_BYTES;
            dd[un] = w_f16(b);
            qw[un] = w_u32a2(b + 2u + 4u * (u % WPB));
        }
        [[unroll]] for (uint un = 0u; un < UNROLL; un++) {
            uint u = u0 + un * WG;
            if (u < units) {
                uint c = ((u / WPB) << 5) + 4u * (u % WPB);
                float d = dd[un];
#if defined(TYPE_Q8_0)
                int q = int(qw[un]);
                vec4 v = vec4(bitfieldExtract(q, 0, 8), bitfieldExtract(q, 8, 8), bitfieldExtract(q, 16, 8),
                              bitfieldExtract(q, 24, 8));
                [[unroll]] for (uint k = 0u; k < TT; k++) {
                    uint xb = xrow[k] + c;
                    acc[k] += d * dot(v, vec4(x[xb], x[xb + 1u], x[xb + 2u], x[xb + 3u]));
                }
#else  // Q4_0: word i holds elements 4i..4i+3 (low nibbles) and 16+4i.. (high)
                uint q = qw[un];
                vec4 lo = vec4(q & 15u, (q >> 8) & 15u, (q >> 16) & 15u, (q >> 24) & 15u) - 8.0;
                vec4 hi = vec4((q >> 4) & 15u, (q >> 12) & 15u, (q >> 20) & 15u, (q >> 28) & 15u) - 8.0;
                [[unroll]] for (uint k = 0u; k < TT; k++) {
                    uint xb = xrow[k] + c;
                    acc[k] += d * (dot(lo, vec4(x[xb], x[xb + 1u], x[xb + 2u], x[xb + 3u]))
                                   + dot(hi, vec4(x[xb + 16u], x[xb + 17u], x[xb + 18u], x[xb + 19u])));
                }
#endif
            }
        }
    }
#elif defined(TYPE_F16) || defined(TYPE_BF16)
    // Two halves (one word, at an even byte offset) per thread at a time, so
    // a subgroup's loads are contiguous; an odd last column goes to thread 0.
    uint pairs = p.cols >> 1;
    for (uint j0 = lid; j0 < pairs; j0 += UNROLL * WG) {
        uint qw[UNROLL];  // loads first, as above
        [[unroll]] for (uint un = 0u; un < UNROLL; un++) {
            qw[un] = w_u32a2(rowb + 4u * min(j0 + un * WG, pairs - 1u));
        }
        [[unroll]] for (uint un = 0u; un < UNROLL; un++) {
            uint j = j0 + un * WG;
            if (j < pairs) {
                uint q = qw[un];
#if defined(TYPE_F16)
                vec2 v = unpackHalf2x16(q);
#else
                vec2 v = vec2(uintBitsToFloat(q << 16), uintBitsToFloat(q & 0xFFFF0000u));
#endif
                [[unroll]] for (uint k = 0u; k < TT; k++) {
                    uint xb = xrow[k] + 2u * j;
                    acc[k] += dot(v, vec2(x[xb], x[xb + 1u]));
                }
            }
        }
    }
    if ((p.cols & 1u) != 0u && lid == 0u) {
        float v = elem(rowb, p.cols - 1u);
        [[unroll]] for (uint k = 0u; k < TT; k++) {
            acc[k] += v * x[xrow[k] + p.cols - 1u];
        }
    }
#else
    for (uint c0 = lid; c0 < p.cols; c0 += UNROLL * WG) {
        float wv[UNROLL];  // loads first, as above
        [[unroll]] for (uint un = 0u; un < UNROLL; un++) {
            wv[un] = elem(rowb, min(c0 + un * WG, p.cols - 1u));
        }
        [[unroll]] for (uint un = 0u; un < UNROLL; un++) {
            uint c = c0 + un * WG;
            if (c < p.cols) {
                [[unroll]] for (uint k = 0u; k < TT; k++) {
                    acc[k] += wv[un] * x[xrow[k] + c];
                }
            }
        }
    }
#endif
    // Sum within each subgroup, then the subgroups' partials through shared
    // memory: one barrier per row.
    [[unroll]] for (uint k = 0u; k < TT; k++) {
        float sum = subgroupAdd(acc[k]);
        if (subgroupElect()) {
            red[k * WG + gl_SubgroupID] = sum;
        }
    }
    barrier();
    if (lid < nt) {
        float sum = 0.0;
        for (uint i = 0u; i < gl_NumSubgroups; i++) {
            sum += red[lid * WG + i];
        }
        y[p.y_off + (t0 + lid) * p.y_stride + row] = sum;
    }
}
