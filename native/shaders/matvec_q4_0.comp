// matvec with Q4_0 weights: see matvec.glsl and dequant.glsl.
#version 450
#extension GL_GOOGLE_include_directive : require
#define TYPE_Q4_0
#include "matvec.glsl"
