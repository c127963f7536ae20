// Y = X W^T with BF16 weights for many tokens (prefill), shared-memory
// tiles: see matmul.glsl.
#version 450
#extension GL_GOOGLE_include_directive : require
#define TYPE_BF16
#include "matmul.glsl"
