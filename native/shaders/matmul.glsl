// Y[t, r] = sum_c W[r, c] * X[t, c] for many tokens (prefill), W dequantized
// on the fly (dequant.glsl); included by matmul_<type>.comp.  Same bindings
// and push constants as matvec.glsl.
//
// A classic shared-memory tiling: a work group computes a tile of BR weight
// rows x BT tokens, stepping through the columns BK at a time; each step
// dequantizes a BR x BK tile of W and copies a BT x BK tile of X into shared
// memory once, then every thread does 4 rows x 2 tokens of multiply-adds from
// there.  Each weight element is read once per BT tokens instead of once per
// token.  Work-group x (+ y * width) is the row tile, z the token tile.
//
// Which matrix and which X / Y rows a token tile takes is matmul_rows.glsl's:
// consecutive tokens (matmul_<type>), or with MM_ID (matmul_id_<type>) a
// tile of one expert's slots, gathered from and scattered to their rows
// (binding 3: moe_group.comp's sorted slots and tile list).
layout(local_size_x = 256) in;
#define BR 64u
#define BT 32u
#define BK 32u

layout(std430, set = 0, binding = 0) readonly buffer Weights { uint w[]; };
layout(std430, set = 0, binding = 1) readonly buffer Input { float x[]; };
layout(std430, set = 0, binding = 2) buffer Output { float y[]; };

layout(push_constant) uniform Params {
    uint rows;      // weight rows in this dispatch
    uint cols;      // elements per row (quantized: a multiple of 32)
    uint n_tokens;
    uint w_off;     // byte offset of this dispatch's row 0 in binding 0
    uint x_off;     // float offset of X[0, 0] in binding 1
    uint x_stride;  // floats from X[t, 0] to X[t + 1, 0]
    uint y_off;     // float offset of Y[0, row 0] in binding 2
    uint y_stride;  // floats from Y[t, 0] to Y[t + 1, 0]
#ifdef MM_ID
    uint id_off;     // uint offset of moe_group.comp's output in binding 3 (n_tokens: its slot count)
    uint slab_bytes; // bytes from one expert's matrix to the next (rows * ROW_BYTES(cols), more in a fused stack)
    uint e_first;    // binding 0 holds experts e_first .. e_first + e_count - 1,
    uint e_count;    // e_first's row 0 at byte w_off
    uint x_div;      // slots per x row
#endif
} p;

#include "dequant.glsl"
#include "matmul_rows.glsl"

shared float ws[BR * (BK + 1u)];  // +1: rows of the tile fall in different banks
shared float xs[BT * (BK + 1u)];

void main() {
    uint tile = gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x;
    uint r0 = tile * BR;
    if (r0 >= p.rows) {
        return;  // the whole work group
    }
    uint wbase, ntok;
    if (!mm_tile(wbase, ntok)) {
        return;  // the whole work group
    }
    uint lid = gl_LocalInvocationID.x;
    uint tr = lid % 16u, tt = lid / 16u;  // this thread: rows tr + 16i, tokens tt + 16j
    uint rb = ROW_BYTES(p.cols);
    float acc[4][2];
    for (uint i = 0u; i < 4u; i++) {
        acc[i][0] = 0.0;
        acc[i][1] = 0.0;
    }
    for (uint k0 = 0u; k0 < p.cols; k0 += BK) {
        for (uint m = 0u; m < BR * BK / 256u; m++) {
            uint e = lid + 256u * m;
            uint r = e / BK, c = e % BK;
            float v = 0.0;
            if (r0 + r < p.rows && k0 + c < p.cols) {
                v = elem(wbase + (r0 + r) * rb, k0 + c);
            }
            ws[r * (BK + 1u) + c] = v;
        }
        for (uint m = 0u; m < BT * BK / 256u; m++) {
            uint e = lid + 256u * m;
            uint t = e / BK, c = e % BK;
            float v = 0.0;
            if (t < ntok && k0 + c < p.cols) {
                v = x[p.x_off + mm_xrow(t) * p.x_stride + k0 + c];
            }
            xs[t * (BK + 1u) + c] = v;
        }
        barrier();
        for (uint c = 0u; c < BK; c++) {
            float x0 = xs[tt * (BK + 1u) + c];
            float x1 = xs[(tt + 16u) * (BK + 1u) + c];
            for (uint i = 0u; i < 4u; i++) {
                float wv = ws[(tr + 16u * i) * (BK + 1u) + c];
                acc[i][0] += wv * x0;
                acc[i][1] += wv * x1;
            }
        }
        barrier();
    }
    for (uint i = 0u; i < 4u; i++) {
        uint r = r0 + tr + 16u * i;
        for (uint j = 0u; j < 2u; j++) {
            uint t = tt + 16u * j;
            if (r < p.rows && t < ntok) {
                y[p.y_off + mm_yrow(t) * p.y_stride + r] = acc[i][j];
            }
        }
    }
}
