// Y = X W^T with MXFP4 weights for many tokens (prefill) on the tensor cores:
// see matmul_cm.glsl.
#version 450
#extension GL_GOOGLE_include_directive : require
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_EXT_control_flow_attributes : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#define TYPE_MXFP4
#include "matmul_cm.glsl"
