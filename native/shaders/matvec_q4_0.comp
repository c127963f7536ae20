// matvec with Q4_0 weights, one token per work group (decode): see matvec.glsl.
#version 450
#extension GL_GOOGLE_include_directive : require
#define TYPE_Q4_0
#include "matvec.glsl"
