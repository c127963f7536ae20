// matvec with Q8_0 weights: see matvec.glsl and dequant.glsl.
#version 450
#extension GL_GOOGLE_include_directive : require
#define TYPE_Q8_0
#include "matvec.glsl"
