// get_rows with Q8_0 weights: see get_rows.glsl and dequant.glsl.
#version 450
#extension GL_GOOGLE_include_directive : require
#define TYPE_Q8_0
#include "get_rows.glsl"
