// Embedding lookup: out[t, c] = table[ids[t], c] as f32, the table in any
// type of dequant.glsl; included by get_rows_<type>.comp.
//
// A table larger than one storage view is looked up chunk by chunk: each
// dispatch binds rows row0 .. row0 + rows - 1 and writes only the tokens
// whose id falls there (the ids live on the device, so the host does not
// know which chunk a token needs; a recorded decode graph can be replayed).
layout(local_size_x = 256) in;

layout(std430, set = 0, binding = 0) readonly buffer Table { uint w[]; };
layout(std430, set = 0, binding = 1) readonly buffer Ids { int ids[]; };
layout(std430, set = 0, binding = 2) buffer Output { float o[]; };

layout(push_constant) uniform Params {
    uint cols;
    uint n_tokens;
    uint w_off;     // byte offset of row `row0` in binding 0
    uint row0;      // first table row bound by this dispatch
    uint rows;      // table rows bound by this dispatch
    uint ids_off;   // int offset of ids[0] in binding 1
    uint o_off;     // float offset of out[0, 0] in binding 2
    uint o_stride;  // floats from out[t, 0] to out[t + 1, 0]
} p;

#include "dequant.glsl"

void main() {
    uint i = gl_GlobalInvocationID.y * (gl_NumWorkGroups.x * gl_WorkGroupSize.x) + gl_GlobalInvocationID.x;
    if (i >= p.cols * p.n_tokens) {
        return;
    }
    uint t = i / p.cols;
    uint c = i - t * p.cols;
    int id = ids[p.ids_off + t];
    if (id < int(p.row0) || id >= int(p.row0 + p.rows)) {
        return;  // another chunk's row (or an id out of range: left untouched)
    }
    o[p.o_off + t * p.o_stride + c] = elem(p.w_off + uint(id - int(p.row0)) * ROW_BYTES(p.cols), c);
}
