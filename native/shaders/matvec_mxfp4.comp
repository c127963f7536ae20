// matvec with MXFP4 weights, one token per work group (decode): see matvec.glsl.
#version 450
#extension GL_GOOGLE_include_directive : require
#define TYPE_MXFP4
#include "matvec.glsl"
