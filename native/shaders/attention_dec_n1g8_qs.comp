// Decode attention, the long-context form, head_dim <= 64, up to 8 q heads a group, q in shared memory: see attention_dec.glsl.
#version 450
#extension GL_GOOGLE_include_directive : require
#define NC 1u
#define MAXG 8u
#define UL 4u
#define QSH
#include "attention_dec.glsl"
