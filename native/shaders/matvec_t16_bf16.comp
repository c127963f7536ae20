// matvec with BF16 weights, 16 tokens a work group (a step's decode rows, each
// bit for bit its lone kernel matvec_bf16): see matvec.glsl, "Several tokens".
#version 450
#extension GL_GOOGLE_include_directive : require
#define TYPE_BF16
#define MV_NT 16
#include "matvec.glsl"
