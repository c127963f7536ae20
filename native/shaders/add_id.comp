// Per-expert biases of a mixture-of-experts layer (gpt-oss; ggml's add_id):
//   y[s, c] += b[ids[s], c]   for slot s < n_slots, c < width
// ids: the expert of each slot, as moe_route.comp wrote them (read on the GPU:
// no readback); b: a stack of n_expert bias rows of `width` floats.  A thread
// per element of y.
#version 450
layout(local_size_x = 256) in;

layout(std430, set = 0, binding = 0) buffer Y { float y[]; };
layout(std430, set = 0, binding = 1) readonly buffer B { float b[]; };
layout(std430, set = 0, binding = 2) readonly buffer Ids { uint ids[]; };

layout(push_constant) uniform Params {
    uint n_slots;
    uint width;
    uint y_off;   // float offsets in each binding
    uint b_off;
    uint id_off;  // uint offset of slot 0's expert id
} p;

void main() {
    uint i = gl_GlobalInvocationID.y * (gl_NumWorkGroups.x * gl_WorkGroupSize.x) + gl_GlobalInvocationID.x;
    if (i < p.n_slots * p.width) {
        uint s = i / p.width, c = i - s * p.width;
        y[p.y_off + i] += b[p.b_off + ids[p.id_off + s] * p.width + c];
    }
}
