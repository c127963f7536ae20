// matvec with Q8_0 weights, a quant word per lane (decode, rows 16-byte
// aligned): see matvec.glsl.
#version 450
#extension GL_GOOGLE_include_directive : require
#define TYPE_Q8_0
#define MV_WORDS
#define MW_NR 8u  // rows a work group (Ops: _MATVEC_ROWS_W)
#include "matvec.glsl"
