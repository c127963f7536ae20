// Decode attention, the long-context form, head_dim <= 256, up to 2 q heads a group: see attention_dec.glsl.
#version 450
#extension GL_GOOGLE_include_directive : require
#define NC 4u
#define MAXG 2u
#define UL 1u
#include "attention_dec.glsl"
