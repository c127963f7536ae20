// Y = X W^T with Q4_0 weights for many tokens (prefill), shared-memory
// tiles: see matmul.glsl.
#version 450
#extension GL_GOOGLE_include_directive : require
#define TYPE_Q4_0
#include "matmul.glsl"
