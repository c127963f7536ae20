// get_rows with MXFP4 weights: see get_rows.glsl and dequant.glsl.
#version 450
#extension GL_GOOGLE_include_directive : require
#define TYPE_MXFP4
#include "get_rows.glsl"
