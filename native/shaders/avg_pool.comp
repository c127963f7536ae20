// Average pooling of a square token grid (the Gemma 3 projector's 4x4 pool):
// x: f32 [side * side, hidden], token (row, col) at index row * side + col;
// out: f32 [(side / pool)^2, hidden] in the same raster order,
//   out[oy * (side / pool) + ox, c] = mean over dy, dx < pool of
//                                     x[(oy * pool + dy) * side + ox * pool + dx, c]
// (ggml_pool_2d AVG with kernel = stride = pool, no padding, over the grid
// as clip.cpp's gemma3 graph lays it out).  One thread per output element;
// side is a multiple of pool (checked by the caller).  out must not alias x.
#version 450
layout(local_size_x = 256) in;

layout(std430, set = 0, binding = 0) readonly buffer Input { float x[]; };
layout(std430, set = 0, binding = 1) buffer Out { float o[]; };

layout(push_constant) uniform Params {
    uint side;    // tokens per grid row (and column)
    uint pool;    // kernel and stride
    uint hidden;  // floats per token row (both tensors contiguous)
    uint x_off;   // float offsets in each binding
    uint o_off;
} p;

void main() {
    uint i = gl_GlobalInvocationID.y * (gl_NumWorkGroups.x * gl_WorkGroupSize.x) + gl_GlobalInvocationID.x;
    uint out_side = p.side / p.pool;
    if (i >= out_side * out_side * p.hidden) {
        return;
    }
    uint c = i % p.hidden;
    uint tok = i / p.hidden;
    uint oy = tok / out_side, ox = tok % out_side;
    uint first = (oy * p.pool) * p.side + ox * p.pool;
    float s = 0.0;
    for (uint dy = 0u; dy < p.pool; dy++) {
        for (uint dx = 0u; dx < p.pool; dx++) {
            s += x[p.x_off + (first + dy * p.side + dx) * p.hidden + c];
        }
    }
    o[p.o_off + i] = s / float(p.pool * p.pool);
}
