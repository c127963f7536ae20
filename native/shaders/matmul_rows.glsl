// Which weight matrix and which X / Y rows a matmul work group's token tile
// uses: included by matmul.glsl (and meant for matmul_cm.glsl: the same few
// lines) after its bindings, its push constants and a #define BT (tokens
// of a tile).  With MM_ID the push constants end with matvec_id's
//     uint id_off; uint slab_bytes; uint e_first; uint e_count; uint x_div;
// (p.n_tokens is then the slot count).
//
// Dense (no MM_ID): token tile z is tokens z * BT .. z * BT + BT - 1 of X
// and Y, the matrix at byte p.w_off.
//
// Expert-grouped (MM_ID, the matmul_id_<type> kernels of mixture-of-experts
// prefill): binding 3 holds moe_group.comp's output at uint offset p.id_off:
//   [0, n_slots)         the slots sorted by expert (stable: slot order within one)
//   n_slots              the number of tiles
//   n_slots + 1 + 3 i .. (expert, first sorted position, tokens <= BT) of tile i
// Tile z multiplies expert e's matrix (the stack bound in runs of whole
// experts: e_first .. e_first + e_count - 1, e_first's matrix at p.w_off,
// as matvec_id) with the X rows of its slots (slot / x_div: a token's k
// slots share its row for gate and up; 1 for down) into Y rows = the slots,
// so what reads Y afterwards (activations, add_id, moe_combine) sees the
// same layout as matvec_id's.  A tile past the count or of an expert in
// another run leaves at once (the whole work group: z is uniform).
//
// The interface (both forms):
//   bool mm_tile(out uint wbase, out uint ntok)  false: nothing to do (return, the whole group);
//                                                 else the matrix's byte offset in binding 0 and
//                                                 the tile's tokens (1 .. BT).  It has a barrier in
//                                                 the MM_ID form: call it in uniform control flow.
//   uint mm_xrow(uint t), mm_yrow(uint t)        X and Y row of the tile's token t < ntok
// Adopting it in a matmul kernel: those fields at the end of its push
// constants, `p.w_off` -> wbase, `p.n_tokens` bound -> t < ntok,
// row `t0 + t` of X / Y -> mm_xrow(t) / mm_yrow(t).
#ifdef MM_ID
layout(std430, set = 0, binding = 3) readonly buffer Groups { uint groups[]; };

shared uint mm_xr[BT], mm_yr[BT];

bool mm_tile(out uint wbase, out uint ntok) {
    uint g = p.id_off, z = gl_WorkGroupID.z;
    wbase = 0u;
    ntok = 0u;
    if (z >= groups[g + p.n_tokens]) {
        return false;
    }
    uint tb = g + p.n_tokens + 1u + 3u * z;
    uint e = groups[tb] - p.e_first;  // unsigned: an expert below e_first wraps past e_count
    if (e >= p.e_count) {
        return false;
    }
    uint first = groups[tb + 1u];
    ntok = groups[tb + 2u];
    wbase = p.w_off + e * p.slab_bytes;
    for (uint t = gl_LocalInvocationID.x; t < ntok; t += gl_WorkGroupSize.x) {
        uint s = groups[g + first + t];
        mm_xr[t] = s / p.x_div;
        mm_yr[t] = s;
    }
    barrier();
    return true;
}

uint mm_xrow(uint t) { return mm_xr[t]; }
uint mm_yrow(uint t) { return mm_yr[t]; }
#else
uint mm_t0;

bool mm_tile(out uint wbase, out uint ntok) {
    mm_t0 = gl_WorkGroupID.z * BT;
    wbase = p.w_off;
    ntok = min(BT, p.n_tokens - min(mm_t0, p.n_tokens));
    return ntok > 0u;
}

uint mm_xrow(uint t) { return mm_t0 + t; }
uint mm_yrow(uint t) { return mm_t0 + t; }
#endif
