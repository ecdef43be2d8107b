// The 16-row tiled layout of every quantized type the kernels take, shared by the repacking and
// dequantization (quant_tiles.cpp) and the GEMM microkernels (quant_gemm.cpp).
//
// A tile holds 16 output rows. Per block of 32 weights it stores the rows' quant bytes interleaved
// four at a time (chunk j, row r: the 4 bytes j*4..j*4+3 of row r's block), so one 16-lane integer
// dot product (vpdpbusd: 4 unsigned weight bytes times 4 activation bytes, broadcast) advances 16
// output rows at once and the per-row scales are vectors: no horizontal sums. A 4-bit block is 256
// bytes of nibbles, byte k of a row holding weight k (low) and weight k + 16 (high); an 8-bit block
// is 512 bytes of signed values. A 2-bit block (Q2_K, Q3_K) is 128 bytes, two planes of 64 in the
// order of the activations' words: the four weights of row r in word j (weights 4j..4j+3) at bits
// 2 (j / 2) of bytes r*4.. of plane j % 2, so a shift and a mask make word j's bytes. Q6_K's 6-bit
// values are a 4-bit block of their low bits followed by such planes of their high two bits. Q5_K's fifth bits and Q3_K's third bits follow the
// quants as 64 bytes of bit masks, one 64-bit word per activation word j (weights 4j..4j+3; for Q5_K
// the low nibbles of chunk j for j < 4, the high ones of chunk j - 4), bit i for byte i of the unpacked
// chunk: a masked add (AVX-512) or a byte compare (AVX2) turns them into bytes. IQ4_NL's and IQ4_XS's nibbles
// index ggml's kvalues_iq4nl (`kIQ4Values`), MXFP4's its kvalues_mxfp4 (`kMXFP4Values`): a byte
// shuffle turns them into values, plus 128 so that vpdpbusd takes them as unsigned. After the quants
// come the block's own per-row scales (h: the half block):
//   Q4_0    16 fp16 d                                   w = (q - 8) d
//   Q4_1    16 fp16 d, 16 fp16 m                        w = q d + m
//   Q8_0    16 fp16 d                                   w = q d
//   I8      nothing (one fp32 scale per row, outside)   w = q s
//   Q2_K    16 u8 sc | m << 4 per half                  w = (d sc_h) q - (dmin m_h), q of 2 bits
//   Q3_K    16 i8 sc (ggml's 6-bit minus 32) per half   w = (d sc_h) (q - 4), q of 3 bits
//   Q4_K    16 u8 sc, 16 u8 m                           w = (d sc) q - (dmin m)
//   Q5_K    16 u8 sc, 16 u8 m                           w = (d sc) q - (dmin m), q of 5 bits
//   Q6_K    16 i8 sc of weights 0-15, 16 of 16-31       w = (d sc) (q - 32), q of 6 bits
//   IQ4_NL  16 fp16 d                                   w = d kvalues[q]
//   IQ4_XS  16 i8 sc (ggml's 6-bit scale minus 32)      w = (d sc) kvalues[q]
//   MXFP4   16 fp16 d = 2^(e - 128)                     w = d kvalues_mxfp4[q] (exponents fp16 holds only)
// and the super-block types put a header before each super-block of 8 blocks (256 weights): 16
// fp16 d and 16 fp16 dmin (Q2_K, Q4_K, Q5_K) or 16 fp16 d (Q3_K, Q6_K, IQ4_XS). The bits are the
// file's: ggml's 6-bit scales and minimums unpacked to bytes, the K-quants' quants and high bits
// regrouped into the blocks of 32 the activations are quantized in, so dequantizing a tile gives
// ggml's values exactly. Against the file's blocks the tiles take 3.6% more memory (Q3_K), 2.8%
// (Q4_K), 2.3% (Q5_K), 1.5% (IQ4_XS) and nothing more (Q2_K, Q6_K, IQ4_NL).
#pragma once

#include "quant.h"

#include <cstring>

namespace conveyor {

// Types whose quants are nibbles (Q5_K: plus its bit masks), and those whose nibbles index kIQ4Values.
constexpr bool is4bit(int64_t t) {
    return t == Q4_0 || t == Q4_1 || t == Q4_K || t == Q5_K || t == IQ4_NL || t == IQ4_XS || t == MXFP4;
}
constexpr bool is_iq4(int64_t t) { return t == IQ4_NL || t == IQ4_XS || t == MXFP4; }
// The values an IQ4-style type's nibbles index.
constexpr const int8_t* iq4_values(int64_t t) { return t == MXFP4 ? kMXFP4Values : kIQ4Values; }
constexpr bool is2bit(int64_t t) { return t == Q2_K || t == Q3_K; }
// A scale per half block (16 weights).
constexpr bool has_half_scales(int64_t t) { return t == Q2_K || t == Q3_K || t == Q6_K; }
// The interleaved words of a block (2-bit planes, nibbles or bytes), and all its quants (Q3_K, Q5_K: the
// masks too; Q6_K: the planes of its high bits).
constexpr int64_t word_bytes(int64_t t) { return is2bit(t) ? 128 : is4bit(t) || t == Q6_K ? 256 : 512; }
constexpr int64_t quant_bytes(int64_t t) { return word_bytes(t) + (t == Q3_K || t == Q5_K ? 64 : t == Q6_K ? 128 : 0); }
// One block's quants and its own scales.
constexpr int64_t block_bytes(int64_t t) {
    switch (t) {
        case Q4_1: return 256 + 64;
        case I8: return 512;
        case IQ4_XS: return 256 + 16;
        default: return quant_bytes(t) + 32;  // Q4_0, Q8_0, IQ4_NL, MXFP4: 16 fp16; the K-quants: 32 bytes
    }
}
// The header before each group of blocks (a super-block), and the blocks in a group.
constexpr int64_t header_bytes(int64_t t) {
    return t == Q2_K || t == Q4_K || t == Q5_K ? 64 : t == Q3_K || t == Q6_K || t == IQ4_XS ? 32 : 0;
}
constexpr int64_t group_blocks(int64_t t) { return has_superblocks(t) ? QK_K / QK : 1; }
constexpr int64_t group_bytes(int64_t t) { return header_bytes(t) + group_blocks(t) * block_bytes(t); }

// Block b of a tile, and the header of its group (the tile's start for types without headers).
inline const uint8_t* tile_header(int64_t t, const uint8_t* tile, int64_t b) {
    return tile + b / group_blocks(t) * group_bytes(t);
}
inline const uint8_t* tile_block(int64_t t, const uint8_t* tile, int64_t b) {
    return tile_header(t, tile, b) + header_bytes(t) + b % group_blocks(t) * block_bytes(t);
}

// The mask bit (Q3_K, Q5_K) of weight e (0..31) of row r: byte r * 4 + e % 4 of word e / 4.
inline int high_bit(const uint8_t* masks, int r, int e) {
    const int i = r * 4 + e % 4;
    return masks[e / 4 * 8 + i / 8] >> (i % 8) & 1;
}

inline int two_bits(const uint8_t* planes, int r, int e) { return planes[e / 4 % 2 * 64 + r * 4 + e % 4] >> (2 * (e / 8)) & 3; }
inline int nibble(const uint8_t* blk, int r, int e) {
    const uint8_t byte = blk[(e % 16 / 4) * 64 + r * 4 + e % 4];
    return e < 16 ? byte & 0xF : byte >> 4;
}

// Weight e (0..31) of row r in a block, as the dot product takes it: a nibble 0..15 (Q5_K: 0..31),
// 2 bits (Q3_K: minus 4 with its third bit), Q6_K's 6 bits minus 32, an IQ4 value, or a signed byte.
inline int tiled_weight(int64_t t, const uint8_t* blk, int r, int e) {
    if (is2bit(t)) {
        const int q = two_bits(blk, r, e);
        return t == Q3_K ? q + 4 * high_bit(blk + 128, r, e) - 4 : q;
    }
    if (t == Q6_K) return (nibble(blk, r, e) | two_bits(blk + 256, r, e) << 4) - 32;
    if (is4bit(t)) {
        const int q = nibble(blk, r, e);
        if (t == Q5_K) return q | high_bit(blk + 256, r, e) << 4;
        return is_iq4(t) ? iq4_values(t)[q] : q;
    }
    return static_cast<int8_t>(blk[(e / 4) * 64 + r * 4 + e % 4]);
}

inline const uint16_t* fp16_scales(const uint8_t* p) { return reinterpret_cast<const uint16_t*>(p); }

// a * b rounded to fp32 on its own: never fused with a following add or subtract into an FMA (the
// kernels build with -ffp-contract=fast), so dequantized values are ggml's bit for bit.
inline float mul_rounded(float a, float b) {
    float p = a * b;
    __asm__("" : "+x"(p));
    return p;
}

// Row r's weight e of block b as ggml dequantizes it (row_scale: I8's scale of that row).
inline float tiled_value(int64_t t, const uint8_t* tile, int64_t b, int r, int e, float row_scale) {
    const uint8_t* blk = tile_block(t, tile, b);
    const uint8_t* head = tile_header(t, tile, b);
    const int q = tiled_weight(t, blk, r, e);
    const uint8_t* sc = blk + quant_bytes(t);
    switch (t) {
        case Q4_0: return (q - 8) * half_to_float(fp16_scales(sc)[r]);
        case Q4_1: return mul_rounded(q, half_to_float(fp16_scales(sc)[r])) + half_to_float(fp16_scales(sc)[16 + r]);
        case Q8_0: return q * half_to_float(fp16_scales(sc)[r]);
        case Q2_K: {
            const int packed = sc[e / 16 * 16 + r];
            const float dl = half_to_float(fp16_scales(head)[r]) * (packed & 0xF);
            return mul_rounded(dl, q) - mul_rounded(half_to_float(fp16_scales(head)[16 + r]), packed >> 4);
        }
        case Q3_K: return half_to_float(fp16_scales(head)[r]) * static_cast<int8_t>(sc[e / 16 * 16 + r]) * q;
        case Q4_K:
        case Q5_K: {
            const float d1 = half_to_float(fp16_scales(head)[r]) * sc[r];
            const float m1 = half_to_float(fp16_scales(head)[16 + r]) * sc[16 + r];
            return mul_rounded(d1, q) - m1;
        }
        case Q6_K: return half_to_float(fp16_scales(head)[r]) * static_cast<int8_t>(sc[e / 16 * 16 + r]) * q;
        case IQ4_NL:
        case MXFP4: return half_to_float(fp16_scales(sc)[r]) * q;
        case IQ4_XS: return half_to_float(fp16_scales(head)[r]) * static_cast<int8_t>(sc[r]) * q;
        default: return q * row_scale;
    }
}

}  // namespace conveyor
