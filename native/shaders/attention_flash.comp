// Causal flash attention of a chunk of queries (prefill), K/V tiles of 16
// keys (29 KiB of shared memory: every device): see attention_flash.glsl.
#version 450
#extension GL_GOOGLE_include_directive : require
#include "attention_flash.glsl"
