// matvec with Q5_0 weights, a row per invocation (CPU devices): see matvec.glsl's MV_ROWLANE.
#version 450
#extension GL_GOOGLE_include_directive : require
#define TYPE_Q5_0
#define MV_ROWLANE
#define MC_WG 32u
#define MC_NR 4u
#include "matvec.glsl"
