// The 16-row tiled layout of Q4_0, Q4_1, Q8_0 and I8 weights, and its matmul.
//
// A tile holds 16 output rows; per block of 32 weights it stores the rows' quant bytes interleaved
// four at a time (chunk j, row r: the 4 bytes j*4..j*4+3 of row r's block), then the 16 fp16
// scales (Q4_0, Q4_1, Q8_0) and the 16 fp16 minimums (Q4_1). The bits are the file's: a Q4 block's
// byte k holds weight k (low nibble) and weight k + 16 (high nibble), so chunk j of a Q4 block gives
// weights 4j..4j+3 in its low nibbles and 4j+16..4j+19 in its high nibbles. One 16-lane integer dot
// product (vpdpbusd: 4 unsigned weight bytes times 4 activation bytes, broadcast) then advances 16
// output rows at once, and the per-row scales are a vector: no horizontal sums, no per-row scale
// broadcasts. Q4_0's minimum is -8 d, computed; 8-bit weights are signed, biased by 128 for
// vpdpbusd (the bias is taken back with the activation block sums).
#include "quant.h"
#include "vec_math.h"

#include <ATen/Parallel.h>

#include <cstring>

namespace conveyor {
namespace {

inline bool is4(int64_t type) { return type == Q4_0 || type == Q4_1; }
inline int64_t quant_bytes(int64_t type) { return is4(type) ? 256 : 512; }
inline int64_t block_bytes(int64_t type) {
    return quant_bytes(type) + (type == I8 ? 0 : 32) + (type == Q4_1 ? 32 : 0);
}

// Weight (as a small int: Q4 nibble 0..15, 8-bit signed) `e` of row r in a tiled block.
inline int tiled_weight(int64_t type, const uint8_t* blk, int r, int e) {
    if (is4(type)) {
        const uint8_t byte = blk[(e % 16 / 4) * 64 + r * 4 + e % 4];
        return e < 16 ? byte & 0xF : byte >> 4;
    }
    return static_cast<int8_t>(blk[(e / 4) * 64 + r * 4 + e % 4]);
}

inline const uint16_t* tiled_scales(int64_t type, const uint8_t* blk) {
    return reinterpret_cast<const uint16_t*>(blk + quant_bytes(type));
}

inline int32_t word(const int8_t* p) {
    int32_t w;
    std::memcpy(&w, p, 4);
    return w;
}

#if defined(__AVX2__)
// How far ahead of the block being read the weight stream is prefetched.
constexpr int64_t kPrefetchBytes = 2048;
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
// The GEMM microkernel: one tile (16 output rows = the 16 lanes of a vector) against MR activation
// rows. Per block of 32, each chunk of the tile (one vector: four weights of every row) is loaded and
// unpacked once and multiplied (vpdpbusd) with the four activation bytes of each of the MR rows,
// broadcast from memory; the MR integer accumulators are independent chains kept in registers. At the
// block's end each row's integer sum is scaled into its fp32 accumulator: cvt + (d_w x d_x) + FMA,
// and for Q4_1 one FMA more for the minimum (m_w x the activation block's sum). Q4_0's -8 and the +128
// that makes 8-bit weights unsigned for vpdpbusd are taken back in the integer domain, by starting
// each accumulator at -8 or -128 times the activation block's integer sum (a broadcast load, no
// arithmetic). Everything the loops branch on is a template parameter: the loops unroll fully.
constexpr int kPassRows = kPackRows;  // MR: 12 integer + 12 fp32 accumulators + the chunk vectors fit 32 registers

template <int64_t T, int MR>
void tile_pass(const uint8_t* tile, const Activations& a, int64_t m0, bool prefetch, __m512* result) {
    constexpr bool four = T == Q4_0 || T == Q4_1;
    constexpr int64_t bb = four ? 256 + 32 + (T == Q4_1 ? 32 : 0) : 512 + (T == I8 ? 0 : 32);
    const int64_t nb = a.nb;
    __m512 acc[MR];
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
    // The packed group (Activations): MR rows' words interleaved, per block MR * 32 bytes and MR of each sum.
    const int8_t* x = a.pq.data() + m0 * a.K;
    const float* xd = a.pd.data() + m0 * nb;
    const float* xs = a.ps.data() + m0 * nb;
    const int32_t* xbias = (T == Q4_0 ? a.pn8.data() : a.pn128.data()) + m0 * nb;
    for (int64_t b = 0; b < nb; ++b, x += MR * QK, xd += MR, xs += MR, xbias += MR) {
        const uint8_t* blk = tile + b * bb;
        if (prefetch)  // the first pass over a tile streams it from memory: fetch ahead
            for (int64_t line = 0; line < bb; line += 64)
                _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetchBytes + line), _MM_HINT_T0);
        __m512i dot[MR];
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) dot[i] = T == Q4_1 ? _mm512_setzero_si512() : _mm512_set1_epi32(xbias[i]);
        if constexpr (four) {
            const __m512i low4 = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 4
            for (int j = 0; j < 4; ++j) {
                const __m512i raw = _mm512_loadu_si512(blk + 64 * j);
                const __m512i lo = _mm512_and_si512(raw, low4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
#pragma GCC unroll 16
                for (int i = 0; i < MR; ++i) dot[i] = _mm512_dpbusd_epi32(dot[i], lo, _mm512_set1_epi32(word(x + (j * MR + i) * 4)));
#pragma GCC unroll 16
                for (int i = 0; i < MR; ++i)
                    dot[i] = _mm512_dpbusd_epi32(dot[i], hi, _mm512_set1_epi32(word(x + ((j + 4) * MR + i) * 4)));
            }
        } else {
            const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
#pragma GCC unroll 8
            for (int j = 0; j < 8; ++j) {
                const __m512i w = _mm512_xor_si512(_mm512_loadu_si512(blk + 64 * j), bias);
#pragma GCC unroll 16
                for (int i = 0; i < MR; ++i) dot[i] = _mm512_dpbusd_epi32(dot[i], w, _mm512_set1_epi32(word(x + (j * MR + i) * 4)));
            }
        }
        if constexpr (T == I8) {  // per-row scales come after the whole sum
#pragma GCC unroll 16
            for (int i = 0; i < MR; ++i) acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i]), _mm512_set1_ps(xd[i]), acc[i]);
        } else {
            const __m512 wd = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + (four ? 256 : 512))));
#pragma GCC unroll 16
            for (int i = 0; i < MR; ++i)
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i]), _mm512_mul_ps(wd, _mm512_set1_ps(xd[i])), acc[i]);
            if constexpr (T == Q4_1) {
                const __m512 wm = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 288)));
#pragma GCC unroll 16
                for (int i = 0; i < MR; ++i) acc[i] = _mm512_fmadd_ps(wm, _mm512_set1_ps(xs[i]), acc[i]);
            }
        }
    }
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) result[i] = acc[i];
}

template <int64_t T, int MR>
void tile_rows(const uint8_t* tile, const float* scales, const Activations& a, int64_t m0, int64_t n0, int64_t N,
               const TileOut& out) {
    __m512 res[MR];
    tile_pass<T, MR>(tile, a, m0, m0 == 0, res);
    const int64_t valid = std::min<int64_t>(kTileRows, N - n0);
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
    const __m512 sv = scales ? _mm512_maskz_loadu_ps(mask, scales + n0) : _mm512_set1_ps(1.f);
    const __m512 bv = out.bias ? _mm512_maskz_loadu_ps(mask, out.bias + n0) : _mm512_setzero_ps();
    for (int i = 0; i < MR; ++i) {
        const __m512 v = _mm512_fmadd_ps(res[i], sv, bv);
        const int64_t at = out.at(m0 + i, n0);
        if (out.bf16) store16(static_cast<c10::BFloat16*>(out.data) + at, v, mask);
        else store16(static_cast<float*>(out.data) + at, v, mask);
    }
}
#elif defined(__AVX2__)
// 8 output rows per vector: a tile is two halves, each swept over the blocks on its own (16 ymm
// registers do not hold both halves' weights and accumulators), MR = 4 activation rows a pass from the
// packed groups, as above. With AVX-VNNI the same scheme as AVX-512's; without it, 4-bit weights
// (0..15) times int8 activations go through vpmaddubsw, whose pair sums fit int16 for a whole block
// (8 x 2 x 15 x 127 < 32767): summed there and widened once a block by one vpmaddwd (the multiplier
// port is the limit); 8-bit weights take |w| times the activations carrying w's sign (no saturation)
// and widen every product pair.
constexpr int kPassRows = kPackRows;

inline __m256i bcast4(const int8_t* p) { return _mm256_set1_epi32(word(p)); }

template <int64_t T, int MR>
void half_pass(const uint8_t* tile, int half, const Activations& a, int64_t m0, bool prefetch, __m256* result) {
    constexpr bool four = T == Q4_0 || T == Q4_1;
    constexpr int64_t bb = four ? 256 + 32 + (T == Q4_1 ? 32 : 0) : 512 + (T == I8 ? 0 : 32);
    const int64_t nb = a.nb;
    __m256 acc[MR];
    for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
    const int8_t* x = a.pq.data() + m0 * a.K;
    const float* xd = a.pd.data() + m0 * nb;
    const float* xs = a.ps.data() + m0 * nb;
    const int32_t* xbias = (T == Q4_0 ? a.pn8.data() : a.pn128.data()) + m0 * nb;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; ++b, x += MR * QK, xd += MR, xs += MR, xbias += MR) {
        const uint8_t* blk = tile + b * bb;
        if (prefetch)  // the second half reads the tile again, from cache by then
            for (int64_t line = 0; line < bb; line += 64)
                _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetchBytes + line), _MM_HINT_T0);
        __m256i dot[MR];
        if constexpr (four) {
            const __m256i low4 = _mm256_set1_epi8(0x0F);
#if defined(__AVXVNNI__)
            for (int i = 0; i < MR; ++i) dot[i] = T == Q4_1 ? _mm256_setzero_si256() : _mm256_set1_epi32(xbias[i]);
            for (int j = 0; j < 4; ++j) {
                const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * j + 32 * half));
                const __m256i lo = _mm256_and_si256(raw, low4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
                for (int i = 0; i < MR; ++i) dot[i] = _mm256_dpbusd_avx_epi32(dot[i], lo, bcast4(x + (j * MR + i) * 4));
                for (int i = 0; i < MR; ++i) dot[i] = _mm256_dpbusd_avx_epi32(dot[i], hi, bcast4(x + ((j + 4) * MR + i) * 4));
            }
#else
            __m256i s16[MR];
            for (int j = 0; j < 4; ++j) {
                const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * j + 32 * half));
                const __m256i lo = _mm256_and_si256(raw, low4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
                for (int i = 0; i < MR; ++i) {
                    const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(x + (j * MR + i) * 4)),
                                                       _mm256_maddubs_epi16(hi, bcast4(x + ((j + 4) * MR + i) * 4)));
                    s16[i] = j == 0 ? p : _mm256_add_epi16(s16[i], p);
                }
            }
            for (int i = 0; i < MR; ++i) {
                dot[i] = _mm256_madd_epi16(s16[i], ones);
                if constexpr (T != Q4_1) dot[i] = _mm256_add_epi32(dot[i], _mm256_set1_epi32(xbias[i]));
            }
#endif
        } else {
#if defined(__AVXVNNI__)
            const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
            for (int i = 0; i < MR; ++i) dot[i] = _mm256_set1_epi32(xbias[i]);
            for (int j = 0; j < 8; ++j) {
                const __m256i w = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * j + 32 * half)), bias);
                for (int i = 0; i < MR; ++i) dot[i] = _mm256_dpbusd_avx_epi32(dot[i], w, bcast4(x + (j * MR + i) * 4));
            }
#else
            for (int i = 0; i < MR; ++i) dot[i] = _mm256_setzero_si256();
            for (int j = 0; j < 8; ++j) {
                const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * j + 32 * half));
                const __m256i u = _mm256_sign_epi8(w, w);
                for (int i = 0; i < MR; ++i)
                    dot[i] = _mm256_add_epi32(dot[i], _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_sign_epi8(bcast4(x + (j * MR + i) * 4), w)), ones));
            }
#endif
        }
        if constexpr (T == I8) {
            for (int i = 0; i < MR; ++i) acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i]), _mm256_set1_ps(xd[i]), acc[i]);
        } else {
            const uint16_t* sc = tiled_scales(T, blk) + 8 * half;
            const __m256 wd = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
            for (int i = 0; i < MR; ++i)
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i]), _mm256_mul_ps(wd, _mm256_set1_ps(xd[i])), acc[i]);
            if constexpr (T == Q4_1) {
                const __m256 wm = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 16)));
                for (int i = 0; i < MR; ++i) acc[i] = _mm256_fmadd_ps(wm, _mm256_set1_ps(xs[i]), acc[i]);
            }
        }
    }
    for (int i = 0; i < MR; ++i) result[i] = acc[i];
}

template <int64_t T, int MR>
void tile_rows(const uint8_t* tile, const float* scales, const Activations& a, int64_t m0, int64_t n0, int64_t N,
               const TileOut& out) {
    for (int half = 0; half < 2; ++half) {
        __m256 res[MR];
        half_pass<T, MR>(tile, half, a, m0, m0 == 0 && half == 0, res);
        const int64_t base = n0 + 8 * half, valid = std::min<int64_t>(8, N - base);
        if (valid <= 0) break;
        for (int i = 0; i < MR; ++i) {
            float vals[8];
            _mm256_storeu_ps(vals, res[i]);
            for (int r = 0; r < valid; ++r) out.store(m0 + i, base + r, scales ? vals[r] * scales[base + r] : vals[r]);
        }
    }
}
#else
constexpr int kPassRows = 1;

template <int64_t type, int MB>
void tile_rows(const uint8_t* tile, const float* scales, const Activations& a, int64_t m0, int64_t n0, int64_t N,
               const TileOut& out) {
    const int64_t bb = block_bytes(type), valid = std::min<int64_t>(kTileRows, N - n0);
    for (int i = 0; i < MB; ++i) {
        const int64_t m = m0 + i;
        for (int r = 0; r < valid; ++r) {
            float acc = 0.f;
            for (int64_t b = 0; b < a.nb; ++b) {
                const uint8_t* blk = tile + b * bb;
                const uint16_t* sc = tiled_scales(type, blk);
                const float d = type == I8 ? 1.f : half_to_float(sc[r]);
                const float mn = type == Q4_1 ? half_to_float(sc[16 + r]) : type == Q4_0 ? -8.f * d : 0.f;
                int dot = 0;
                for (int e = 0; e < QK; ++e) dot += tiled_weight(type, blk, r, e) * a.qrow(m, b)[e];
                acc += d * a.d[m * a.nb + b] * dot + mn * a.s32[m * a.nb + b];
            }
            out.store(m, n0 + r, scales ? acc * scales[n0 + r] : acc);
        }
    }
}
#endif

using TileFn = void (*)(const uint8_t*, const float*, const Activations&, int64_t, int64_t, int64_t, const TileOut&);

// kTileFns<T>[MR - 1]: the microkernel of type T for MR activation rows.
template <int64_t T, int... I>
constexpr std::array<TileFn, sizeof...(I)> make_table(std::integer_sequence<int, I...>) {
    return {tile_rows<T, I + 1>...};
}
template <int64_t T>
constexpr auto kTileFns = make_table<T>(std::make_integer_sequence<int, kPassRows>{});

template <int64_t T>
void typed_tiles_matmul(const uint8_t* w, const float* row_scales, const Activations& a, int64_t t0, int64_t t1,
                        int64_t N, const TileOut& out) {
    const int64_t tb = tile_bytes(T, a.K);
    for (int64_t t = t0; t < t1; ++t) {
        for (int64_t m0 = 0; m0 < a.M; m0 += kPassRows) {
            const int mb = static_cast<int>(std::min<int64_t>(kPassRows, a.M - m0));
            kTileFns<T>[mb - 1](w + t * tb, row_scales, a, m0, t * kTileRows, N, out);
        }
    }
}

}  // namespace

int64_t tile_bytes(int64_t type, int64_t K) { return K / QK * block_bytes(type); }

void repack_tiles(int64_t type, const uint8_t* src, int64_t N, int64_t K, uint8_t* dst) {
    const int64_t nb = K / QK, rb = row_bytes(type, K), bb = block_bytes(type), tiles = (N + kTileRows - 1) / kTileRows;
    std::memset(dst, 0, tiles * nb * bb);
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
            for (int64_t b = 0; b < nb; ++b) {
                uint8_t* blk = dst + (t * nb + b) * bb;
                uint16_t* sc = reinterpret_cast<uint16_t*>(blk + quant_bytes(type));
                for (int r = 0; r < kTileRows && t * kTileRows + r < N; ++r) {
                    const uint8_t* row = src + (t * kTileRows + r) * rb;
                    const uint8_t* qs;
                    switch (type) {
                        case Q4_0: {
                            auto* s = reinterpret_cast<const BlockQ4_0*>(row) + b;
                            qs = s->qs, sc[r] = s->d;
                            break;
                        }
                        case Q4_1: {
                            auto* s = reinterpret_cast<const BlockQ4_1*>(row) + b;
                            qs = s->qs, sc[r] = s->d, sc[16 + r] = s->m;
                            break;
                        }
                        case Q8_0: {
                            auto* s = reinterpret_cast<const BlockQ8_0*>(row) + b;
                            qs = reinterpret_cast<const uint8_t*>(s->qs), sc[r] = s->d;
                            break;
                        }
                        default:
                            qs = row + b * QK;
                    }
                    for (int64_t j = 0; j < quant_bytes(type) / 64; ++j) std::memcpy(blk + j * 64 + r * 4, qs + 4 * j, 4);
                }
            }
        }
    });
}

namespace {

// Block b's 32 weights of row `row` (row r of its tile), as fp32: the reference of the layout.
void dequantize_tiled_row_block(int64_t type, const uint8_t* blk, const float* row_scales, int64_t row, int r,
                                float* y) {
    const uint16_t* sc = tiled_scales(type, blk);
    if (type == I8) {
        for (int e = 0; e < QK; ++e) y[e] = tiled_weight(type, blk, r, e) * row_scales[row];
        return;
    }
    const float d = half_to_float(sc[r]);
    for (int e = 0; e < QK; ++e) {
        const int q = tiled_weight(type, blk, r, e);
        y[e] = type == Q4_1 ? q * d + half_to_float(sc[16 + r]) : type == Q4_0 ? (q - 8) * d : q * d;
    }
}

}  // namespace

void dequantize_tiled_row(int64_t type, const uint8_t* tiles, const float* row_scales, int64_t K, int64_t row,
                          float* y) {
    const int64_t nb = K / QK, bb = block_bytes(type);
    const uint8_t* tile = tiles + (row / kTileRows) * nb * bb;
    for (int64_t b = 0; b < nb; ++b, y += QK)
        dequantize_tiled_row_block(type, tile + b * bb, row_scales, row, static_cast<int>(row % kTileRows), y);
}

// Rows [16 t0, 16 t1) of a tiled matrix into out [N, K] (fp32, or bf16 when `bf16`): the whole weight
// at once for the prefill path (dequantize + the BLAS/AMX matmul). A row's quant bytes of a block
// are its 4-byte words of each chunk, so each row unpacks like a GGUF row.
void dequantize_tiles(int64_t type, const uint8_t* tiles, const float* row_scales, int64_t N, int64_t K, int64_t t0,
                      int64_t t1, void* out, bool bf16) {
    const int64_t nb = K / QK, bb = block_bytes(type);
    float row[4 * QK];
    for (int64_t t = t0; t < t1; ++t) {
        for (int r = 0; r < kTileRows && t * kTileRows + r < N; ++r) {
            const int64_t n = t * kTileRows + r;
            for (int64_t b0 = 0; b0 < nb; b0 += 4) {
                const int64_t count = std::min<int64_t>(4, nb - b0);
                for (int64_t b = b0; b < b0 + count; ++b) {
                    const uint8_t* blk = tiles + (t * nb + b) * bb;
                    const uint16_t* sc = tiled_scales(type, blk);
                    float* y = row + (b - b0) * QK;
#if defined(__AVX512F__)
                    if (is4(type)) {
                        alignas(16) uint8_t qs[16];
                        for (int j = 0; j < 4; ++j) std::memcpy(qs + 4 * j, blk + 64 * j + 4 * r, 4);
                        const __m128i raw = _mm_load_si128(reinterpret_cast<const __m128i*>(qs));
                        const __m128i mask = _mm_set1_epi8(0x0F);
                        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, mask)));
                        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), mask)));
                        const float d = half_to_float(sc[r]);
                        if (type == Q4_1) {  // q * d + m, as ggml
                            const __m512 dv = _mm512_set1_ps(d), mv = _mm512_set1_ps(half_to_float(sc[16 + r]));
                            _mm512_storeu_ps(y, _mm512_add_ps(_mm512_mul_ps(lo, dv), mv));
                            _mm512_storeu_ps(y + 16, _mm512_add_ps(_mm512_mul_ps(hi, dv), mv));
                        } else {  // (q - 8) * d
                            const __m512 dv = _mm512_set1_ps(d), eight = _mm512_set1_ps(8.f);
                            _mm512_storeu_ps(y, _mm512_mul_ps(_mm512_sub_ps(lo, eight), dv));
                            _mm512_storeu_ps(y + 16, _mm512_mul_ps(_mm512_sub_ps(hi, eight), dv));
                        }
                        continue;
                    }
                    alignas(32) int8_t qs[32];
                    for (int j = 0; j < 8; ++j) std::memcpy(qs + 4 * j, blk + 64 * j + 4 * r, 4);
                    const float d = type == I8 ? row_scales[n] : half_to_float(sc[r]);
                    const __m512 dv = _mm512_set1_ps(d);
                    for (int h = 0; h < 2; ++h) {
                        const __m128i q = _mm_load_si128(reinterpret_cast<const __m128i*>(qs + 16 * h));
                        _mm512_storeu_ps(y + 16 * h, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), dv));
                    }
#else
                    (void)sc;
                    dequantize_tiled_row_block(type, blk, row_scales, n, r, y);
#endif
                }
                const int64_t len = count * QK, off = n * K + b0 * QK;
                if (bf16) {
                    c10::BFloat16* o = static_cast<c10::BFloat16*>(out) + off;
#if defined(__AVX512BF16__)
                    for (int64_t k = 0; k < len; k += 16)
                        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(row + k)));
#else
                    for (int64_t k = 0; k < len; ++k) o[k] = static_cast<c10::BFloat16>(row[k]);
#endif
                } else {
                    std::memcpy(static_cast<float*>(out) + off, row, len * sizeof(float));
                }
            }
        }
    }
}

void tiles_matmul(int64_t type, const uint8_t* w, const float* row_scales, const Activations& a, int64_t t0,
                  int64_t t1, int64_t N, const TileOut& out) {
    switch (type) {
        case Q4_0: return typed_tiles_matmul<Q4_0>(w, row_scales, a, t0, t1, N, out);
        case Q4_1: return typed_tiles_matmul<Q4_1>(w, row_scales, a, t0, t1, N, out);
        case Q8_0: return typed_tiles_matmul<Q8_0>(w, row_scales, a, t0, t1, N, out);
        case I8: return typed_tiles_matmul<I8>(w, row_scales, a, t0, t1, N, out);
        default: TORCH_CHECK(false, "type ", type, " has no tiled layout");
    }
}

}  // namespace conveyor
