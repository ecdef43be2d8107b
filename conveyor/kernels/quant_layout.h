// The 16-row tiled layout of every quantized type the kernels take, shared by the repacking and
// dequantization (quant_tiles.cpp) and the GEMM microkernels (quant_gemm.cpp).
//
// A tile holds 16 output rows. Per block of 32 weights it stores the rows' quant bytes interleaved
// four at a time (chunk j, row r: the 4 bytes j*4..j*4+3 of row r's block), so one 16-lane integer
// dot product (vpdpbusd: 4 unsigned weight bytes times 4 activation bytes, broadcast) advances 16
// output rows at once and the per-row scales are vectors: no horizontal sums. A 4-bit block is 256
// bytes of nibbles, byte k of a row holding weight k (low) and weight k + 16 (high); an 8-bit block
// is 512 bytes of signed values. After the quants come the block's own per-row scales:
//   Q4_0  16 fp16 d                                   w = (q - 8) d
//   Q4_1  16 fp16 d, 16 fp16 m                        w = q d + m
//   Q8_0  16 fp16 d                                   w = q d
//   I8    nothing (one fp32 scale per row, outside)   w = q s
//   Q4_K  16 u8 sc, 16 u8 m                           w = (d sc) q - (dmin m)
//   Q6_K  16 i8 sc of weights 0-15, 16 of 16-31       w = (d sc) (q - 32), stored as q - 32
// and the K-quants put a header before each super-block of 8 blocks (256 weights): 16 fp16 d and 16
// fp16 dmin (Q4_K) or 16 fp16 d (Q6_K). The bits are the file's: ggml's 6-bit scales and minimums
// unpacked to bytes, the K-quants' nibbles and 6-bit values regrouped into the blocks of 32 the
// activations are quantized in, so dequantizing a tile gives ggml's values exactly (Q4_K tiles take
// 2.8% more memory than the file's blocks, Q6_K tiles 30%: their 6-bit values as bytes).
#pragma once

#include "quant.h"

#include <cstring>

namespace conveyor {

constexpr bool is4bit(int64_t t) { return t == Q4_0 || t == Q4_1 || t == Q4_K; }
constexpr bool is_kquant(int64_t t) { return t == Q4_K || t == Q6_K; }
constexpr int64_t quant_bytes(int64_t t) { return is4bit(t) ? 256 : 512; }
// One block's quants and its own scales.
constexpr int64_t block_bytes(int64_t t) {
    switch (t) {
        case Q4_1: return 256 + 64;
        case I8: return 512;
        default: return quant_bytes(t) + 32;  // Q4_0, Q8_0: 16 fp16; Q4_K, Q6_K: 32 bytes
    }
}
// The header before each group of blocks (a K-quant super-block), and the blocks in a group.
constexpr int64_t header_bytes(int64_t t) { return t == Q4_K ? 64 : t == Q6_K ? 32 : 0; }
constexpr int64_t group_blocks(int64_t t) { return is_kquant(t) ? QK_K / QK : 1; }
constexpr int64_t group_bytes(int64_t t) { return header_bytes(t) + group_blocks(t) * block_bytes(t); }

// Block b of a tile, and the header of its group (the tile's start for types without headers).
inline const uint8_t* tile_header(int64_t t, const uint8_t* tile, int64_t b) {
    return tile + b / group_blocks(t) * group_bytes(t);
}
inline const uint8_t* tile_block(int64_t t, const uint8_t* tile, int64_t b) {
    return tile_header(t, tile, b) + header_bytes(t) + b % group_blocks(t) * block_bytes(t);
}

// Weight e (0..31) of row r in a block, as stored: a nibble 0..15, or a signed byte.
inline int tiled_weight(int64_t t, const uint8_t* blk, int r, int e) {
    if (is4bit(t)) {
        const uint8_t byte = blk[(e % 16 / 4) * 64 + r * 4 + e % 4];
        return e < 16 ? byte & 0xF : byte >> 4;
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
        case Q4_K: {
            const float d1 = half_to_float(fp16_scales(head)[r]) * sc[r];
            const float m1 = half_to_float(fp16_scales(head)[16 + r]) * sc[16 + r];
            return mul_rounded(d1, q) - m1;
        }
        case Q6_K: return half_to_float(fp16_scales(head)[r]) * static_cast<int8_t>(sc[e / 16 * 16 + r]) * q;
        default: return q * row_scale;
    }
}

}  // namespace conveyor
