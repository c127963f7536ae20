// matvec of the chosen experts' Q6_K matrices, a slot (expert of a token) per
// work-group z, the expert id read on the GPU: see matvec.glsl (MV_ID).
#version 450
#extension GL_GOOGLE_include_directive : require
#define TYPE_Q6_K
#define MV_ID
#include "matvec.glsl"
