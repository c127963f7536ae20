// Y = X W^T with Q5_1 weights for many tokens (prefill), shared-memory
// tiles: see matmul.glsl and dequant_k.glsl.
#version 450
#extension GL_GOOGLE_include_directive : require
#define TYPE_Q5_1
#include "matmul.glsl"
