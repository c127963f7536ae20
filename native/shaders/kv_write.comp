// Writes new K or V rows into an f16 cache: cache[pos[t], :] = f16(src[t, :]).
// The cache is [ctx, width] f16 (width = n_kv_heads * head_dim, even), read
// and written as uint32 words holding two halves, so no 16-bit storage
// feature is needed; one thread per word.  Positions at or beyond ctx are
// skipped rather than written out of bounds.  seq_rows > 0 (several
// sequences, one row each: a decode step of parallel slots): the cache holds
// sequences of ctx rows, seq_rows apart, and token t's row is seq[t] *
// seq_rows + pos[t], seq[t] = pos[seq_off + t] (the sequence ids beside the
// positions in binding 2).
#version 450
layout(local_size_x = 256) in;

layout(std430, set = 0, binding = 0) readonly buffer Src { float src[]; };
layout(std430, set = 0, binding = 1) buffer Cache { uint cache[]; };
layout(std430, set = 0, binding = 2) readonly buffer Pos { int pos[]; };

layout(push_constant) uniform Params {
    uint n_tokens;
    uint width;       // halves per token row (even)
    uint src_off;     // float offset of src[0, 0] in binding 0
    uint src_stride;  // floats from src[t, 0] to src[t + 1, 0]
    uint dst_off;     // word offset of cache[0, 0] in binding 1
    uint dst_stride;  // words from cache row j to j + 1
    uint pos_off;     // int offset of pos[0] in binding 2
    uint ctx;         // cache rows (of a sequence)
    uint seq_off;     // int offset of seq[0] in binding 2 (read where seq_rows > 0)
    uint seq_rows;    // rows from one sequence to the next; 0: one sequence
} p;

void main() {
    uint i = gl_GlobalInvocationID.y * (gl_NumWorkGroups.x * gl_WorkGroupSize.x) + gl_GlobalInvocationID.x;
    uint words = p.width >> 1;
    if (i >= p.n_tokens * words) {
        return;
    }
    uint t = i / words;
    uint k = i - t * words;
    int row = pos[p.pos_off + t];
    if (row < 0 || uint(row) >= p.ctx) {
        return;
    }
    uint s = p.src_off + t * p.src_stride + 2u * k;
    uint base = p.seq_rows > 0u ? uint(pos[p.seq_off + t]) * p.seq_rows : 0u;
    cache[p.dst_off + (base + uint(row)) * p.dst_stride + k] = packHalf2x16(vec2(src[s], src[s + 1u]));
}
