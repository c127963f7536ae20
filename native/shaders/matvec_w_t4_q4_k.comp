// matvec with Q4_K weights, a quant word per lane, 4 tokens a work group (a
// step's decode rows, each bit for bit its lone kernel matvec_w_q4_k): see
// matvec.glsl, "Several tokens".
#version 450
#extension GL_GOOGLE_include_directive : require
#define TYPE_Q4_K
#define MV_WORDS
#define MW_NR 4u  // rows a work group (Ops: linear.per_token_kernel, min(MATVEC_ROWS_W, 32 / NT))
#define MV_NT 4
#include "matvec.glsl"
