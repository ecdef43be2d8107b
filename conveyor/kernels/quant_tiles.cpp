// The tiled layout (quant_layout.h): GGUF rows, our I8 and dense bf16 and fp32 rows repacked into tiles once at
// load, and tiles dequantized (rows for embedding lookups, whole matrices for the AMX CPUs' prefill
// path), to ggml's values bit for bit.
#include "quant_layout.h"


#include <cstring>

namespace conveyor {
namespace {

// ggml's get_scale_min_k4: the 6-bit scale and minimum of Q4_K's sub-block j.
inline void scale_min_k4(int j, const uint8_t* q, uint8_t* sc, uint8_t* m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Sub-block j (a block of 32) of a Q4_K or Q5_K super-block `s` into row r of a tile: its nibbles from
// 32-byte chunk j / 2 (low ones for even j) in tile order into `qs`, its scale and minimum into
// `scales`[r] and [16 + r], d and dmin into the group's header.
template <typename Block>
inline void k4_sub_block(const Block* s, int j, int r, uint8_t* qs, uint8_t* scales, uint8_t* head) {
    const uint8_t* q = s->qs + 32 * (j / 2);
    for (int k = 0; k < 16; ++k) {
        const int lo = j % 2 ? q[k] >> 4 : q[k] & 0xF, hi = j % 2 ? q[k + 16] >> 4 : q[k + 16] & 0xF;
        qs[k] = static_cast<uint8_t>(lo | hi << 4);
    }
    scale_min_k4(j, s->scales, &scales[r], &scales[16 + r]);
    reinterpret_cast<uint16_t*>(head)[r] = s->d, reinterpret_cast<uint16_t*>(head)[16 + r] = s->dmin;
}

// The quant bytes of one GGUF row's block b in tile order (4-bit: byte k = weight k | weight k + 16 << 4;
// 8-bit: 32 signed bytes; 2-bit: written in place) and its scales (and Q3_K's and Q5_K's mask bits)
// written into row r's slots of the tile's block and header.
void repack_block(int64_t type, const uint8_t* row, int64_t b, int r, uint8_t* blk, uint8_t* head) {
    uint8_t qs[32];
    uint16_t* sc16 = reinterpret_cast<uint16_t*>(blk + quant_bytes(type));
    switch (type) {
        case Q4_0: {
            auto* s = reinterpret_cast<const BlockQ4_0*>(row) + b;
            std::memcpy(qs, s->qs, 16), sc16[r] = s->d;
            break;
        }
        case Q4_1: {
            auto* s = reinterpret_cast<const BlockQ4_1*>(row) + b;
            std::memcpy(qs, s->qs, 16), sc16[r] = s->d, sc16[16 + r] = s->m;
            break;
        }
        case Q8_0: {
            auto* s = reinterpret_cast<const BlockQ8_0*>(row) + b;
            std::memcpy(qs, s->qs, 32), sc16[r] = s->d;
            break;
        }
        case Q2_K:
        case Q3_K: {  // element e of sub-block j: bits 2 (j % 4) of qs[32 (j / 4) + e]; Q3_K's third bit j of hmask[e]
            const int j = static_cast<int>(b % 8);
            const uint8_t* q = (type == Q2_K ? reinterpret_cast<const BlockQ2_K*>(row)[b / 8].qs
                                             : reinterpret_cast<const BlockQ3_K*>(row)[b / 8].qs) + 32 * (j / 4);
            for (int e = 0; e < 32; ++e) {
                const int i = r * 4 + e % 4;
                blk[e / 4 % 2 * 64 + i] |= static_cast<uint8_t>((q[e] >> (2 * (j % 4)) & 3) << (2 * (e / 8)));
            }
            if (type == Q2_K) {
                auto* s = reinterpret_cast<const BlockQ2_K*>(row) + b / 8;
                blk[128 + r] = s->scales[2 * j], blk[128 + 16 + r] = s->scales[2 * j + 1];
                reinterpret_cast<uint16_t*>(head)[r] = s->d, reinterpret_cast<uint16_t*>(head)[16 + r] = s->dmin;
                return;
            }
            auto* s = reinterpret_cast<const BlockQ3_K*>(row) + b / 8;
            for (int e = 0; e < 32; ++e) {
                const int i = r * 4 + e % 4;
                blk[128 + e / 4 * 8 + i / 8] |= static_cast<uint8_t>((s->hmask[e] >> j & 1) << (i % 8));
            }
            for (int h = 0; h < 2; ++h) {  // ggml's 6-bit scale k: low 4 bits in byte k % 8, high 2 in byte 8 + k % 4
                const int k = 2 * j + h;
                const int sc = (s->scales[k % 8] >> (4 * (k / 8)) & 0xF) | (s->scales[8 + k % 4] >> (2 * (k / 4)) & 3) << 4;
                blk[192 + 16 * h + r] = static_cast<uint8_t>(static_cast<int8_t>(sc - 32));
            }
            reinterpret_cast<uint16_t*>(head)[r] = s->d;
            return;
        }
        case Q4_K:
            k4_sub_block(reinterpret_cast<const BlockQ4_K*>(row) + b / 8, static_cast<int>(b % 8), r, qs, blk + 256,
                         head);
            break;
        case Q5_K: {  // Q4_K's nibbles and scales, and bit j of qh[e] for element e of sub-block j
            auto* s = reinterpret_cast<const BlockQ5_K*>(row) + b / 8;
            const int j = static_cast<int>(b % 8);
            k4_sub_block(s, j, r, qs, blk + 320, head);
            uint8_t* masks = blk + 256;
            for (int e = 0; e < 32; ++e) {  // word e / 4 (quant_layout.h)
                const int i = r * 4 + e % 4;
                masks[e / 4 * 8 + i / 8] |= static_cast<uint8_t>((s->qh[e] >> j & 1) << (i % 8));
            }
            break;
        }
        case IQ4_NL: {
            auto* s = reinterpret_cast<const BlockIQ4_NL*>(row) + b;
            std::memcpy(qs, s->qs, 16), sc16[r] = s->d;
            break;
        }
        case MXFP4: {  // the scale 2^(e - 128) as an fp16 (the caller keeps exponents fp16 cannot hold out)
            auto* s = reinterpret_cast<const BlockMXFP4*>(row) + b;
            std::memcpy(qs, s->qs, 16), sc16[r] = pow2_half(static_cast<int>(s->e) - 128);
            break;
        }
        case IQ4_XS: {  // sub-block j's 16 bytes are already in tile order; its 6-bit scale minus 32 as a byte
            auto* s = reinterpret_cast<const BlockIQ4_XS*>(row) + b / 8;
            const int j = static_cast<int>(b % 8);
            std::memcpy(qs, s->qs + 16 * j, 16);
            const int ls = ((s->scales_l[j / 2] >> 4 * (j % 2)) & 0xF) | ((s->scales_h >> 2 * j) & 3) << 4;
            blk[256 + r] = static_cast<uint8_t>(static_cast<int8_t>(ls - 32));
            reinterpret_cast<uint16_t*>(head)[r] = s->d;
            break;
        }
        case Q6_K: {  // ggml's dequantize_row_q6_K order: element e of the super-block, scale e / 16
            auto* s = reinterpret_cast<const BlockQ6_K*>(row) + b / 8;
            const int j = static_cast<int>(b % 8), n = j / 4, l0 = j % 4 * 32;  // 128-element half, first element
            uint8_t q[32];
            for (int e = 0; e < 32; ++e) {
                const int l = (l0 + e) % 32, part = (l0 + e) / 32;  // part 0..3 of the half: ql/qh shifts below
                const uint8_t* ql = s->ql + 64 * n;
                const uint8_t* qh = s->qh + 32 * n;
                const int low = part % 2 ? ql[l + 32] : ql[l];
                q[e] = static_cast<uint8_t>((part < 2 ? low & 0xF : low >> 4) | (((qh[l] >> (2 * part)) & 3) << 4));
            }
            for (int k = 0; k < 16; ++k) qs[k] = static_cast<uint8_t>((q[k] & 0xF) | (q[k + 16] & 0xF) << 4);
            for (int e = 0; e < 32; ++e)  // the high two bits as Q2_K's planes
                blk[256 + e / 4 % 2 * 64 + r * 4 + e % 4] |= static_cast<uint8_t>((q[e] >> 4) << (2 * (e / 8)));
            blk[384 + r] = static_cast<uint8_t>(s->scales[2 * j]), blk[384 + 16 + r] = static_cast<uint8_t>(s->scales[2 * j + 1]);
            reinterpret_cast<uint16_t*>(head)[r] = s->d;
            break;
        }
        default:  // I8
            std::memcpy(qs, row + b * QK, 32);
    }
    for (int64_t j = 0; j < word_bytes(type) / 64; ++j) std::memcpy(blk + j * 64 + r * 4, qs + 4 * j, 4);
}

// Row r's 32 weights of block b as fp32, as ggml dequantizes them: the reference of the layout.
void dequantize_block_row(int64_t type, const uint8_t* tile, int64_t b, int r, float row_scale, float* y) {
    for (int e = 0; e < QK; ++e) y[e] = tiled_value(type, tile, b, r, e, row_scale);
}

#if defined(__AVX512F__)
// x * y rounded on its own (`mul_rounded`, 16 lanes): not fused into an FMA with what follows.
inline __m512 mul_rounded(__m512 x, __m512 y) {
    __m512 p = _mm512_mul_ps(x, y);
    __asm__("" : "+v"(p));
    return p;
}

// The two halves of a row's 32 values (weights 0-15, 16-31) widened to fp32 lanes from 16 bytes each.
inline __m512 widen_u8(__m128i q) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)); }
inline __m512 widen_i8(__m128i q) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)); }

// Row r's 4 weights of each word w (weights 4w..4w+3) as bytes: from bits 2 (w / 2) of its bytes of plane
// w % 2 (Q2_K's and Q3_K's quants, Q6_K's high bits), or from bits 4r..4r+3 of mask word w (Q3_K's third
// bits, Q5_K's fifth), each set bit as `one`.
inline void plane_words(const uint8_t* planes, int r, uint32_t* words) {
    uint32_t p[2];
    std::memcpy(&p[0], planes + 4 * r, 4), std::memcpy(&p[1], planes + 64 + 4 * r, 4);
    for (int w = 0; w < 8; ++w) words[w] = p[w % 2] >> (2 * (w / 2)) & 0x03030303u;
}
inline void mask_words(const uint8_t* masks, int r, uint32_t one, uint32_t* words) {
    for (int w = 0; w < 8; ++w) {
        uint64_t mask;
        std::memcpy(&mask, masks + 8 * w, 8);
        const uint32_t bits = static_cast<uint32_t>(mask >> (4 * r));
        words[w] = ((bits & 1) | (bits & 2) << 7 | (bits & 4) << 14 | (bits & 8) << 21) * one;
    }
}

// Row r's 32 weights of block b of a 2-bit tile (Q2_K, Q3_K) into y, `tiled_value`'s arithmetic 16 at a
// time, a scale per half.
void dequantize_two_bit_row(int64_t type, const uint8_t* blk, const uint8_t* head, int r, float* y) {
    uint32_t words[8], third[8];
    plane_words(blk, r, words);
    if (type == Q3_K) mask_words(blk + 128, r, 4, third);
    const uint8_t* sc = blk + quant_bytes(type);
    const float d = half_to_float(fp16_scales(head)[r]);
    for (int h = 0; h < 2; ++h) {
        __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(words + 4 * h));
        if (type == Q3_K) {  // (d sc_h) (q - 4), q of 3 bits
            q = _mm_or_si128(q, _mm_loadu_si128(reinterpret_cast<const __m128i*>(third + 4 * h)));
            const __m512 v = _mm512_sub_ps(widen_u8(q), _mm512_set1_ps(4.f));
            _mm512_storeu_ps(y + 16 * h, _mm512_mul_ps(_mm512_set1_ps(d * static_cast<int8_t>(sc[16 * h + r])), v));
        } else {  // (d sc_h) q - (dmin m_h), sc and m the nibbles of one byte
            const int packed = sc[16 * h + r];
            const __m512 dl = _mm512_set1_ps(d * (packed & 0xF));
            const float m = conveyor::mul_rounded(half_to_float(fp16_scales(head)[16 + r]), packed >> 4);
            const __m512 ml = _mm512_set1_ps(m);
            _mm512_storeu_ps(y + 16 * h, _mm512_sub_ps(mul_rounded(dl, widen_u8(q)), ml));
        }
    }
}

// Row r's 32 weights of block b of a quantized tile into y, `dequantize_block_row`'s values 16 at a time
// (row_scale: I8's scale of that row): the row's bytes are its 4-byte words of each chunk (4-bit types:
// weights 0-15 in the low nibbles, 16-31 in the high ones), its 2-bit values, Q5_K's fifth bits and
// Q6_K's high two bits its bits of each word's plane or mask. A weight at a time (`tiled_value`) took
// ~10 cycles: a 3B model's prefill through oneDNN on an AMX CPU waited on it.
void dequantize_block_row_vec(int64_t type, const uint8_t* tile, int64_t b, int r, float row_scale, float* y) {
    const uint8_t* blk = tile_block(type, tile, b);
    const uint8_t* head = tile_header(type, tile, b);
    if (is2bit(type)) {
        dequantize_two_bit_row(type, blk, head, r, y);
        return;
    }
    const uint8_t* sc = blk + quant_bytes(type);
    if (!is4bit(type) && type != Q6_K) {  // Q8_0, I8: q d
        alignas(32) int8_t qs[32];
        for (int j = 0; j < 8; ++j) std::memcpy(qs + 4 * j, blk + 64 * j + 4 * r, 4);
        const __m512 d = _mm512_set1_ps(type == I8 ? row_scale : half_to_float(fp16_scales(sc)[r]));
        for (int h = 0; h < 2; ++h) {
            const __m128i q = _mm_load_si128(reinterpret_cast<const __m128i*>(qs + 16 * h));
            _mm512_storeu_ps(y + 16 * h, _mm512_mul_ps(widen_i8(q), d));
        }
        return;
    }
    alignas(16) uint8_t qs[16];
    for (int j = 0; j < 4; ++j) std::memcpy(qs + 4 * j, blk + 64 * j + 4 * r, 4);
    const __m128i raw = _mm_load_si128(reinterpret_cast<const __m128i*>(qs)), low4 = _mm_set1_epi8(0x0F);
    __m128i q[2] = {_mm_and_si128(raw, low4), _mm_and_si128(_mm_srli_epi16(raw, 4), low4)};
    if (type == Q4_0 || type == Q4_1) {  // (q - 8) d; Q4_1: q d + m
        const __m512 d = _mm512_set1_ps(half_to_float(fp16_scales(sc)[r]));
        const __m512 m = _mm512_set1_ps(type == Q4_1 ? half_to_float(fp16_scales(sc)[16 + r]) : 0.f);
        for (int h = 0; h < 2; ++h) {
            const __m512 v = widen_u8(q[h]);
            _mm512_storeu_ps(y + 16 * h, type == Q4_0 ? _mm512_mul_ps(_mm512_sub_ps(v, _mm512_set1_ps(8.f)), d)
                                                      : _mm512_add_ps(mul_rounded(v, d), m));
        }
        return;
    }
    if (is_iq4(type)) {  // d kvalues[q] (IQ4_XS: d sc)
        const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(iq4_values(type)));
        const float d = type == IQ4_XS ? half_to_float(fp16_scales(head)[r]) * static_cast<int8_t>(sc[r])
                                       : half_to_float(fp16_scales(sc)[r]);
        for (int h = 0; h < 2; ++h)
            _mm512_storeu_ps(y + 16 * h, _mm512_mul_ps(_mm512_set1_ps(d), widen_i8(_mm_shuffle_epi8(table, q[h]))));
        return;
    }
    uint32_t words[8];  // the high bits of word w (weights 4w..4w+3) as bytes, from bit 4 on
    if (type == Q6_K) {
        plane_words(blk + 256, r, words);
        for (uint32_t& w : words) w <<= 4;
    } else if (type == Q5_K) {
        mask_words(blk + 256, r, 16, words);
    }
    if (type != Q4_K)
        for (int h = 0; h < 2; ++h) {
            const __m128i high = _mm_loadu_si128(reinterpret_cast<const __m128i*>(words + 4 * h));
            q[h] = _mm_or_si128(q[h], high);
        }
    if (type == Q6_K) {  // (d sc_h) (q - 32)
        const float d = half_to_float(fp16_scales(head)[r]);
        for (int h = 0; h < 2; ++h) {
            const __m512 v = _mm512_sub_ps(widen_u8(q[h]), _mm512_set1_ps(32.f));
            _mm512_storeu_ps(y + 16 * h, _mm512_mul_ps(_mm512_set1_ps(d * static_cast<int8_t>(sc[16 * h + r])), v));
        }
        return;
    }
    // Q4_K, Q5_K: (d sc) q - (dmin m)
    const __m512 d1 = _mm512_set1_ps(half_to_float(fp16_scales(head)[r]) * sc[r]);
    const __m512 m1 = _mm512_set1_ps(half_to_float(fp16_scales(head)[16 + r]) * sc[16 + r]);
    for (int h = 0; h < 2; ++h) _mm512_storeu_ps(y + 16 * h, _mm512_sub_ps(mul_rounded(d1, widen_u8(q[h])), m1));
}
#endif

}  // namespace

int64_t row_bytes(int64_t type, int64_t K) {
    switch (type) {
        case Q4_0: return K / QK * sizeof(BlockQ4_0);
        case Q4_1: return K / QK * sizeof(BlockQ4_1);
        case Q8_0: return K / QK * sizeof(BlockQ8_0);
        case Q2_K: return K / QK_K * sizeof(BlockQ2_K);
        case Q3_K: return K / QK_K * sizeof(BlockQ3_K);
        case Q4_K: return K / QK_K * sizeof(BlockQ4_K);
        case Q5_K: return K / QK_K * sizeof(BlockQ5_K);
        case Q6_K: return K / QK_K * sizeof(BlockQ6_K);
        case IQ4_NL: return K / QK * sizeof(BlockIQ4_NL);
        case IQ4_XS: return K / QK_K * sizeof(BlockIQ4_XS);
        case MXFP4: return K / QK * sizeof(BlockMXFP4);
        case I8: return K;
        case BF16: return 2 * K;
        case F32: return 4 * K;
    }
    fail("unsupported weight type ", type);
}

int64_t tile_bytes(int64_t type, int64_t K) {
    return is_dense(type) ? K * kTileRows * dense_bytes(type) : K / QK / group_blocks(type) * group_bytes(type);
}

void repack_tiles(int64_t type, const uint8_t* src, int64_t N, int64_t K, uint8_t* dst) {
    const int64_t nb = K / QK, rb = row_bytes(type, K), tb = tile_bytes(type, K), tiles = (N + kTileRows - 1) / kTileRows;
    std::memset(dst, 0, tiles * tb);
    if (is_dense(type)) {  // value k of row r at (k * 16 + r) * e of its tile, e bytes a value
        const int64_t e = dense_bytes(type);
        parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
            for (int64_t t = begin; t < end; ++t)
                for (int r = 0; r < kTileRows && t * kTileRows + r < N; ++r)
                    for (int64_t k = 0; k < K; ++k)
                        std::memcpy(dst + t * tb + (k * kTileRows + r) * e, src + (t * kTileRows + r) * rb + e * k, e);
        });
        return;
    }
    parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
            uint8_t* tile = dst + t * tb;
            for (int64_t b = 0; b < nb; ++b) {
                uint8_t* blk = const_cast<uint8_t*>(tile_block(type, tile, b));
                uint8_t* head = const_cast<uint8_t*>(tile_header(type, tile, b));
                for (int r = 0; r < kTileRows && t * kTileRows + r < N; ++r)
                    repack_block(type, src + (t * kTileRows + r) * rb, b, r, blk, head);
            }
        }
    });
}

void dequantize_tiled_row(int64_t type, const uint8_t* tiles, const float* row_scales, int64_t K, int64_t row,
                          float* y) {
    const uint8_t* tile = tiles + (row / kTileRows) * tile_bytes(type, K);
    if (type == BF16) {
        const bf16* v = reinterpret_cast<const bf16*>(tile) + row % kTileRows;
        for (int64_t k = 0; k < K; ++k) y[k] = static_cast<float>(v[k * kTileRows]);
        return;
    }
    if (type == F32) {
        const float* v = reinterpret_cast<const float*>(tile) + row % kTileRows;
        for (int64_t k = 0; k < K; ++k) y[k] = v[k * kTileRows];
        return;
    }
    const float scale = type == I8 ? row_scales[row] : 1.f;
    for (int64_t b = 0; b < K / QK; ++b, y += QK)
        dequantize_block_row(type, tile, b, static_cast<int>(row % kTileRows), scale, y);
}

// Rows [16 t0, 16 t1) of a tiled matrix into out [N, K] (fp32, or bf16 when `to_bf16`): the whole weight
// at once for the prefill path (dequantize + the BLAS/AMX matmul). A row's quant bytes of a block
// are its 4-byte words of each chunk, so each row unpacks like a GGUF row.
void dequantize_tiles(int64_t type, const uint8_t* tiles, const float* row_scales, int64_t N, int64_t K, int64_t t0,
                      int64_t t1, void* out, bool to_bf16) {
    const int64_t nb = K / QK, tb = tile_bytes(type, K);
    if (is_dense(type)) {  // the tile transposed back
        for (int64_t t = t0; t < t1; ++t)
            for (int r = 0; r < kTileRows && t * kTileRows + r < N; ++r) {
                const int64_t off = (t * kTileRows + r) * K;
                for (int64_t k = 0; k < K; ++k) {
                    const float v = type == F32 ? reinterpret_cast<const float*>(tiles + t * tb)[r + k * kTileRows]
                                                : static_cast<float>(reinterpret_cast<const bf16*>(tiles + t * tb)[r + k * kTileRows]);
                    if (to_bf16) static_cast<bf16*>(out)[off + k] = bf16(v);
                    else static_cast<float*>(out)[off + k] = v;
                }
            }
        return;
    }
    float row[4 * QK];
    for (int64_t t = t0; t < t1; ++t) {
        for (int r = 0; r < kTileRows && t * kTileRows + r < N; ++r) {
            const int64_t n = t * kTileRows + r;
            const float scale = type == I8 ? row_scales[n] : 1.f;
            for (int64_t b0 = 0; b0 < nb; b0 += 4) {
                const int64_t count = std::min<int64_t>(4, nb - b0);
                for (int64_t b = b0; b < b0 + count; ++b) {
#if defined(__AVX512F__)
                    dequantize_block_row_vec(type, tiles + t * tb, b, r, scale, row + (b - b0) * QK);
#else
                    dequantize_block_row(type, tiles + t * tb, b, r, scale, row + (b - b0) * QK);
#endif
                }
                const int64_t len = count * QK, off = n * K + b0 * QK;
                if (to_bf16) {
                    bf16* o = static_cast<bf16*>(out) + off;
#if defined(__AVX512BF16__)
                    for (int64_t k = 0; k < len; k += 16)
                        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(row + k)));
#else
                    for (int64_t k = 0; k < len; ++k) o[k] = static_cast<bf16>(row[k]);
#endif
                } else {
                    std::memcpy(static_cast<float*>(out) + off, row, len * sizeof(float));
                }
            }
        }
    }
}

}  // namespace conveyor
