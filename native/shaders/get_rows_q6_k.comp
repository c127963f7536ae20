// get_rows with Q6_K weights: see get_rows.glsl and dequant_k.glsl.
#version 450
#extension GL_GOOGLE_include_directive : require
#define TYPE_Q6_K
#include "get_rows.glsl"
