// matvec with Q5_0 weights, a row per invocation (CPU devices), any alignment: see matvec.glsl's MV_ROWLANE.
#version 450
#extension GL_GOOGLE_include_directive : require
#define TYPE_Q5_0
#define MV_ROWLANE
#define MC_WG 16u  // 16 x 16 rows: see linear.py MATVEC_ROWS_C
#define MC_NR 16u
#include "matvec.glsl"
