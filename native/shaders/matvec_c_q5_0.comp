// matvec with Q5_0 weights, a row per invocation (CPU devices): see matvec.glsl's MV_ROWLANE;
// rows 8-byte aligned and cols a multiple of 128, read 4 blocks at a time as uvec2 (dequant_k.glsl's
// MC_W2; linear.select() takes matvec_c_q5_0_any otherwise).
#version 450
#extension GL_GOOGLE_include_directive : require
#define TYPE_Q5_0
#define MV_ROWLANE
#define MC_W2
#define MC_WG 16u  // 16 x 16 rows: see linear.py MATVEC_ROWS_C
#define MC_NR 16u
#include "matvec.glsl"
