// matvec of the chosen experts' Q4_K matrices, a quant word per lane (rows
// 16-byte aligned), a slot per work-group z: see matvec.glsl (MV_WORDS,
// MV_ID).
#version 450
#extension GL_GOOGLE_include_directive : require
#define TYPE_Q4_K
#define MV_WORDS
#define MV_ID
#define MW_NR 4u  // rows a work group (Ops: _MATVEC_ROWS_W)
#include "matvec.glsl"
