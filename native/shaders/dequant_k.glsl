// Decoders for Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K weights: included by
// dequant.glsl when the includer defines one of TYPE_Q4_1 ... TYPE_Q6_K, and
// providing what dequant.glsl provides for the other types: ROW_BYTES(cols)
// and `float elem(uint rowb, uint c)` (element c of the row whose first byte
// is rowb), on top of dequant.glsl's byte readers (w_u8, w_f16, w_u32a2).
//
// QUANT is deliberately left undefined: matvec.glsl's QUANT path decodes
// Q8_0/Q4_0 words inline, so these types take its generic per-element path
// (elem).  BLOCK_ELEMS / BLOCK_BYTES name the block for any faster path.
//
// Block layouts are ggml's (ggml-common.h), every field at a fixed byte
// offset in the block, multi-byte fields little-endian; all block sizes are
// even, so f16 fields and qh words sit at even byte offsets (w_u32a2).
//   Q4_1 (20 B / 32): d f16, m f16, qs[16]: low nibbles elements 0..15,
//        high nibbles 16..31; value q * d + m.
//   Q5_0 (22 B / 32): d f16, qh[4] (uint32: bit j is element j's 5th bit),
//        qs[16] as Q4_1; value (q - 16) * d.
//   Q5_1 (24 B / 32): d f16, m f16, qh[4], qs[16]; value q * d + m.
//   Q4_K (144 B / 256): d f16, dmin f16, scales[12] (eight 6-bit scales and
//        eight 6-bit mins, packed as get_scale_min_k4), qs[128]: 64 elements
//        per 32 bytes, sub-block 2i in the low nibbles of bytes 32i..32i+31,
//        2i+1 in the high nibbles; value d * sc * q - dmin * m.
//   Q5_K (176 B / 256): d, dmin, scales[12] as Q4_K, qh[32] (bit s of
//        qh[l] is the 5th bit of element 32s + l), qs[128] as Q4_K.
//   Q6_K (210 B / 256): ql[128], qh[64], scales[16] (int8, one per 16
//        elements), d f16 last; each half of 128 elements uses 64 ql bytes
//        and 32 qh bytes: group g (of 32) takes the low (g < 2) or high
//        nibble of ql[32 * (g & 1) + l] and bits 2g..2g+1 of qh[l]; value
//        d * sc * (q - 32).

// Q4_K / Q5_K: the 6-bit scale and min of sub-block s (0..7) of the block
// at byte b (scales at b + 4), as ggml's get_scale_min_k4.
void k4_scale_min(uint b, uint s, out float sc, out float mn) {
    uint q = b + 4u;
    if (s < 4u) {
        sc = float(w_u8(q + s) & 63u);
        mn = float(w_u8(q + s + 4u) & 63u);
    } else {
        uint hi = w_u8(q + s + 4u);
        sc = float((hi & 15u) | ((w_u8(q + s - 4u) >> 6) << 4));
        mn = float((hi >> 4) | ((w_u8(q + s) >> 6) << 4));
    }
}

#if defined(TYPE_Q4_1)
#define BLOCK_ELEMS 32u
#define BLOCK_BYTES 20u
#define ROW_BYTES(cols) ((cols) / 32u * 20u)
float elem(uint rowb, uint c) {
    uint b = rowb + (c >> 5) * 20u;
    uint j = c & 31u;
    uint q = w_u8(b + 4u + (j & 15u));
    q = j < 16u ? (q & 15u) : (q >> 4);
    return w_f16(b) * float(q) + w_f16(b + 2u);
}
#elif defined(TYPE_Q5_0)
#define BLOCK_ELEMS 32u
#define BLOCK_BYTES 22u
#define ROW_BYTES(cols) ((cols) / 32u * 22u)
float elem(uint rowb, uint c) {
    uint b = rowb + (c >> 5) * 22u;
    uint j = c & 31u;
    uint q = w_u8(b + 6u + (j & 15u));
    q = (j < 16u ? (q & 15u) : (q >> 4)) | (((w_u32a2(b + 2u) >> j) & 1u) << 4);
    return w_f16(b) * (float(q) - 16.0);
}
#elif defined(TYPE_Q5_1)
#define BLOCK_ELEMS 32u
#define BLOCK_BYTES 24u
#define ROW_BYTES(cols) ((cols) / 32u * 24u)
float elem(uint rowb, uint c) {
    uint b = rowb + (c >> 5) * 24u;
    uint j = c & 31u;
    uint q = w_u8(b + 8u + (j & 15u));
    q = (j < 16u ? (q & 15u) : (q >> 4)) | (((w_u32a2(b + 4u) >> j) & 1u) << 4);
    return w_f16(b) * float(q) + w_f16(b + 2u);
}
#elif defined(TYPE_Q4_K)
#define BLOCK_ELEMS 256u
#define BLOCK_BYTES 144u
#define ROW_BYTES(cols) ((cols) / 256u * 144u)
float elem(uint rowb, uint c) {
    uint b = rowb + (c >> 8) * 144u;
    uint j = c & 255u;
    uint s = j >> 5;  // sub-block of 32
    float sc, mn;
    k4_scale_min(b, s, sc, mn);
    uint q = w_u8(b + 16u + ((j >> 6) << 5) + (j & 31u));
    q = (s & 1u) == 0u ? (q & 15u) : (q >> 4);
    return (w_f16(b) * sc) * float(q) - w_f16(b + 2u) * mn;
}
#elif defined(TYPE_Q5_K)
#define BLOCK_ELEMS 256u
#define BLOCK_BYTES 176u
#define ROW_BYTES(cols) ((cols) / 256u * 176u)
float elem(uint rowb, uint c) {
    uint b = rowb + (c >> 8) * 176u;
    uint j = c & 255u;
    uint s = j >> 5;
    uint l = j & 31u;
    float sc, mn;
    k4_scale_min(b, s, sc, mn);
    uint q = w_u8(b + 48u + ((j >> 6) << 5) + l);
    q = (s & 1u) == 0u ? (q & 15u) : (q >> 4);
    q |= ((w_u8(b + 16u + l) >> s) & 1u) << 4;
    return (w_f16(b) * sc) * float(q) - w_f16(b + 2u) * mn;
}
#elif defined(TYPE_Q6_K)
#define BLOCK_ELEMS 256u
#define BLOCK_BYTES 210u
#define ROW_BYTES(cols) ((cols) / 256u * 210u)
float elem(uint rowb, uint c) {
    uint b = rowb + (c >> 8) * 210u;
    uint j = c & 255u;
    uint n = j >> 7;          // half of 128
    uint g = (j >> 5) & 3u;   // group of 32 in the half
    uint l = j & 31u;
    uint q = w_u8(b + (n << 6) + ((g & 1u) << 5) + l);
    q = g < 2u ? (q & 15u) : (q >> 4);
    q |= ((w_u8(b + 128u + (n << 5) + l) >> (2u * g)) & 3u) << 4;
    int sc = int(w_u8(b + 192u + (n << 3) + (l >> 4) + 2u * g) << 24) >> 24;
    return (w_f16(b + 208u) * float(sc)) * (float(q) - 32.0);
}
#else
#error "dequant_k.glsl: define one of TYPE_Q4_1, TYPE_Q5_0, TYPE_Q5_1, TYPE_Q4_K, TYPE_Q5_K, TYPE_Q6_K"
#endif
