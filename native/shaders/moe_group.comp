// A prefill chunk's expert slots grouped by expert, on the GPU, for the
// grouped expert matmuls (matmul_id_<type>: matmul_rows.glsl's MM_ID): a
// counting sort of the n_slots expert ids (moe_route.comp's, slot s = token
// s / k's j-th expert) in one work group, and the list of tiles of at most
// BT slots of one expert each.  Output at uint offset g_off of binding 1:
//   [0, n_slots)          slots sorted by expert; stable (slot order within an
//                         expert), so a tile's rows and the results are the same
//                         from run to run
//   n_slots               the number of tiles
//   n_slots + 1 + 3 i ..  tile i: (expert, first sorted position, slots 1 .. BT),
//                         by expert, then position
// Tiles at most n_slots / BT + min(n_expert, n_slots) (Ops.moe_group sizes
// the matmul grid by that, so nothing is read back).  An id >= n_expert
// (never from moe_route) is in no tile: its slot is left unwritten, as
// matvec_id leaves it.
//
// Steps: a histogram in shared memory (atomics: the counts do not depend on
// the order), exclusive prefix sums of the counts and of the tiles per expert
// (each thread a run of EPT experts, then a Hillis-Steele scan of the WG
// partial sums), the tile list (a thread per expert), then the scatter in
// chunks of WG slots: a slot's place is its expert's start + the slots of
// that expert in earlier chunks + those before it in its chunk (counted
// from the chunk's ids in shared memory: up to WG compares a thread, about
// n_slots compares a thread in all: 4,096 for 512 tokens x top-8).
#version 450
layout(local_size_x = 256) in;
#define WG 256u
#define MAX_EXPERT 1024u  // Ops: ROUTE_MAX_EXPERTS (moe_route.comp's)
#define EPT (MAX_EXPERT / WG)

layout(std430, set = 0, binding = 0) readonly buffer Ids { uint ids[]; };
layout(std430, set = 0, binding = 1) buffer Groups { uint groups[]; };

layout(push_constant) uniform Params {
    uint n_slots;
    uint n_expert;
    uint bt;      // slots per tile at most (the matmul's token tile)
    uint i_off;   // uint offset of slot 0's expert id in binding 0
    uint g_off;   // uint offset of the output in binding 1
} p;

shared uint cnt[MAX_EXPERT];   // slots per expert, then the next free place of each
shared uvec2 part[WG];         // (slots, tiles) of each thread's run of experts, scanned
shared uint chunk[WG];         // the ids of the chunk being scattered

void main() {
    uint lid = gl_LocalInvocationID.x, n = p.n_slots, ne = p.n_expert;
    for (uint e = lid; e < MAX_EXPERT; e += WG) {
        cnt[e] = 0u;
    }
    barrier();
    for (uint s = lid; s < n; s += WG) {
        uint e = ids[p.i_off + s];
        if (e < ne) {
            atomicAdd(cnt[e], 1u);
        }
    }
    barrier();
    // This thread's experts lid * EPT .. + EPT - 1: their counts and tiles, summed.
    uint c[EPT];
    uvec2 mine = uvec2(0u);
    for (uint i = 0u; i < EPT; i++) {
        c[i] = cnt[lid * EPT + i];
        mine += uvec2(c[i], (c[i] + p.bt - 1u) / p.bt);
    }
    part[lid] = mine;
    barrier();
    for (uint d = 1u; d < WG; d <<= 1) {   // inclusive scan of part[]
        uvec2 v = part[lid];
        if (lid >= d) {
            v += part[lid - d];
        }
        barrier();
        part[lid] = v;
        barrier();
    }
    uvec2 at = part[lid] - mine;   // exclusive: the first place and tile of this thread's experts
    for (uint i = 0u; i < EPT; i++) {
        uint e = lid * EPT + i;
        cnt[e] = at.x;   // the place of expert e's next slot (this thread's own entries only)
        for (uint j = 0u; j * p.bt < c[i]; j++) {
            uint tb = p.g_off + n + 1u + 3u * (at.y + j);
            groups[tb] = e;
            groups[tb + 1u] = at.x + j * p.bt;
            groups[tb + 2u] = min(p.bt, c[i] - j * p.bt);
        }
        at += uvec2(c[i], (c[i] + p.bt - 1u) / p.bt);
    }
    if (lid == WG - 1u) {
        groups[p.g_off + n] = part[WG - 1u].y;
    }
    barrier();
    for (uint s0 = 0u; s0 < n; s0 += WG) {
        uint s = s0 + lid;
        uint e = s < n ? ids[p.i_off + s] : 0xFFFFFFFFu;
        chunk[lid] = e;
        barrier();
        if (e < ne) {
            uint r = 0u;
            for (uint j = 0u; j < lid; j++) {
                r += chunk[j] == e ? 1u : 0u;
            }
            groups[p.g_off + cnt[e] + r] = s;
        }
        barrier();   // every place read before any moves on
        if (e < ne) {
            atomicAdd(cnt[e], 1u);
        }
        barrier();
    }
}
