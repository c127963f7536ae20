// The GELU-gated FFN's middle (Gemma): out[i] = gelu(gate[i]) * up[i], with
// ggml's gelu, the tanh approximation:
//   gelu(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))).
// tanh is written as 1 - 2 / (e^{2z} + 1), which saturates cleanly for large
// |z| (e^{2z} -> inf gives 1, -> 0 gives -1) instead of inf/inf.
// Bindings may alias (out over gate, say).  Same layout as silu_mul.comp.
#version 450
layout(local_size_x = 256) in;

layout(std430, set = 0, binding = 0) readonly buffer Gate { float g[]; };
layout(std430, set = 0, binding = 1) readonly buffer Up { float u[]; };
layout(std430, set = 0, binding = 2) buffer Out { float o[]; };

layout(push_constant) uniform Params {
    uint n;
    uint g_off;  // float offsets in each binding
    uint u_off;
    uint o_off;
} p;

const float SQRT_2_OVER_PI = 0.79788456080286535588;
const float GELU_COEF_A = 0.044715;

void main() {
    uint i = gl_GlobalInvocationID.y * (gl_NumWorkGroups.x * gl_WorkGroupSize.x) + gl_GlobalInvocationID.x;
    if (i < p.n) {
        float a = g[p.g_off + i];
        float z = SQRT_2_OVER_PI * a * (1.0 + GELU_COEF_A * a * a);
        float t = 1.0 - 2.0 / (exp(2.0 * z) + 1.0);
        o[p.o_off + i] = 0.5 * a * (1.0 + t) * u[p.u_off + i];
    }
}
