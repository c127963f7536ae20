// rope.comp and kv_write.comp in one dispatch, for K: rotates the rows of x
// ([tokens, heads, head_dim] f32, left as they are) and writes them to the
// f16 cache at their positions: cache[pos[t], :] = f16(rope(x[t, :])).  The
// attention reads K only from the cache, so the rotated K need not be
// stored in x; this saves a dispatch and the barrier between the two.
//
// One thread per cache word (two adjacent dimensions 2w, 2w + 1 of a head).
// The rotation is rope.comp's, to the bit: pair i < n_rot / 2 at theta = pos
// * freq_scale * freq_base^(-2i / n_rot) (/ freq_factors[i]), reduced to
// [-pi, pi); normal ordering pairs (2i, 2i+1), NeoX (i, i + n_rot/2);
// dimensions from n_rot on are copied; the YaRN mix and the magnitude
// mscale as rope.comp's (no temperature: it scales q only).  Positions
// outside 0 .. ctx-1 are skipped; seq_rows > 0: each token's row in its
// sequence's rows, seq[t] = pos[seq_off + t] (kv_write.comp).
#version 450
layout(local_size_x = 256) in;

layout(std430, set = 0, binding = 0) readonly buffer X { float x[]; };
layout(std430, set = 0, binding = 1) readonly buffer Pos { int pos[]; };
layout(std430, set = 0, binding = 2) readonly buffer Factors { float ff[]; };
layout(std430, set = 0, binding = 3) buffer Cache { uint cache[]; };

layout(push_constant) uniform Params {
    uint n_tokens;
    uint n_heads;
    uint head_dim;    // even
    uint n_rot;       // rotated dimensions per head (even, <= head_dim)
    uint neox;        // 0: normal ordering, 1: NeoX
    uint x_off;       // float offset of x[0, 0, 0] in binding 0
    uint t_stride;    // floats from token t to t + 1
    uint pos_off;     // int offset of pos[0] in binding 1
    float freq_base;
    float freq_scale;
    uint has_ff;      // 1: divide theta by ff[ff_off + i]
    uint ff_off;
    uint dst_off;     // word offset of cache[0, 0] in binding 3; rows are n_heads * head_dim / 2 words
    uint ctx;
    float ext_factor;
    float corr_lo;
    float corr_hi;
    float mscale;
    uint seq_off;     // int offset of seq[0] in binding 1 (read where seq_rows > 0)
    uint seq_rows;    // rows from one sequence to the next; 0: one sequence
} p;

const float TWO_PI = 6.283185307179586;

// Rotated value of dimension d of the head starting at float `base`.
float rotated(uint base, uint d, float fpos) {
    uint half_rot = p.n_rot >> 1;
    if (d >= p.n_rot) {
        return x[base + d];
    }
    uint k;
    bool first;
    uint a, b;
    if (p.neox != 0u) {
        k = d < half_rot ? d : d - half_rot;
        first = d < half_rot;
        a = base + k;
        b = a + half_rot;
    } else {
        k = d >> 1;
        first = (d & 1u) == 0u;
        a = base + 2u * k;
        b = a + 1u;
    }
    float inv_freq = exp2(-2.0 * float(k) / float(p.n_rot) * log2(p.freq_base));
    if (p.has_ff != 0u) {
        inv_freq /= ff[p.ff_off + k];
    }
    float scale = p.freq_scale;
    if (p.ext_factor != 0.0) {
        float y = (float(k) - p.corr_lo) / max(0.001, p.corr_hi - p.corr_lo);
        float mix = (1.0 - min(1.0, max(0.0, y))) * p.ext_factor;
        scale = p.freq_scale * (1.0 - mix) + mix;
    }
    float theta = fpos * scale * inv_freq;
    theta -= TWO_PI * floor(theta / TWO_PI + 0.5);
    float c = cos(theta) * p.mscale, s = sin(theta) * p.mscale;
    float x0 = x[a], x1 = x[b];
    return first ? x0 * c - x1 * s : x0 * s + x1 * c;
}

void main() {
    uint i = gl_GlobalInvocationID.y * (gl_NumWorkGroups.x * gl_WorkGroupSize.x) + gl_GlobalInvocationID.x;
    uint hw = p.head_dim >> 1;           // words per head
    uint words = p.n_heads * hw;         // words per token row
    if (i >= p.n_tokens * words) {
        return;
    }
    uint t = i / words;
    uint r = i - t * words;
    uint h = r / hw;
    uint d = 2u * (r - h * hw);
    int row = pos[p.pos_off + t];
    if (row < 0 || uint(row) >= p.ctx) {
        return;
    }
    uint base = p.x_off + t * p.t_stride + h * p.head_dim;
    float fpos = float(pos[p.pos_off + t]);
    uint sb = p.seq_rows > 0u ? uint(pos[p.seq_off + t]) * p.seq_rows : 0u;
    cache[p.dst_off + (sb + uint(row)) * words + r] = packHalf2x16(vec2(rotated(base, d, fpos), rotated(base, d + 1u, fpos)));
}
