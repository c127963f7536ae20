// Y = X W^T with MXFP4 weights for many tokens (prefill), shared-memory
// tiles: see matmul.glsl.
#version 450
#extension GL_GOOGLE_include_directive : require
#define TYPE_MXFP4
#include "matmul.glsl"
