// matvec with BF16 weights: see matvec.glsl and dequant.glsl.
#version 450
#extension GL_GOOGLE_include_directive : require
#define TYPE_BF16
#include "matvec.glsl"
