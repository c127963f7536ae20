// matvec of the chosen experts' Q4_1 matrices, a slot (expert of a token) per
// work-group z, the expert id read on the GPU: see matvec.glsl (MV_ID).
#version 450
#extension GL_GOOGLE_include_directive : require
#define TYPE_Q4_1
#define MV_ID
#include "matvec.glsl"
