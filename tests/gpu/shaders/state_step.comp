// One step of a toy recurrent state: every uint32 word becomes
// word * mul + add (mod 2^32).  The residency tests run it between release
// and restore cycles to prove that state written by compute survives
// eviction; numpy computes the same thing exactly.
#version 450
layout(local_size_x = 256) in;

layout(std430, set = 0, binding = 0) buffer State { uint words[]; } state;

layout(push_constant) uniform Step {
    uint count;  // words in this view
    uint mul;
    uint add;
} step;

void main() {
    // Two-dimensional grid: one dimension of work groups stops at 65535,
    // which is 16 Mi words, less than one maxStorageBufferRange view.
    uint i = gl_GlobalInvocationID.y * (gl_NumWorkGroups.x * gl_WorkGroupSize.x) + gl_GlobalInvocationID.x;
    if (i < step.count) {
        state.words[i] = state.words[i] * step.mul + step.add;
    }
}
