// get_rows with BF16 weights: see get_rows.glsl and dequant.glsl.
#version 450
#extension GL_GOOGLE_include_directive : require
#define TYPE_BF16
#include "get_rows.glsl"
