// matvec of the chosen experts' MXFP4 matrices, a slot (expert of a token) per
// work-group z, the expert id read on the GPU: see matvec.glsl (MV_ID).
#version 450
#extension GL_GOOGLE_include_directive : require
#define TYPE_MXFP4
#define MV_ID
#include "matvec.glsl"
