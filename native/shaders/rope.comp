// Rotary position embedding, in place, on x laid out [tokens, heads, head_dim]
// (f32) with the position of each token from an int32 buffer (so a recorded
// decode graph can be replayed at the next position).
//
// For pair i < n_rot / 2: theta = pos * freq_scale * freq_base^(-2i / n_rot),
// divided by freq_factors[i] when given (llama 3.1's rope_freqs tensor).
// Normal ordering rotates (x[2i], x[2i+1]); NeoX rotates (x[i], x[i + n_rot/2]).
// Dimensions from n_rot on are left alone.  theta is reduced to [-pi, pi)
// before cos/sin: a GPU's sin/cos are only accurate there.
//
// Scalings, as ggml's rope_yarn: with ext_factor != 0 (YaRN) pair i mixes the
// interpolated angle (times freq_scale) with the extrapolated one (without),
// mix = ext_factor * (1 - clamp((i - corr_lo) / max(0.001, corr_hi - corr_lo), 0, 1));
// the rotated pair is multiplied by mscale (YaRN's and LongRoPE's magnitude,
// computed on the host: vramd/engine/arch/spec.py RopeScaling).  temp_scale
// > 0 (q only; llama 4 / mistral3 attention temperature, n_rot = head_dim)
// also multiplies it by 1 + temp_scale * ln(floor((pos + temp_offset) /
// temp_floor) + 1).
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
    float ext_factor;
    float corr_lo;
    float corr_hi;
    float mscale;
    float temp_scale;
    float temp_floor;
    float temp_offset;
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
    float fpos = float(pos[p.pos_off + t]);
    float scale = p.freq_scale;
    if (p.ext_factor != 0.0) {
        float y = (float(k) - p.corr_lo) / max(0.001, p.corr_hi - p.corr_lo);
        float mix = (1.0 - min(1.0, max(0.0, y))) * p.ext_factor;
        scale = p.freq_scale * (1.0 - mix) + mix;
    }
    float theta = fpos * scale * inv_freq;
    theta -= TWO_PI * floor(theta / TWO_PI + 0.5);
    float m = p.mscale;
    if (p.temp_scale != 0.0) {
        m *= 1.0 + p.temp_scale * log(floor((fpos + p.temp_offset) / p.temp_floor) + 1.0);
    }
    float c = cos(theta) * m, s = sin(theta) * m;
    uint base = p.x_off + t * p.t_stride + h * p.head_dim;
    uint a = base + (p.neox != 0u ? k : 2u * k);
    uint b = a + (p.neox != 0u ? half_rot : 1u);
    float x0 = x[a], x1 = x[b];
    x[a] = x0 * c - x1 * s;
    x[b] = x0 * s + x1 * c;
}
