// matvec with F16 weights, 8 tokens a work group (a step's decode rows, each
// bit for bit its lone kernel matvec_f16): see matvec.glsl, "Several tokens".
#version 450
#extension GL_GOOGLE_include_directive : require
#define TYPE_F16
#define MV_NT 8
#include "matvec.glsl"
