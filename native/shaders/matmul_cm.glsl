// Y[t, r] = sum_c W[r, c] * X[t, c] for many tokens (prefill) on the tensor
// cores: KHR cooperative matrices (16 x 16 x 16, f16 inputs, f32
// accumulators).  Included by matmul_cm_<type>.comp, which enables the
// extensions (GL_KHR_cooperative_matrix there is also what makes
// vramd/gpu/kernels.py compile it with glslang) and defines one TYPE_<name>.
// Same bindings and push constants as matmul.glsl / matvec.glsl, so
// Ops.matvec dispatches it unchanged; vramd/engine/linear.py chooses it.
//
// A work group (256 threads = 8 subgroups of 32: linear.py only chooses it
// on such devices) computes 128 weight rows x 128 tokens, stepping through
// the columns BK = 32 at a time: each step dequantizes a 128 x 32 tile of W
// (dequant.glsl's elem(), 16 consecutive elements a thread: one row's
// sub-block, so scales are decoded once by the compiler's CSE at best) and
// converts a 128 x 32 tile of X to f16 in shared memory, then each subgroup
// multiplies its 32 rows x 64 tokens (2 x 4 accumulators) from there.  Each
// weight element is read and decoded once per 128 tokens.  Edges (rows,
// tokens, columns past the ends) are zeros in the tiles; results go through
// a per-subgroup 16 x 16 staging area in shared memory and are written with
// bounds checks, so y needs no alignment and any stride works.
// Work-group x (+ y * width) is the row tile, z the token tile.
layout(local_size_x = 256) in;
#define BR 128u
#define BT 128u
#define BK 32u
#define LD (BK + 8u)   // f16 stride of tile rows: 80 bytes, 16-byte aligned (coopMatLoad), rows in other banks

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
} p;

#include "dequant.glsl"

#define CM_A coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA>
#define CM_B coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB>
#define CM_C coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>

shared float16_t ws[BR * LD];   // W tile, row-major: ws[r * LD + k]
shared float16_t xs[BT * LD];   // X tile, a token per row: xs[t * LD + k] (B, column-major)
shared float st[8u * 256u];     // per subgroup: one 16 x 16 result, st[t * 16 + r]

void main() {
    uint tile = gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x;
    uint r0 = tile * BR;
    if (r0 >= p.rows) {
        return;  // the whole work group
    }
    uint t0 = gl_WorkGroupID.z * BT;
    uint lid = gl_LocalInvocationID.x;
    uint sg = lid >> 5, lane = lid & 31u;   // 8 subgroups of 32 (linear.py checks the device's size)
    uint sr = (sg & 3u) * 32u;   // this subgroup's rows sr .. sr+31 of the tile
    uint sn = (sg >> 2) * 64u;   // and tokens sn .. sn+63
    CM_C acc[2][4];
    [[unroll]] for (uint i = 0u; i < 2u; i++) {
        [[unroll]] for (uint j = 0u; j < 4u; j++) {
            acc[i][j] = CM_C(0.0);
        }
    }
    uint rb = ROW_BYTES(p.cols);
    // Loaders: thread lid fills row (token) lid / 2 of a tile, columns 16 * (lid & 1) .. +15.
    uint lr = lid >> 1, lc = (lid & 1u) * 16u;
    bool wrow = r0 + lr < p.rows;
    uint wrowb = p.w_off + (r0 + lr) * rb;
    bool xrow = t0 + lr < p.n_tokens;
    uint xrow0 = p.x_off + (t0 + lr) * p.x_stride;
    for (uint k0 = 0u; k0 < p.cols; k0 += BK) {
        uint c0 = k0 + lc;
        [[unroll]] for (uint j = 0u; j < 16u; j++) {
            float v = 0.0;
            if (wrow && c0 + j < p.cols) {
                v = elem(wrowb, c0 + j);
            }
            ws[lr * LD + lc + j] = float16_t(v);
        }
        [[unroll]] for (uint j = 0u; j < 16u; j++) {
            float v = 0.0;
            if (xrow && c0 + j < p.cols) {
                v = x[xrow0 + c0 + j];
            }
            xs[lr * LD + lc + j] = float16_t(v);
        }
        barrier();
        [[unroll]] for (uint kk = 0u; kk < BK; kk += 16u) {
            CM_A a[2];
            [[unroll]] for (uint i = 0u; i < 2u; i++) {
                coopMatLoad(a[i], ws, (sr + 16u * i) * LD + kk, LD, gl_CooperativeMatrixLayoutRowMajor);
            }
            [[unroll]] for (uint j = 0u; j < 4u; j++) {
                CM_B b;
                coopMatLoad(b, xs, (sn + 16u * j) * LD + kk, LD, gl_CooperativeMatrixLayoutColumnMajor);
                [[unroll]] for (uint i = 0u; i < 2u; i++) {
                    acc[i][j] = coopMatMulAdd(a[i], b, acc[i][j]);
                }
            }
        }
        barrier();
    }
    uint base = sg * 256u;
    [[unroll]] for (uint i = 0u; i < 2u; i++) {
        [[unroll]] for (uint j = 0u; j < 4u; j++) {
            coopMatStore(acc[i][j], st, base, 16u, gl_CooperativeMatrixLayoutColumnMajor);
            subgroupMemoryBarrierShared();
            subgroupBarrier();
            uint rr = r0 + sr + 16u * i, tt = t0 + sn + 16u * j;
            [[unroll]] for (uint m = 0u; m < 8u; m++) {
                uint e = lane + 32u * m;
                uint r = rr + (e & 15u), t = tt + (e >> 4);
                if (r < p.rows && t < p.n_tokens) {
                    y[p.y_off + t * p.y_stride + r] = st[base + e];
                }
            }
            subgroupBarrier();   // st is rewritten by the next store
        }
    }
}
