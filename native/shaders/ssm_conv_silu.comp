// Gated DeltaNet's short causal convolution, then SiLU, with its rolling state (llama.cpp's
// ggml_ssm_conv + ggml_silu): for each channel c and token t,
//   out[t, c] = silu(sum_j w[c, j] * win_t[j]),  win_t = (the d - 1 inputs before t, x[t, c]),
// tap d - 1 on the current token, the inputs before the first token the state's rows
// (state[r, c], r < d - 1, oldest first).  Afterwards state holds the last d - 1 inputs.
// One invocation per channel walks the tokens in order (d is small: the window is private).
// seq_state > 0 (a decode step of parallel slots): work-group z is token t, one token of
// sequence seq[t] = seq_ids[seq_off + t], whose state starts seq[t] * seq_state floats on.
#version 450
layout(local_size_x = 64) in;

layout(std430, set = 0, binding = 0) readonly buffer X { float x[]; };
layout(std430, set = 0, binding = 1) buffer State { float st[]; };
layout(std430, set = 0, binding = 2) readonly buffer W { float w[]; };
layout(std430, set = 0, binding = 3) writeonly buffer Out { float o[]; };
layout(std430, set = 0, binding = 4) readonly buffer Seq { int seq_ids[]; };

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
    uint seq_off;  // int offset of seq[0] in binding 4 (read where seq_state > 0)
    uint seq_state;// floats from one sequence's state to the next; 0: one sequence, every token
} p;

const uint MAXD = 8;

void main() {
    uint ch = gl_GlobalInvocationID.y * (gl_NumWorkGroups.x * gl_WorkGroupSize.x) + gl_GlobalInvocationID.x;
    if (ch >= p.c) return;
    float win[MAXD];
    float taps[MAXD];
    for (uint j = 0; j < p.d; ++j) taps[j] = w[p.w_off + ch * p.d + j];
    uint t0 = 0, t1 = p.n, sb = p.s_off;
    if (p.seq_state > 0) {
        t0 = gl_WorkGroupID.z;
        t1 = t0 + 1;
        sb += uint(seq_ids[p.seq_off + t0]) * p.seq_state;
    }
    for (uint j = 0; j + 1 < p.d; ++j) win[j] = p.reset != 0 ? 0.0 : st[sb + j * p.c + ch];
    for (uint t = t0; t < t1; ++t) {
        win[p.d - 1] = x[p.x_off + t * p.x_stride + ch];
        float acc = 0.0;
        for (uint j = 0; j < p.d; ++j) acc += taps[j] * win[j];
        o[p.o_off + t * p.c + ch] = acc / (1.0 + exp(-acc));
        for (uint j = 0; j + 1 < p.d; ++j) win[j] = win[j + 1];
    }
    for (uint j = 0; j + 1 < p.d; ++j) st[sb + j * p.c + ch] = win[j];
}
