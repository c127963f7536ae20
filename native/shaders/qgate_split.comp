// Qwen3.5's gated attention projects each head to [query (hd) | gate (hd)]: this splits the
// projection qg [n, heads, 2 hd] into q [n, heads, hd] and gate [n, heads, hd].
#version 450
layout(local_size_x = 256) in;

layout(std430, set = 0, binding = 0) readonly buffer QG { float qg[]; };
layout(std430, set = 0, binding = 1) writeonly buffer Q { float q[]; };
layout(std430, set = 0, binding = 2) writeonly buffer G { float g[]; };

layout(push_constant) uniform Params {
    uint n;        // elements of q (tokens x heads x hd)
    uint hd;
    uint qg_off;   // float offsets in each binding
    uint q_off;
    uint g_off;
} p;

void main() {
    uint i = gl_GlobalInvocationID.y * (gl_NumWorkGroups.x * gl_WorkGroupSize.x) + gl_GlobalInvocationID.x;
    if (i < p.n) {
        uint head = i / p.hd, d = i % p.hd, src = p.qg_off + head * 2 * p.hd + d;
        q[p.q_off + i] = qg[src];
        g[p.g_off + i] = qg[src + p.hd];
    }
}
