// Y = X W^T with F32 weights for many tokens (prefill), shared-memory
// tiles: see matmul.glsl.
#version 450
#extension GL_GOOGLE_include_directive : require
#define TYPE_F32
#include "matmul.glsl"
