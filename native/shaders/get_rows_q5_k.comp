// get_rows with Q5_K weights: see get_rows.glsl and dequant_k.glsl.
#version 450
#extension GL_GOOGLE_include_directive : require
#define TYPE_Q5_K
#include "get_rows.glsl"
