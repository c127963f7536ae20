// Y = X W^T with Q8_0 weights for many tokens on CPU devices: rows per invocation, 4 tokens each,
// every unit decoded once for the 4 (see matvec.glsl's MV_ROWLANE, MC_NT).
#version 450
#extension GL_GOOGLE_include_directive : require
#define TYPE_Q8_0
#define MV_ROWLANE
#define MC_W2  // rows 8-byte aligned, cols a multiple of 128 (linear.select(); else matmul_c_<type>_any)
#define MC_WG 16u  // 16 x 16 rows: see linear.py MATMUL_C_ROWS
#define MC_NR 16u
#define MC_NT 4
#include "matvec.glsl"
