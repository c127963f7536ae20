// Gated DeltaNet's short causal convolution, then SiLU, with its rolling state (llama.cpp's
// ggml_ssm_conv + ggml_silu): for each channel c and token t,
//   out[t, c] = silu(sum_j w[c, j] * win_t[j]),  win_t = (the d - 1 inputs before t, x[t, c]),
// tap d - 1 on the current token, the inputs before the first token the state's rows
// (state[r, c], r < d - 1, oldest first).  Afterwards state holds the last d - 1 inputs.
// One invocation per channel walks the tokens in order (d is small: the window is private).
#version 450
layout(local_size_x = 64) in;

layout(std430, set = 0, binding = 0) readonly buffer X { float x[]; };
layout(std430, set = 0, binding = 1) buffer State { float st[]; };
layout(std430, set = 0, binding = 2) readonly buffer W { float w[]; };
layout(std430, set = 0, binding = 3) writeonly buffer Out { float o[]; };

layout(push_constant) uniform Params {
    uint n;        // tokens
    uint c;        // channels (the row length of x, out and state)
    uint d;        // kernel taps, <= MAXD
    uint x_off;    // float offsets in each binding
    uint s_off;
    uint w_off;
    uint o_off;
    uint x_stride; // floats between x's token rows (>= c)
    uint reset;    // 1: the inputs before the first token are zeros (a sequence's start), the state unread
} p;

const uint MAXD = 8;

void main() {
    uint ch = gl_GlobalInvocationID.y * (gl_NumWorkGroups.x * gl_WorkGroupSize.x) + gl_GlobalInvocationID.x;
    if (ch >= p.c) return;
    float win[MAXD];
    float taps[MAXD];
    for (uint j = 0; j < p.d; ++j) taps[j] = w[p.w_off + ch * p.d + j];
    for (uint j = 0; j + 1 < p.d; ++j) win[j] = p.reset != 0 ? 0.0 : st[p.s_off + j * p.c + ch];
    for (uint t = 0; t < p.n; ++t) {
        win[p.d - 1] = x[p.x_off + t * p.x_stride + ch];
        float acc = 0.0;
        for (uint j = 0; j < p.d; ++j) acc += taps[j] * win[j];
        o[p.o_off + t * p.c + ch] = acc / (1.0 + exp(-acc));
        for (uint j = 0; j + 1 < p.d; ++j) win[j] = win[j + 1];
    }
    for (uint j = 0; j + 1 < p.d; ++j) st[p.s_off + j * p.c + ch] = win[j];
}
