// Causal flash attention of a chunk of queries (prefill), K/V tiles of 32
// keys (40.9 KiB of shared memory: devices with 48 KiB, Ops.attention picks
// it by maxComputeSharedMemorySize): see attention_flash.glsl.
#version 450
#extension GL_GOOGLE_include_directive : require
#define BK 32u
#include "attention_flash.glsl"
