#version 450
#extension GL_GOOGLE_include_directive : require
#define TYPE_Q8_0
#define MV_ROWLANE
#define MC_WG 32u
#define MC_NR 4u
#define MC_NT 1
#include "matvec.glsl"
