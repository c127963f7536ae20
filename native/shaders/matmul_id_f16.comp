// Y = X W_e^T with F16 expert matrices for a prefill chunk's slots, grouped
// by expert (a tile of one expert's slots per work-group z): see
// matmul.glsl and matmul_rows.glsl (MM_ID).
#version 450
#extension GL_GOOGLE_include_directive : require
#define TYPE_F16
#define MM_ID
#include "matmul.glsl"
