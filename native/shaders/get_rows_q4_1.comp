// get_rows with Q4_1 weights: see get_rows.glsl and dequant_k.glsl.
#version 450
#extension GL_GOOGLE_include_directive : require
#define TYPE_Q4_1
#include "get_rows.glsl"
