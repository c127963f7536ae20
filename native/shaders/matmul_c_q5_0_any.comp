// Y = X W^T with Q5_0 weights for many tokens on CPU devices, any alignment (matmul_c_q5_0: rows 8-byte
// aligned, 4 blocks a unit as uvec2): rows per invocation, 4 tokens each (matvec.glsl's MV_ROWLANE, MC_NT).
#version 450
#extension GL_GOOGLE_include_directive : require
#define TYPE_Q5_0
#define MV_ROWLANE
#define MC_WG 16u  // 16 x 16 rows: see linear.py MATMUL_C_ROWS
#define MC_NR 16u
#define MC_NT 4
#include "matvec.glsl"
