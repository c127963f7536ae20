// Weight decoding shared by matvec_<type>.comp and get_rows_<type>.comp.
//
// The includer declares the weights as `uint w[]` (binding 0) and defines
// one TYPE_<name>.  Quantized bytes are read from uint32 words with shifts:
// the device is created without the 8/16-bit storage features, so this is
// the portable way (it runs wherever SPIR-V compute runs).  Block layouts are
// ggml's: Q8_0 = f16 scale + 32 int8 (34 bytes), Q4_0 = f16 scale + 16 bytes
// whose low nibbles are elements 0..15 and high nibbles 16..31, value
// (q - 8) * d (18 bytes).  Byte offsets of f16/bf16 values are even.

uint w_u8(uint b) { return (w[b >> 2] >> ((b & 3u) << 3)) & 0xFFu; }
uint w_u16(uint b) { return (w[b >> 2] >> ((b & 2u) << 3)) & 0xFFFFu; }
float w_f16(uint b) { return unpackHalf2x16(w_u16(b)).x; }
float w_bf16(uint b) { return uintBitsToFloat(w_u16(b) << 16); }
float w_f32(uint b) { return uintBitsToFloat(w[b >> 2]); }
// Four bytes starting at an even byte offset.
uint w_u32a2(uint b) {
    uint i = b >> 2;
    return (b & 2u) == 0u ? w[i] : ((w[i] >> 16) | (w[i + 1u] << 16));
}

#if defined(TYPE_F32)
#define ROW_BYTES(cols) ((cols) * 4u)
float elem(uint rowb, uint c) { return w_f32(rowb + 4u * c); }
#elif defined(TYPE_F16)
#define ROW_BYTES(cols) ((cols) * 2u)
float elem(uint rowb, uint c) { return w_f16(rowb + 2u * c); }
#elif defined(TYPE_BF16)
#define ROW_BYTES(cols) ((cols) * 2u)
float elem(uint rowb, uint c) { return w_bf16(rowb + 2u * c); }
#elif defined(TYPE_Q8_0)
#define QUANT 1
#define BLOCK_BYTES 34u
#define ROW_BYTES(cols) ((cols) / 32u * 34u)
float elem(uint rowb, uint c) {
    uint b = rowb + (c >> 5) * 34u;
    int q = int(w_u8(b + 2u + (c & 31u)) << 24) >> 24;
    return w_f16(b) * float(q);
}
#elif defined(TYPE_Q4_0)
#define QUANT 1
#define BLOCK_BYTES 18u
#define ROW_BYTES(cols) ((cols) / 32u * 18u)
float elem(uint rowb, uint c) {
    uint b = rowb + (c >> 5) * 18u;
    uint j = c & 31u;
    uint q = w_u8(b + 2u + (j & 15u));
    q = j < 16u ? (q & 15u) : (q >> 4);
    return w_f16(b) * (float(q) - 8.0);
}
#elif defined(TYPE_Q4_1) || defined(TYPE_Q5_0) || defined(TYPE_Q5_1) || defined(TYPE_Q4_K) || defined(TYPE_Q5_K) \
    || defined(TYPE_Q6_K)
#include "dequant_k.glsl"  // the same interface (ROW_BYTES, elem) for these types
#else
#error "define one TYPE_<name>"
#endif
