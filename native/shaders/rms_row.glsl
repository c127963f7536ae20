// The RMSNorm of one row, shared by rms_norm.comp and add_rms_norm.comp.
//
// Why it is written this way: decode normalises one 4096-float row in a
// single work group, so the kernel is all memory latency.  The first form
// (a strided loop, load-add-store per trip, then a second loop re-reading
// x and w) waited for ~32 dependent round trips to memory: 12-17 us on the
// H200, 8-14 % of a decode step.  Here each thread issues every load it
// needs (its x, its addend, its weights: VPT vec4s each) before using any,
// sums with subgroupAdd, and crosses subgroups through shared memory once.
// Rows wider than WG * VPT * 4 floats, or not 16-byte aligned, take the
// scalar loop (a uniform branch), still correct.
//
// The includer declares x (and x4), w (and w4), y (and y4), and, with
// ADD_ADDEND, a (and a4); it sets WG and calls rms_row().  It may define
// UNIT_WEIGHT as a uniform condition under which w is not read (a norm
// without weight, gemma4's V norm: w taken as 1), and OUT4(v, k) / OUT1(v, c)
// as what is stored for the normed vec4 v of the row's vec4 k / float v of
// its float c (default v itself; rms_norm_gated.comp's gate multiplies it).
#extension GL_EXT_control_flow_attributes : enable
#extension GL_KHR_shader_subgroup_basic : enable
#extension GL_KHR_shader_subgroup_arithmetic : enable
#define VPT 4u  // vec4s per thread held in registers (rows up to WG * 16 floats)
#ifndef UNIT_WEIGHT
#define UNIT_WEIGHT false
#endif
#ifndef OUT4
#define OUT4(v, k) (v)
#define OUT1(v, c) (v)
#endif

shared float red[WG];

// Sum of v over the work group (every thread gets it).
float group_sum(float v) {
    float s = subgroupAdd(v);
    if (subgroupElect()) {
        red[gl_SubgroupID] = s;
    }
    barrier();
    float t = 0.0;
    for (uint i = 0u; i < gl_NumSubgroups; i++) {
        t += red[i];
    }
    return t;
}

// xb, ab, yb, wb: float offsets of the row in x, a, y, w.
void rms_row(uint width, float eps, uint xb, uint ab, uint wb, uint yb) {
    uint lid = gl_LocalInvocationID.x;
    bool vec_ok = (width & 3u) == 0u && width <= WG * VPT * 4u && ((xb | ab | wb | yb) & 3u) == 0u;
    if (vec_ok) {  // uniform: every thread takes the same side
        uint nv = width >> 2;
        vec4 xv[VPT], wv[VPT];
#ifdef ADD_ADDEND
        vec4 av[VPT];
#endif
        [[unroll]] for (uint i = 0u; i < VPT; i++) {
            uint j = min(lid + i * WG, nv - 1u);  // clamped: unconditional, independent loads
            xv[i] = x4[(xb >> 2) + j];
            wv[i] = UNIT_WEIGHT ? vec4(1.0) : w4[(wb >> 2) + j];
#ifdef ADD_ADDEND
            av[i] = a4[(ab >> 2) + j];
#endif
        }
        float s = 0.0;
        [[unroll]] for (uint i = 0u; i < VPT; i++) {
            if (lid + i * WG < nv) {
#ifdef ADD_ADDEND
                xv[i] += av[i];
                x4[(xb >> 2) + lid + i * WG] = xv[i];
#endif
                s += dot(xv[i], xv[i]);
            }
        }
        float inv = inversesqrt(group_sum(s) / float(width) + eps);
        [[unroll]] for (uint i = 0u; i < VPT; i++) {
            if (lid + i * WG < nv) {
                y4[(yb >> 2) + lid + i * WG] = OUT4(xv[i] * inv * wv[i], lid + i * WG);
            }
        }
        return;
    }
    float s = 0.0;
    for (uint c = lid; c < width; c += WG) {
#ifdef ADD_ADDEND
        float v = x[xb + c] + a[ab + c];
        x[xb + c] = v;
#else
        float v = x[xb + c];
#endif
        s += v * v;
    }
    float inv = inversesqrt(group_sum(s) / float(width) + eps);
    for (uint c = lid; c < width; c += WG) {
        y[yb + c] = OUT1(x[xb + c] * inv * (UNIT_WEIGHT ? 1.0 : w[wb + c]), c);
    }
}
