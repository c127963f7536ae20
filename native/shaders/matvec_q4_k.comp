// matvec with Q4_K weights, one token per work group (decode): see matvec.glsl
// and dequant_k.glsl.
#version 450
#extension GL_GOOGLE_include_directive : require
#define TYPE_Q4_K
#include "matvec.glsl"
