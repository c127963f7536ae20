// matvec with Q8_0 weights for several tokens at once (prefill): a tile of
// 8 tokens shares each read of a weight row; see matvec.glsl.
#version 450
#extension GL_GOOGLE_include_directive : require
#define TYPE_Q8_0
#define TT 8u
#include "matvec.glsl"
