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

#if defined(NR) && defined(RPW)  // included by matvec.glsl: helpers of its mv_unit hook
vec4 xvec4(uint i);  // x[i .. i+3] (i a multiple of 4): defined by matvec.glsl after this include
// x[c + k .. c + k + 3] where c is the unit's first x index and k an offset
// in the unit (a multiple of 4): read from x, or where the kernel loaded the
// unit's x once for several rows (matvec.glsl's MV_ROWLANE: mvx).
// The hooks' arithmetic types: MV_XV holds x for 4 consecutive elements, MV_ACC a sum.  For one
// token (the matvec kernels) a vec4 and a float; for matvec.glsl's MC_NT == 4 (matmul_c_<type>:
// an invocation's rows times 4 tokens at once, each unit decoded once for the 4) a mat4 whose
// column t is token t's 4 values and a vec4 of the 4 tokens' sums: `v * X` (v: 4 decoded
// weights) is then the 4 tokens' dot products, so one hook body serves both.
#if defined(MC_NT) && MC_NT == 4
#define MV_XV mat4
#define MV_ACC vec4
#define MV_DOT(v, xv) ((v) * (xv))
#define MV_XSUM(xv) (vec4(1.0) * (xv))
#else
#define MV_XV vec4
#define MV_ACC float
#define MV_DOT(v, xv) dot(v, xv)
#define MV_XSUM(xv) dot(xv, vec4(1.0))
#endif
#ifdef MV_ROWLANE
// The MC_W2 hooks (Q8_0, Q5_0: 4 blocks a unit): n uvec2 from uvec2 index i0 into words wd[0 .. 2n - 1],
// and the f16 scale at the start of a block that begins on word wd0 (odd: 2 bytes into it).
#define W2_WORDS(wd, i0, n) \
    [[unroll]] for (uint i_ = 0u; i_ < (n); i_++) { uvec2 v_ = w2[(i0) + i_]; wd[2u * i_] = v_.x; wd[2u * i_ + 1u] = v_.y; }
float w2_scale(uint wd0, bool odd) { return unpackHalf2x16(odd ? (wd0 >> 16) : wd0).x; }
MV_XV mvx[32];  // the x of the unit being summed (at most 128 elements), loaded once for all a lane's rows
#define MVX(c, k) mvx[(k) >> 2]
#else
#define MVX(c, k) xvec4((c) + (k))
#endif

// Nibbles of a quant word: bytes k = 0..3, low (elements 4i+k) and high.
vec4 nib_lo(uint q) { return vec4(q & 15u, (q >> 8) & 15u, (q >> 16) & 15u, (q >> 24) & 15u); }
vec4 nib_hi(uint q) { return vec4((q >> 4) & 15u, (q >> 12) & 15u, (q >> 20) & 15u, q >> 28); }
// Bit `s` of each byte of h, as 0/16 (the 5th bit of Q5 types).
vec4 bit5(uint h, uint s) {
    return vec4((h >> s) & 1u, (h >> (s + 8u)) & 1u, (h >> (s + 16u)) & 1u, (h >> (s + 24u)) & 1u) * 16.0;
}
// Bits 32k + s, 32k + s + 1, ... of a 32-bit mask word (Q5_0/Q5_1 qh) as 0/16.
vec4 bit5w(uint h, uint s) {
    return vec4((h >> s) & 1u, (h >> (s + 1u)) & 1u, (h >> (s + 2u)) & 1u, (h >> (s + 3u)) & 1u) * 16.0;
}
#endif

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
#define BLOCK_ELEMS 32u
#define BLOCK_BYTES 34u
#define ROW_BYTES(cols) ((cols) / 32u * 34u)
float elem(uint rowb, uint c) {
    uint b = rowb + (c >> 5) * 34u;
    int q = int(w_u8(b + 2u + (c & 31u)) << 24) >> 24;
    return w_f16(b) * float(q);
}
#elif defined(TYPE_Q4_0)
#define BLOCK_ELEMS 32u
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
#elif defined(TYPE_MXFP4)
#include "dequant_mxfp4.glsl"  // ditto, and matvec.glsl's mv_unit hook
#else
#error "define one TYPE_<name>"
#endif

#if defined(MV_ROWLANE) && defined(TYPE_Q8_0) && defined(MC_W2)
// matvec_c_q8_0 / matmul_c_q8_0 (CPU devices, MC_W2: rows 8-byte aligned, cols a multiple of 128;
// the _any forms otherwise): a unit is 4 blocks, 136 bytes, read as 17 uvec2 (lavapipe, Mesa
// 22.3, turns every storage-buffer load into a loop over the SIMD lanes: 17 loads where the
// block hook makes 36).  Block j of the unit starts at word 17 (j / 2) + 8 (j % 2): even j on a
// word (the scale the low half of its word 0), odd j 2 bytes into one (the scale the high half,
// quant word i = word i + 1): fixed places, where a lane per row otherwise chooses per lane
// between the two reads.  262144 x 640 Q8_0 on lavapipe, alternating rounds, load 1: 200 ms ->
// 170 (median of 6; docs/benchmarks.md's CPU section).
#define MV_UNIT 128u
MV_ACC mv_unit(uint rowb, uint u, uint xb) {
    uint i0 = (rowb >> 3) + 17u * u;
    uint wd[34];
    W2_WORDS(wd, i0, 17u)
    MV_ACC s = MV_ACC(0.0);
    [[unroll]] for (uint j = 0u; j < 4u; j++) {
        const uint b0 = 17u * (j >> 1) + 8u * (j & 1u);
        const bool odd = (j & 1u) != 0u;
        float d = w2_scale(wd[b0], odd);
        MV_ACC sb = MV_ACC(0.0);
        [[unroll]] for (uint i = 0u; i < 8u; i++) {
            int q = int(odd ? wd[b0 + 1u + i] : ((wd[b0 + i] >> 16) | (wd[b0 + i + 1u] << 16)));
            vec4 v = vec4(bitfieldExtract(q, 0, 8), bitfieldExtract(q, 8, 8), bitfieldExtract(q, 16, 8),
                          bitfieldExtract(q, 24, 8));
            sb += MV_DOT(v, MVX(0u, 32u * j + 4u * i));
        }
        s += d * sb;
    }
    return s;
}
#elif defined(NR) && defined(RPW) && (defined(TYPE_Q8_0) || defined(TYPE_Q4_0))
// matvec.glsl's hook for these types: one 32-element block, read as the
// aligned words that cover it.  A block at byte b: if b is a multiple of 4,
// word 0 holds the scale then two quant bytes, and quant word i (quants
// 4i..4i+3) is (wd[i] >> 16) | (wd[i+1] << 16); if b is 2 mod 4, the scale
// is wd[0]'s high half and quant word i is wd[i+1].  Every word is loaded
// before any is used (memory latency).
#define MV_UNIT 32u
MV_ACC mv_unit(uint rowb, uint u, uint xb) {
    uint b = rowb + u * BLOCK_BYTES;
#if defined(TYPE_Q8_0)
    const uint NW = 9u;   // words covering 34 bytes at an even offset
#else
    const uint NW = 5u;   // 18 bytes
#endif
    uint wd[NW];
    [[unroll]] for (uint i = 0u; i < NW; i++) {
        wd[i] = w[(b >> 2) + i];
    }
    bool odd = (b & 2u) != 0u;
    float d = unpackHalf2x16(odd ? (wd[0] >> 16) : wd[0]).x;
    uint c = xb + (u << 5);
    MV_ACC s = MV_ACC(0.0);
#if defined(TYPE_Q8_0)
    [[unroll]] for (uint i = 0u; i < 8u; i++) {
        int q = int(odd ? wd[i + 1u] : ((wd[i] >> 16) | (wd[i + 1u] << 16)));
        vec4 v = vec4(bitfieldExtract(q, 0, 8), bitfieldExtract(q, 8, 8), bitfieldExtract(q, 16, 8),
                      bitfieldExtract(q, 24, 8));
        s += MV_DOT(v, MVX(c, 4u * i));
    }
#else  // Q4_0: quant word i holds elements 4i..4i+3 (low nibbles) and 16+4i.. (high)
    [[unroll]] for (uint i = 0u; i < 4u; i++) {
        uint q = odd ? wd[i + 1u] : ((wd[i] >> 16) | (wd[i + 1u] << 16));
        s += MV_DOT(nib_lo(q) - 8.0, MVX(c, 4u * i)) + MV_DOT(nib_hi(q) - 8.0, MVX(c, 16u + 4u * i));
    }
#endif
    return d * s;
}
#endif

#if defined(MV_WORDS) && defined(TYPE_Q8_0)
// matvec.glsl's word-per-thread hook: quant word j (int8 elements 4j..4j+3)
// of a block (mw_w: its weights decoded, once for all the tokens; mw_dot:
// their dot with one token's x).  Blocks sit at 0 or 2 mod 4, alternately, so neighbouring
// threads disagree: both covering words are loaded (adjacent, one line) and
// the word picked with a shift instead of a branch.
#define MW_WPB 8u
#define MW_WU 4u
struct MwX { vec4 xa; };
struct MwW { vec4 v; float d; };
MwX mw_x(uint blk, uint j, uint xb) {
    return MwX(xvec4(xb + (blk << 5) + 4u * j));
}
MwW mw_w(uint rowb, uint blk, uint j) {
    uint b = rowb + blk * 34u;
    uint o = b + 2u + 4u * j, i = o >> 2;
    uint lo = w[i], hi = w[i + 1u], dw = w[b >> 2];
    uint sh = (o & 2u) << 3;  // 0 or 16
    int q = int(sh == 0u ? lo : (lo >> 16) | (hi << 16));
    float d = unpackHalf2x16((b & 2u) == 0u ? dw : dw >> 16).x;
    vec4 v = vec4(bitfieldExtract(q, 0, 8), bitfieldExtract(q, 8, 8), bitfieldExtract(q, 16, 8),
                  bitfieldExtract(q, 24, 8));
    return MwW(v, d);
}
float mw_dot(MwW wv, MwX xv) { return wv.d * dot(wv.v, xv.xa); }
#endif
