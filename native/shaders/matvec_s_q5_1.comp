// matvec with Q5_1 weights, staged through shared memory (decode, rows
// 16-byte aligned): see matvec.glsl.
#version 450
#extension GL_GOOGLE_include_directive : require
#define TYPE_Q5_1
#define MV_STAGED
#include "matvec.glsl"
