// The ViT's patch embedding: a convolution with kernel = stride = patch and
// no padding (ggml_conv_2d as clip.cpp applies v.patch_embd.weight), plus an
// optional bias, written as one matrix product per tile:
//   out[pp, o] = b[o] + sum_{c, ky, kx} W[o, c, ky, kx] img[c, py*P + ky, px*P + kx]
// for patch pp = py * nx + px (raster order; nx = width / P, ny = height / P).
//
// img: f32 [channels, height, width], planar (clip.cpp's inp_raw).  W: the
// GGUF tensor of ggml shape [P, P, channels, hidden] (ne0 = kx fastest):
// `hidden` rows of K = channels * P * P contiguous elements in (c, ky, kx)
// order, F32, F16 or BF16 (`wtype`); the im2col column k of a patch is the
// pixel (c, ky, kx) = (k / P^2, k / P % P, k % P).  out: f32 [n_patches,
// o_stride], row = patch.
//
// Tiling as matmul.glsl: a work group computes BR output channels x BT
// patches, stepping through K BK at a time: a BR x BK tile of W and a
// BT x BK tile of patch pixels (gathered from the image) in shared memory;
// each thread then does 4 channels x 2 patches of multiply-adds.
// Work-group x is the channel tile, y the patch tile.  f32 accumulation.
#version 450
layout(local_size_x = 256) in;
#define WG 256u
#define BR 64u
#define BT 32u
#define BK 32u

layout(std430, set = 0, binding = 0) readonly buffer Weights { uint w[]; };
layout(std430, set = 0, binding = 1) readonly buffer Image { float img[]; };
layout(std430, set = 0, binding = 2) readonly buffer Bias { float bias[]; };
layout(std430, set = 0, binding = 3) buffer Output { float o[]; };

layout(push_constant) uniform Params {
    uint hidden;     // output channels (weight rows)
    uint kdim;       // channels * patch * patch (weight row length)
    uint n_patches;
    uint channels;
    uint height;
    uint width;
    uint psize;      // the patch side P
    uint w_off;      // element offset of W[0, 0] in binding 0 (f32: words, f16/bf16: halves)
    uint wtype;      // 0 F32, 1 F16, 2 BF16
    uint img_off;    // float offsets
    uint b_off;
    uint has_b;      // 0: no bias, binding 2 unread
    uint o_off;
    uint o_stride;   // floats from out[pp, 0] to out[pp + 1, 0]
} p;

shared float ws[BR * (BK + 1u)];
shared float xs[BT * (BK + 1u)];

float weight(uint e) {
    if (p.wtype == 0u) {
        return uintBitsToFloat(w[e]);
    }
    uint bits = (w[e >> 1] >> ((e & 1u) << 4)) & 0xFFFFu;
    if (p.wtype == 1u) {
        return unpackHalf2x16(bits).x;
    }
    return uintBitsToFloat(bits << 16);
}

void main() {
    uint r0 = gl_WorkGroupID.x * BR;
    uint t0 = gl_WorkGroupID.y * BT;
    uint tid = gl_LocalInvocationID.x;
    uint P = p.psize;
    uint PP = P * P;
    uint nx = p.width / P;
    uint tr = tid % 16u;  // channels tr + 16 j, j < 4
    uint tt = tid / 16u;  // patches tt + 16 j, j < 2

    float acc[4][2];
    for (uint a = 0u; a < 4u; a++) {
        acc[a][0] = 0.0;
        acc[a][1] = 0.0;
    }

    for (uint k0 = 0u; k0 < p.kdim; k0 += BK) {
        for (uint i = tid; i < BR * BK; i += WG) {
            uint rr = i / BK, kk = i % BK;
            uint row = r0 + rr, kc = k0 + kk;
            ws[rr * (BK + 1u) + kk] = (row < p.hidden && kc < p.kdim) ? weight(p.w_off + row * p.kdim + kc) : 0.0;
        }
        for (uint i = tid; i < BT * BK; i += WG) {
            uint pt = i / BK, kk = i % BK;
            uint pp = t0 + pt, kc = k0 + kk;
            float val = 0.0;
            if (pp < p.n_patches && kc < p.kdim) {
                uint c = kc / PP, rem = kc % PP;
                uint y = (pp / nx) * P + rem / P;
                uint x = (pp % nx) * P + rem % P;
                val = img[p.img_off + (c * p.height + y) * p.width + x];
            }
            xs[pt * (BK + 1u) + kk] = val;
        }
        barrier();
        for (uint kk = 0u; kk < BK; kk++) {
            float x0 = xs[tt * (BK + 1u) + kk];
            float x1 = xs[(tt + 16u) * (BK + 1u) + kk];
            for (uint a = 0u; a < 4u; a++) {
                float wv = ws[(tr + 16u * a) * (BK + 1u) + kk];
                acc[a][0] += wv * x0;
                acc[a][1] += wv * x1;
            }
        }
        barrier();
    }

    for (uint a = 0u; a < 4u; a++) {
        uint row = r0 + tr + 16u * a;
        if (row >= p.hidden) {
            continue;
        }
        float bv = p.has_b != 0u ? bias[p.b_off + row] : 0.0;
        for (uint j = 0u; j < 2u; j++) {
            uint pp = t0 + tt + 16u * j;
            if (pp < p.n_patches) {
                o[p.o_off + pp * p.o_stride + row] = acc[a][j] + bv;
            }
        }
    }
}
