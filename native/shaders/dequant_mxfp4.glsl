// MXFP4 weight decoding (ggml type 39, gpt-oss's expert matrices), included
// by dequant.glsl for TYPE_MXFP4: the same interface as the other types
// (ROW_BYTES, elem; and matvec.glsl's mv_unit hook).
//
// ggml's block_mxfp4: 17 bytes, one E8M0 scale byte e then 16 bytes whose
// low nibbles are elements 0..15 and high nibbles 16..31.  A nibble is an
// E2M1 value, kept doubled as the integers of kvalues_mxfp4 (0, 1, 2, 3, 4,
// 6, 8, 12 and their negatives), so the scale is half of 2^(e - 127):
// 2^(e - 128), i.e. the float whose bits are (e - 1) << 23 (e < 2 gives a
// denormal: ggml's 0x00200000 << e).  17 bytes is odd: a block, and so a
// row, may start at any byte, so mv_unit reads the 5 words covering a block
// and funnels bytes out of them.

#define BLOCK_ELEMS 32u
#define BLOCK_BYTES 17u
#define ROW_BYTES(cols) ((cols) / 32u * 17u)

const float MXFP4_KV[16] = float[16](0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0,
                                     0.0, -1.0, -2.0, -3.0, -4.0, -6.0, -8.0, -12.0);

float mxfp4_scale(uint e) {
    return uintBitsToFloat(e < 2u ? (0x00200000u << e) : ((e - 1u) << 23));
}

float elem(uint rowb, uint c) {
    uint b = rowb + (c >> 5) * 17u;
    uint j = c & 31u;
    uint q = w_u8(b + 1u + (j & 15u));
    q = j < 16u ? (q & 15u) : (q >> 4);
    return mxfp4_scale(w_u8(b)) * MXFP4_KV[q];
}

#if defined(NR) && defined(RPW)
// The 32 bits at bit o (0..31) of the pair lo, hi.
uint mx_funnel(uint lo, uint hi, uint o) { return o == 0u ? lo : (lo >> o) | (hi << (32u - o)); }

#define MV_UNIT 32u
float mv_unit(uint rowb, uint u, uint xb) {
    uint b = rowb + u * 17u;
    uint wd[5];  // bytes b .. b + 16 lie in words b/4 .. b/4 + 4, whatever b mod 4
    [[unroll]] for (uint i = 0u; i < 5u; i++) {
        wd[i] = w[(b >> 2) + i];
    }
    float d = mxfp4_scale((wd[0] >> ((b & 3u) << 3)) & 0xFFu);
    uint wi = ((b + 1u) >> 2) - (b >> 2);  // word holding the first quant byte (0 or 1)
    uint o = ((b + 1u) & 3u) << 3;
    uint c = xb + (u << 5);
    float s = 0.0;
    [[unroll]] for (uint i = 0u; i < 4u; i++) {  // quant word i: elements 4i..4i+3 (low), 16+4i.. (high)
        uint q = mx_funnel(wd[wi + i], wd[min(wi + i + 1u, 4u)], o);
        vec4 lo = vec4(MXFP4_KV[q & 15u], MXFP4_KV[(q >> 8) & 15u], MXFP4_KV[(q >> 16) & 15u],
                       MXFP4_KV[(q >> 24) & 15u]);
        vec4 hi = vec4(MXFP4_KV[(q >> 4) & 15u], MXFP4_KV[(q >> 12) & 15u], MXFP4_KV[(q >> 20) & 15u],
                       MXFP4_KV[q >> 28]);
        s += dot(lo, xvec4(c + 4u * i)) + dot(hi, xvec4(c + 16u + 4u * i));
    }
    return d * s;
}
#endif
