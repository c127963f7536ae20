// matvec of the chosen experts' Q8_0 matrices, a quant word per lane (rows
// 16-byte aligned), a slot per work-group z: see matvec.glsl (MV_WORDS,
// MV_ID).
#version 450
#extension GL_GOOGLE_include_directive : require
#define TYPE_Q8_0
#define MV_WORDS
#define MV_ID
#define MW_NR 8u  // rows a work group (Ops: _MATVEC_ROWS_W)
#include "matvec.glsl"
