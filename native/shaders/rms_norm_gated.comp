// The gated RMSNorm of a Gated DeltaNet layer's output (llama.cpp's build_norm_gated): per row
// of `width` floats (a value head's S outputs of a token),
//   y[r] = silu(z[r]) * (x[r] / sqrt(mean(x[r]^2) + eps) * w),   silu(g) = g / (1 + e^-g)
// w: f32 [width] (ssm_norm), z rows as x's (the layer's attn_gate projection).  rms_norm.comp
// then silu_mul.comp in one dispatch, the same operations in the same order (the same bits):
// the layer's one barrier and dispatch fewer, the rows read once.  One work group per row
// (rms_row.glsl), of 32 invocations: a row is 128 floats (32 vec4s) in the models.  y may be x
// (each invocation reads its elements before writing them); z must not alias y.
#version 450
#extension GL_GOOGLE_include_directive : require
layout(local_size_x = 32) in;
#define WG 32u

layout(std430, set = 0, binding = 0) readonly buffer Input { float x[]; };
layout(std430, set = 0, binding = 0) readonly buffer Input4 { vec4 x4[]; };
layout(std430, set = 0, binding = 1) readonly buffer Weight { float w[]; };
layout(std430, set = 0, binding = 1) readonly buffer Weight4 { vec4 w4[]; };
layout(std430, set = 0, binding = 2) readonly buffer Gate { float z[]; };
layout(std430, set = 0, binding = 2) readonly buffer Gate4 { vec4 z4[]; };
layout(std430, set = 0, binding = 3) buffer Output { float y[]; };
layout(std430, set = 0, binding = 3) buffer Output4 { vec4 y4[]; };

layout(push_constant) uniform Params {
    uint width;
    uint n_rows;
    float eps;
    uint x_off;     // float offsets of row 0 in each binding; rows are width floats apart
    uint w_off;
    uint z_off;
    uint y_off;
} p;

uint zb;   // the row's float offset in z (set before rms_row)
vec4 silu4(vec4 g) { return g / (1.0 + exp(-g)); }
float silu1(float g) { return g / (1.0 + exp(-g)); }
#define OUT4(v, k) (silu4(z4[(zb >> 2) + (k)]) * (v))
#define OUT1(v, c) (silu1(z[zb + (c)]) * (v))
#include "rms_row.glsl"

void main() {
    uint t = gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x;
    if (t >= p.n_rows) {
        return;
    }
    zb = p.z_off + t * p.width;
    // rms_row's vec4 path checks x, a, w and y's offsets; z's is checked here (ab = zb)
    rms_row(p.width, p.eps, p.x_off + t * p.width, zb, p.w_off, p.y_off + t * p.width);
}
