// Rotary position embedding, in place, on x laid out [tokens, heads, head_dim]
// (f32) with the position of each token from an int32 buffer (so a recorded
// decode graph can be replayed at the next position).
//
// For pair i < n_rot / 2: theta = pos * freq_scale * freq_base^(-2i / n_rot),
// divided by freq_factors[i] when given (llama 3.1's rope_freqs tensor).
// Normal ordering rotates (x[2i], x[2i+1]); NeoX rotates (x[i], x[i + n_rot/2]).
// Dimensions from n_rot on are left alone.  theta is reduced to [-pi, pi)
// before cos/sin: a GPU's sin/cos are only accurate there.
#version 450
layout(local_size_x = 256) in;

layout(std430, set = 0, binding = 0) buffer X { float x[]; };
layout(std430, set = 0, binding = 1) readonly buffer Pos { int pos[]; };
layout(std430, set = 0, binding = 2) readonly buffer Factors { float ff[]; };

layout(push_constant) uniform Params {
    uint n_tokens;
    uint n_heads;
    uint head_dim;
    uint n_rot;       // rotated dimensions per head (even, <= head_dim)
    uint neox;        // 0: normal ordering, 1: NeoX
    uint x_off;       // float offset of x[0, 0, 0] in binding 0
    uint t_stride;    // floats from token t to t + 1
    uint pos_off;     // int offset of pos[0] in binding 1
    float freq_base;
    float freq_scale;
    uint has_ff;      // 1: divide theta by ff[ff_off + i]
    uint ff_off;
} p;

const float TWO_PI = 6.283185307179586;

void main() {
    uint i = gl_GlobalInvocationID.y * (gl_NumWorkGroups.x * gl_WorkGroupSize.x) + gl_GlobalInvocationID.x;
    uint half_rot = p.n_rot >> 1;
    if (i >= p.n_tokens * p.n_heads * half_rot) {
        return;
    }
    uint k = i % half_rot;
    uint th = i / half_rot;
    uint h = th % p.n_heads;
    uint t = th / p.n_heads;
    float inv_freq = exp2(-2.0 * float(k) / float(p.n_rot) * log2(p.freq_base));
    if (p.has_ff != 0u) {
        inv_freq /= ff[p.ff_off + k];
    }
    float theta = float(pos[p.pos_off + t]) * p.freq_scale * inv_freq;
    theta -= TWO_PI * floor(theta / TWO_PI + 0.5);
    float c = cos(theta), s = sin(theta);
    uint base = p.x_off + t * p.t_stride + h * p.head_dim;
    uint a = base + (p.neox != 0u ? k : 2u * k);
    uint b = a + (p.neox != 0u ? half_rot : 1u);
    float x0 = x[a], x1 = x[b];
    x[a] = x0 * c - x1 * s;
    x[b] = x0 * s + x1 * c;
}
