// get_rows with Q5_0 weights: see get_rows.glsl and dequant_k.glsl.
#version 450
#extension GL_GOOGLE_include_directive : require
#define TYPE_Q5_0
#include "get_rows.glsl"
