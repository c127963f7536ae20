// Decoders for Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K weights: included by
// dequant.glsl when the includer defines one of TYPE_Q4_1 ... TYPE_Q6_K, and
// providing what dequant.glsl provides for the other types: ROW_BYTES(cols)
// and `float elem(uint rowb, uint c)` (element c of the row whose first byte
// is rowb), on top of dequant.glsl's byte readers (w_u8, w_f16, w_u32a2).
//
// BLOCK_ELEMS / BLOCK_BYTES name the block.
//
// Included by matvec.glsl (recognized by its NR and RPW), these types also
// define MV_UNIT and mv_unit() (matvec.glsl's faster hook): a lane decodes a
// whole unit of a block from uint32 words (w_u32a2: blocks of 22 and 210
// bytes sit at 2 mod 4 every other one) and dots it with x read as vec4s,
// scales applied once per sub-block.  Units: a 32-element block for
// Q4_1/Q5_0/Q5_1; for the K-quants 64 elements, the pair of 32-element
// groups that share quant bytes (low and high nibbles).
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

#if defined(NR) && defined(RPW)  // included by matvec.glsl: the MV_UNIT hook (helpers in dequant.glsl)

#if defined(MV_ROWLANE) && defined(TYPE_Q5_0) && defined(MC_W2)
// matvec_c_q5_0 (CPU devices, MC_W2: rows 8-byte aligned, cols a multiple of 128; matvec_c_q5_0_any
// otherwise), as dequant.glsl's Q8_0 form: 4 blocks (88 bytes) a unit, read as 11 uvec2, each
// block's words at fixed places (block j at word 11 (j / 2) + 5 (j % 2), odd j 2 bytes into it),
// so no per-lane choice between word-aligned and straddling reads (w_u32a2).
#define MV_UNIT 128u
MV_ACC mv_unit(uint rowb, uint u, uint xb) {
    uint i0 = (rowb >> 3) + 11u * u;
    uint wd[22];
    W2_WORDS(wd, i0, 11u)
    MV_ACC s = MV_ACC(0.0);
    [[unroll]] for (uint j = 0u; j < 4u; j++) {
        const uint b0 = 11u * (j >> 1) + 5u * (j & 1u);
        const bool odd = (j & 1u) != 0u;
        float d = w2_scale(wd[b0], odd);
        uint qh = odd ? wd[b0 + 1u] : ((wd[b0] >> 16) | (wd[b0 + 1u] << 16));
        MV_ACC sb = MV_ACC(0.0), sx = MV_ACC(0.0);
        [[unroll]] for (uint i = 0u; i < 4u; i++) {
            uint q = odd ? wd[b0 + 2u + i] : ((wd[b0 + 1u + i] >> 16) | (wd[b0 + 2u + i] << 16));
            MV_XV xl = MVX(0u, 32u * j + 4u * i), xh = MVX(0u, 32u * j + 16u + 4u * i);
            sb += MV_DOT(nib_lo(q) + bit5w(qh, 4u * i), xl) + MV_DOT(nib_hi(q) + bit5w(qh, 16u + 4u * i), xh);
            sx += MV_XSUM(xl) + MV_XSUM(xh);
        }
        s += d * (sb - 16.0 * sx);
    }
    return s;
}
#elif defined(TYPE_Q4_1) || defined(TYPE_Q5_0) || defined(TYPE_Q5_1)
#define MV_UNIT 32u
MV_ACC mv_unit(uint rowb, uint u, uint xb) {
    uint b = rowb + u * BLOCK_BYTES;
    uint c = xb + (u << 5);
#if defined(TYPE_Q5_0)
    const uint QS = 6u;
    float d = w_f16(b);
    uint qh = w_u32a2(b + 2u);
#elif defined(TYPE_Q5_1)
    const uint QS = 8u;
    vec2 dm = unpackHalf2x16(w_u32a2(b));
    uint qh = w_u32a2(b + 4u);
#else
    const uint QS = 4u;
    vec2 dm = unpackHalf2x16(w_u32a2(b));
#endif
    MV_ACC s = MV_ACC(0.0), sx = MV_ACC(0.0);
    [[unroll]] for (uint i = 0u; i < 4u; i++) {
        uint q = w_u32a2(b + QS + 4u * i);
        MV_XV xl = MVX(c, 4u * i), xh = MVX(c, 16u + 4u * i);
        vec4 lo = nib_lo(q), hi = nib_hi(q);
#if defined(TYPE_Q5_0) || defined(TYPE_Q5_1)
        lo += bit5w(qh, 4u * i);
        hi += bit5w(qh, 16u + 4u * i);
#endif
        s += MV_DOT(lo, xl) + MV_DOT(hi, xh);
        sx += MV_XSUM(xl) + MV_XSUM(xh);
    }
#if defined(TYPE_Q5_0)
    return d * (s - 16.0 * sx);
#else
    return dm.x * s + dm.y * sx;
#endif
}
#elif defined(TYPE_Q4_K) || defined(TYPE_Q5_K)
#define MV_UNIT 64u
// 6-bit scale and min of sub-block s from the three scale words (as k4_scale_min).
// Branch-free: neighbouring lanes take different sub-blocks.
void k4_sm(uint s0, uint s1, uint s2, uint s, out float sc, out float mn) {
    uint t = 8u * (s & 3u);
    bool lo = s < 4u;
    sc = float(lo ? (s0 >> t) & 63u : ((s2 >> t) & 15u) | (((s0 >> (t + 6u)) & 3u) << 4));
    mn = float(lo ? (s1 >> t) & 63u : ((s2 >> (t + 4u)) & 15u) | (((s1 >> (t + 6u)) & 3u) << 4));
}
MV_ACC mv_unit(uint rowb, uint u, uint xb) {
    uint b = rowb + (u >> 2) * BLOCK_BYTES;
    uint j = u & 3u;  // sub-blocks 2j (low nibbles) and 2j + 1 (high)
    uint c = xb + (u << 6);
#if defined(TYPE_Q5_K)
    const uint QS = 48u;
#else
    const uint QS = 16u;
#endif
    // The words: d/dmin, 3 of scales, 8 of quants (+ 8 of qh for Q5_K).
    // Blocks of 144 and 176 bytes keep a row's word alignment: when the row
    // starts on a word (always, in practice: Ops aligns bindings, tensors
    // are aligned) they are plain loads, else reassembled (w_u32a2).  The
    // branch is uniform (rowb is the subgroup's row).
    uint hd[4], qw[8], hw[8];
    if ((rowb & 3u) == 0u) {
        uint wb = b >> 2;
        [[unroll]] for (uint i = 0u; i < 4u; i++) {
            hd[i] = w[wb + i];
        }
        [[unroll]] for (uint i = 0u; i < 8u; i++) {
            qw[i] = w[wb + QS / 4u + 8u * j + i];
#if defined(TYPE_Q5_K)
            hw[i] = w[wb + 4u + i];
#endif
        }
    } else {
        [[unroll]] for (uint i = 0u; i < 4u; i++) {
            hd[i] = w_u32a2(b + 4u * i);
        }
        [[unroll]] for (uint i = 0u; i < 8u; i++) {
            qw[i] = w_u32a2(b + QS + 32u * j + 4u * i);
#if defined(TYPE_Q5_K)
            hw[i] = w_u32a2(b + 16u + 4u * i);
#endif
        }
    }
    vec2 dm = unpackHalf2x16(hd[0]);
    float sc0, mn0, sc1, mn1;
    k4_sm(hd[1], hd[2], hd[3], 2u * j, sc0, mn0);
    k4_sm(hd[1], hd[2], hd[3], 2u * j + 1u, sc1, mn1);
    MV_ACC sl = MV_ACC(0.0), sh = MV_ACC(0.0), xl_sum = MV_ACC(0.0), xh_sum = MV_ACC(0.0);
    [[unroll]] for (uint i = 0u; i < 8u; i++) {
        uint q = qw[i];
        MV_XV xl = MVX(c, 4u * i), xh = MVX(c, 32u + 4u * i);
        vec4 lo = nib_lo(q), hi = nib_hi(q);
#if defined(TYPE_Q5_K)
        uint h = hw[i];  // qh[4i .. 4i+3]: bit s is sub-block s's 5th bit
        lo += bit5(h, 2u * j);
        hi += bit5(h, 2u * j + 1u);
#endif
        sl += MV_DOT(lo, xl);
        sh += MV_DOT(hi, xh);
        xl_sum += MV_XSUM(xl);
        xh_sum += MV_XSUM(xh);
    }
    return dm.x * (sc0 * sl + sc1 * sh) - dm.y * (mn0 * xl_sum + mn1 * xh_sum);
}
#elif defined(TYPE_Q6_K)
#define MV_UNIT 64u
// The x index of the unit's 4i-th value (MVX's k = 4i): elements 0..31 of a
// group and the 32 of group h + 2, 64 on.
#define MV_XAT(u, i) ((((u) >> 2) << 8) + ((((u) >> 1) & 1u) << 7) + (((u) & 1u) << 5) + 4u * (i) \
                      + ((i) >= 8u ? 32u : 0u))
#ifdef MV_ROWLANE
#define MVX6(c, k) mvx[(k) >> 2]
#else
#define MVX6(c, k) xvec4((c) + ((k) < 32u ? (k) : (k) + 32u))  // unit offset k -> x index
#endif
MV_ACC mv_unit(uint rowb, uint u, uint xb) {
    uint b = rowb + (u >> 2) * BLOCK_BYTES;
    uint n = (u >> 1) & 1u;  // half of the block
    uint h = u & 1u;         // groups h (low nibbles) and h + 2 (high) of the half
    uint c = xb + ((u >> 2) << 8) + (n << 7) + (h << 5);
    float d = w_f16(b + 208u);
    uint sb = b + 192u + (n << 3) + 2u * h;  // scales of group h: sb, sb + 1; of group h + 2: sb + 4, sb + 5
    MV_ACC s = MV_ACC(0.0);
    [[unroll]] for (uint half16 = 0u; half16 < 2u; half16++) {  // l < 16, l >= 16: their own scales
        MV_ACC sa = MV_ACC(0.0), sbb = MV_ACC(0.0);
        [[unroll]] for (uint i = 4u * half16; i < 4u * half16 + 4u; i++) {
            uint q = w_u32a2(b + (n << 6) + (h << 5) + 4u * i);
            uint hh = w_u32a2(b + 128u + (n << 5) + 4u * i);
            vec4 lo = nib_lo(q) + 16.0 * vec4((hh >> (2u * h)) & 3u, (hh >> (2u * h + 8u)) & 3u,
                                              (hh >> (2u * h + 16u)) & 3u, (hh >> (2u * h + 24u)) & 3u);
            vec4 hi = nib_hi(q) + 16.0 * vec4((hh >> (2u * h + 4u)) & 3u, (hh >> (2u * h + 12u)) & 3u,
                                              (hh >> (2u * h + 20u)) & 3u, (hh >> (2u * h + 28u)) & 3u);
            sa += MV_DOT(lo - 32.0, MVX6(c, 4u * i));
            sbb += MV_DOT(hi - 32.0, MVX6(c, 32u + 4u * i));  // x[c + 64 + 4i ..]
        }
        int ka = int(w_u8(sb + half16) << 24) >> 24, kb = int(w_u8(sb + 4u + half16) << 24) >> 24;
        s += float(ka) * sa + float(kb) * sbb;
    }
    return d * s;
}
#endif

#if defined(MV_WORDS) && defined(TYPE_Q4_K)
// matvec.glsl's hook: unit j (0..7) of a block is qs bytes 16j .. 16j+15,
// half h = j % 2 of 32-byte group g = j / 2: low nibbles are elements
// 64g + 16h + 0..15 (sub-block 2g), high ones 32 further (2g + 1).  The
// kernel runs only on rows that start on 16 bytes, and 144-byte blocks keep
// that: the header and the unit are one uvec4 load each.
#define MW_WPB 8u
#define MW_WU 1u
struct MwX { vec4 lo[4]; vec4 hi[4]; float slo; float shi; };
MwX mw_x(uint blk, uint j, uint xb) {
    uint c = xb + (blk << 8) + ((j >> 1) << 6) + ((j & 1u) << 4);
    MwX v;
    v.slo = 0.0;
    v.shi = 0.0;
    [[unroll]] for (uint i = 0u; i < 4u; i++) {
        v.lo[i] = xvec4(c + 4u * i);
        v.hi[i] = xvec4(c + 32u + 4u * i);
        v.slo += dot(v.lo[i], vec4(1.0));
        v.shi += dot(v.hi[i], vec4(1.0));
    }
    return v;
}
struct MwW { vec4 lo[4]; vec4 hi[4]; vec2 dm; float sc0; float mn0; float sc1; float mn1; };
MwW mw_w(uint rowb, uint blk, uint j) {
    uint b4 = (rowb >> 4) + blk * 9u;  // 144 bytes = 9 uvec4s
    uvec4 hd = w4[b4], q = w4[b4 + 1u + j];
    uint g = j >> 1;
    MwW v;
    v.dm = unpackHalf2x16(hd.x);
    k4_sm(hd.y, hd.z, hd.w, 2u * g, v.sc0, v.mn0);
    k4_sm(hd.y, hd.z, hd.w, 2u * g + 1u, v.sc1, v.mn1);
    v.lo[0] = nib_lo(q.x); v.lo[1] = nib_lo(q.y); v.lo[2] = nib_lo(q.z); v.lo[3] = nib_lo(q.w);
    v.hi[0] = nib_hi(q.x); v.hi[1] = nib_hi(q.y); v.hi[2] = nib_hi(q.z); v.hi[3] = nib_hi(q.w);
    return v;
}
float mw_dot(MwW wv, MwX xv) {
    float sl = dot(wv.lo[0], xv.lo[0]) + dot(wv.lo[1], xv.lo[1]) + dot(wv.lo[2], xv.lo[2])
             + dot(wv.lo[3], xv.lo[3]);
    float sh = dot(wv.hi[0], xv.hi[0]) + dot(wv.hi[1], xv.hi[1]) + dot(wv.hi[2], xv.hi[2])
             + dot(wv.hi[3], xv.hi[3]);
    return wv.dm.x * (wv.sc0 * sl + wv.sc1 * sh) - wv.dm.y * (wv.mn0 * xv.slo + wv.mn1 * xv.shi);
}
#elif defined(MV_WORDS) && defined(TYPE_Q6_K)
// matvec.glsl's word-per-lane hook: ql word j (0..31) of a block: half
// n = j / 16, bytes l = 4(j % 16) .. +3 of the half's 64 ql bytes; with
// lo = l / 32 and m = l % 32, low nibbles are group lo (elements 32 lo + m
// of the half), high ones group lo + 2 (64 further); their upper two bits
// are bits 2 lo and 2 lo + 4 of qh[32n + m ..]; scales one per 16 elements.
#define MW_WPB 32u
#define MW_WU 2u
struct MwX { vec4 xa; vec4 xh; };
MwX mw_x(uint blk, uint j, uint xb) {
    uint l = 4u * (j & 15u);
    uint c = xb + (blk << 8) + ((j >> 4) << 7) + ((l >> 5) << 5) + (l & 31u);
    return MwX(xvec4(c), xvec4(c + 64u));
}
struct MwW { vec4 va; vec4 vb; float ka; float kb; float d; };  // va, vb less 32
MwW mw_w(uint rowb, uint blk, uint j) {
    uint b = rowb + blk * 210u;
    uint n = j >> 4, l = 4u * (j & 15u);
    uint lo = l >> 5, m = l & 31u;
    uint q = w_u32a2(b + (n << 6) + l);
    uint h = w_u32a2(b + 128u + (n << 5) + m);
    uint sa = 2u * lo, sb = 2u * lo + 4u;
    vec4 va = nib_lo(q) + 16.0 * vec4((h >> sa) & 3u, (h >> (sa + 8u)) & 3u, (h >> (sa + 16u)) & 3u, (h >> (sa + 24u)) & 3u);
    vec4 vb = nib_hi(q) + 16.0 * vec4((h >> sb) & 3u, (h >> (sb + 8u)) & 3u, (h >> (sb + 16u)) & 3u, (h >> (sb + 24u)) & 3u);
    uint sc = b + 192u + (n << 3) + 2u * lo + (m >> 4);
    int ka = int(w_u8(sc) << 24) >> 24, kb = int(w_u8(sc + 4u) << 24) >> 24;
    return MwW(va - 32.0, vb - 32.0, float(ka), float(kb), w_f16(b + 208u));
}
float mw_dot(MwW wv, MwX xv) { return wv.d * (wv.ka * dot(wv.va, xv.xa) + wv.kb * dot(wv.vb, xv.xh)); }
#endif
#endif  // matvec.glsl
