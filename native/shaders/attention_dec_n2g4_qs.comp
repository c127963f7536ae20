// Decode attention, the long-context form, head_dim <= 128, up to 4 q heads a group, q in shared memory: see attention_dec.glsl.
#version 450
#extension GL_GOOGLE_include_directive : require
#define NC 2u
#define MAXG 4u
#define UL 2u
#define QSH
#include "attention_dec.glsl"
