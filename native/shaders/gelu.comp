// Element-wise GELU, out[i] = gelu(x[i]), in the three forms of llama.cpp's
// clip, and SiLU, its fourth FFN activation (a uniform branch on `mode`):
//   0 tanh  (ggml_gelu, FFN_GELU): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
//   1 erf   (ggml_gelu_erf, FFN_GELU_ERF): 0.5 x (1 + erf(x / sqrt(2)))
//   2 quick (ggml_gelu_quick, FFN_GELU_QUICK, CLIP's quick_gelu): x sigmoid(1.702 x)
//   3 silu  (ggml_silu, FFN_SILU): x sigmoid(x)
// GLSL has no erf: 1 + erf(z) is written through erfc, with the Chebyshev
// fit of Numerical Recipes' erfcc (fractional error < 1.2e-7 for every
// z >= 0), erfc(|z|) = t exp(-z^2 + P(t)), t = 1 / (1 + |z|/2), and
//   1 + erf(z) = erfc(-z) = erfc(|z|)      for z < 0 (no cancellation: the
//                                            negative tail keeps its digits)
//              = 2 - erfc(|z|)             for z >= 0.
// The tanh form is computed as x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715
// x^3), since 0.5 (1 + tanh(u)) = 1 / (1 + e^{-2u}) exactly: no 1 + tanh
// cancellation in the negative tail (relative error ~1e-7 there, not 1e-4),
// and, like the other sigmoids, clean saturation for large |u| (e^{-2u} ->
// inf gives -0, -> 0 gives x; no inf/inf).  x and out may alias.
#version 450
layout(local_size_x = 256) in;

layout(std430, set = 0, binding = 0) readonly buffer Input { float x[]; };
layout(std430, set = 0, binding = 1) buffer Out { float o[]; };

layout(push_constant) uniform Params {
    uint n;
    uint x_off;  // float offsets in each binding
    uint o_off;
    uint mode;   // 0 tanh, 1 erf, 2 quick, 3 silu
} p;

const float SQRT_2_OVER_PI = 0.79788456080286535588;
const float GELU_COEF_A = 0.044715;
const float INV_SQRT_2 = 0.70710678118654752440;
const float QUICK_COEF = 1.702;

float erfc_abs(float z) {  // erfc(|z|)
    float a = abs(z);
    float t = 1.0 / (1.0 + 0.5 * a);
    float poly = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (-0.18628806 +
                 t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277))))))));
    return t * exp(-a * a + poly);
}

void main() {
    uint i = gl_GlobalInvocationID.y * (gl_NumWorkGroups.x * gl_WorkGroupSize.x) + gl_GlobalInvocationID.x;
    if (i >= p.n) {
        return;
    }
    float a = x[p.x_off + i];
    float r;
    if (p.mode == 1u) {
        float z = a * INV_SQRT_2;
        float e = erfc_abs(z);
        r = 0.5 * a * (z < 0.0 ? e : 2.0 - e);
    } else if (p.mode >= 2u) {
        r = a / (1.0 + exp((p.mode == 2u ? -QUICK_COEF : -1.0) * a));
    } else {
        float u = SQRT_2_OVER_PI * a * (1.0 + GELU_COEF_A * a * a);
        r = a / (1.0 + exp(-2.0 * u));
    }
    o[p.o_off + i] = r;
}
