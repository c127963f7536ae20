// get_rows with F32 weights: see get_rows.glsl and dequant.glsl.
#version 450
#extension GL_GOOGLE_include_directive : require
#define TYPE_F32
#include "get_rows.glsl"
