// The batched GEMM over tiled quantized weights (quant_layout.h) and int8-quantized activations
// (`Activations`, packed in groups of kPackRows rows): out [M, N] = x [M, K] W^T.
//
// The microkernel takes one tile (16 output rows) against MR activation rows. Per block of 32, each
// chunk of the tile (four weights of every row) is loaded and unpacked once and multiplied with the
// four activation bytes of each of the MR rows, broadcast from the packed group (one pointer,
// constant offsets); the MR integer accumulators are independent chains kept in registers. At the
// block's end each row's integer sum is scaled into its fp32 accumulator: cvt + (d_w x d_x) + FMA,
// one FMA more for a minimum (Q4_1, Q4_K: m_w times the activation block's sum). Offsets that make
// the weights unsigned for vpdpbusd (Q4_0's -8, the +128 of signed bytes) are taken back in the
// integer domain: the accumulators start at -8 or -128 times the activation block's integer sum (a
// broadcast load, no arithmetic). The two scales per block of Q2_K, Q3_K and Q6_K take two integer
// sums, one per half; Q3_K's -4 and Q6_K's -32 are taken back from the half's sum, Q2_K's minimums
// need its value. Q6_K's 6-bit values are put together from their nibbles and 2-bit planes.
// Q5_K's fifth bits are added to its nibbles from their masks, and the IQ4 types' nibbles become
// their values plus 128 by a byte shuffle (the +128 taken back as for signed bytes).
// Everything the loops branch on is a template parameter, so they unroll fully.
//
// Measured (AVX512-VNNI Xeon, 1 thread, Q4_1, 3072 x 576): ~400 GFLOP/s from 16 rows on, 85% of
// vpdpbusd's measured peak (`bench/peaks.py`); the row-by-row kernel it replaced ran at ~300, and the
// K-quants' per-row kernels at 20-45. At 256 rows the output, not the arithmetic, was the limit: a
// tile's 16 columns of 256 rows are 256 lines in as many pages, each a cache miss that its store
// waited on (45-52% of that peak). The next tile's output lines are now fetched while a tile computes
// (68-77%), and an fp32 output of 8 MiB or more (the LM head's logits) is written around the caches
// (`TileOut::stream`).
#include "quant_layout.h"
#include "vec_math.h"


#include <array>
#include <type_traits>
#include <utility>

namespace conveyor {
namespace {

inline int32_t word(const int8_t* p) {
    int32_t w;
    std::memcpy(&w, p, 4);
    return w;
}

// kIQ4Values plus 128: the IQ4 values as unsigned bytes for vpdpbusd.
struct IQ4Unsigned {
    uint8_t v[16];
    constexpr IQ4Unsigned() : v{} {
        for (int i = 0; i < 16; ++i) v[i] = static_cast<uint8_t>(kIQ4Values[i] + 128);
    }
};
alignas(16) constexpr IQ4Unsigned kIQ4Unsigned{};

#if defined(__AVX2__)
// How far ahead of the block being read the weight stream is prefetched.
constexpr int64_t kPrefetchBytes = 2048;

inline void prefetch_group(int64_t T, const uint8_t* blk) {
    for (int64_t line = 0; line < block_bytes(T); line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetchBytes + line), _MM_HINT_T0);
}
#endif

// Where each row's integer accumulator starts: the activation block's -8 x sum (Q4_0) or -128 x sum
// (signed 8-bit weights and the IQ4 values made unsigned), per half block for the types with a scale
// per half (Q3_K: that / 32, its -4; Q6_K: / 4, its -32); Q2_K, Q4_1, Q4_K and Q5_K start at 0.
template <int64_t T>
const int32_t* start_values(const Activations& a) {
    if constexpr (T == Q4_0) return a.neg8.data();
    else if constexpr (has_half_scales(T)) return a.neg128h.data();
    else return a.neg128.data();
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
constexpr int kPassRows = kPackRows;  // MR: 12 integer + 12 fp32 accumulators + the chunk vectors fit 32 registers

inline __m512 cvt_u8(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))); }
inline __m512 cvt_i8(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))); }
inline __m512 cvt_f16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __mmask64 mask64(const uint8_t* p) {
    uint64_t m;
    std::memcpy(&m, p, 8);
    return _cvtu64_mask64(m);
}

// dot[i] += the products of an 8-bit block (signed, made unsigned) with row i.
template <int MR>
inline void dot8(const uint8_t* blk, const int8_t* x, __m512i* dot) {
    const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
        const __m512i w = _mm512_xor_si512(_mm512_loadu_si512(blk + 64 * j), bias);
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) dot[i] = _mm512_dpbusd_epi32(dot[i], w, _mm512_set1_epi32(word(x + (j * MR + i) * 4)));
    }
}

template <int MR>
inline void scale_into(const __m512i* dot, __m512 wd, const float* xd, __m512* acc) {
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i)
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i]), _mm512_mul_ps(wd, _mm512_set1_ps(xd[i])), acc[i]);
}

// Dense tiles (W = bf16 or float): per input k, the tile's 16 weights (bf16 widened to fp32, a shift)
// and one FMA per activation row, broadcast from the packed fp32 group. vdpbf16ps would take bf16
// activations, but it runs at half the FMA rate on the AVX-512 Xeons measured here (`bench/peaks.py`:
// bf16-avx512 82 GFLOP/s a core, fp32-fma 163).
template <typename W, int MR>
void dense_pass(const uint8_t* tile, const Activations& a, int64_t m0, bool prefetch, __m512* acc) {
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
    const float* x = a.f.data() + m0 * a.K;
    const W* w = reinterpret_cast<const W*>(tile);
    for (int64_t k = 0; k < a.K; ++k, x += MR, w += kTileRows) {
        if (prefetch && (sizeof(W) == 4 || k % 2 == 0))  // a cache line: 2 steps of bf16, 1 of fp32
            _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes, _MM_HINT_T0);
        const __m512 wv = load16(w);
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) acc[i] = _mm512_fmadd_ps(wv, _mm512_set1_ps(x[i]), acc[i]);
    }
}

template <int64_t T, int MR>
void tile_pass(const uint8_t* tile, const Activations& a, int64_t m0, bool prefetch, __m512* result) {
    const int64_t nb = a.nb;
    __m512 acc[MR];
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
    // The packed group (Activations): MR rows' words interleaved, per block MR * 32 bytes and MR of each sum.
    const int8_t* x = a.q.data() + m0 * a.K;
    const float* xd = a.d.data() + m0 * nb;
    const float* xs = a.s32.data() + m0 * nb;
    const int32_t* xstart = start_values<T>(a) + m0 * nb * (has_half_scales(T) ? 2 : 1);
    __m512 hd = _mm512_setzero_ps(), hm = _mm512_setzero_ps();  // a K-quant super-block's d and dmin
    for (int64_t b = 0; b < nb; ++b, x += MR * QK, xd += MR, xs += MR, xstart += MR * (has_half_scales(T) ? 2 : 1)) {
        const uint8_t* blk = tile_block(T, tile, b);
        if (prefetch) prefetch_group(T, blk);  // the first pass over a tile streams it from memory
        if constexpr (has_superblocks(T)) {
            if (b % group_blocks(T) == 0) {
                const uint8_t* head = tile_header(T, tile, b);
                hd = cvt_f16(head);
                if constexpr (T == Q2_K || T == Q4_K || T == Q5_K) hm = cvt_f16(head + 32);
            }
        }
        __m512i dot[MR];
        if constexpr (is4bit(T)) {
#pragma GCC unroll 16
            for (int i = 0; i < MR; ++i)
                dot[i] = T == Q4_0 || is_iq4(T) ? _mm512_set1_epi32(xstart[i]) : _mm512_setzero_si512();
            const __m512i low4 = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 4
            for (int j = 0; j < 4; ++j) {
                const __m512i raw = _mm512_loadu_si512(blk + 64 * j);
                __m512i lo = _mm512_and_si512(raw, low4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
                if constexpr (T == Q5_K) {  // the fifth bits: 16 added where a chunk byte's mask bit is set
                    const __m512i sixteen = _mm512_set1_epi8(16);
                    lo = _mm512_mask_add_epi8(lo, mask64(blk + 256 + 8 * j), lo, sixteen);
                    hi = _mm512_mask_add_epi8(hi, mask64(blk + 256 + 32 + 8 * j), hi, sixteen);
                }
                if constexpr (is_iq4(T)) {
                    const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kIQ4Unsigned.v)));
                    lo = _mm512_shuffle_epi8(table, lo), hi = _mm512_shuffle_epi8(table, hi);
                }
#pragma GCC unroll 16
                for (int i = 0; i < MR; ++i) dot[i] = _mm512_dpbusd_epi32(dot[i], lo, _mm512_set1_epi32(word(x + (j * MR + i) * 4)));
#pragma GCC unroll 16
                for (int i = 0; i < MR; ++i)
                    dot[i] = _mm512_dpbusd_epi32(dot[i], hi, _mm512_set1_epi32(word(x + ((j + 4) * MR + i) * 4)));
            }
            const uint8_t* sc = blk + quant_bytes(T);
            if constexpr (T == Q4_K || T == Q5_K) {  // w = (d sc) q - (dmin m)
                scale_into<MR>(dot, _mm512_mul_ps(hd, cvt_u8(sc)), xd, acc);
                const __m512 wm = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(hm, cvt_u8(sc + 16)));
#pragma GCC unroll 16
                for (int i = 0; i < MR; ++i) acc[i] = _mm512_fmadd_ps(wm, _mm512_set1_ps(xs[i]), acc[i]);
            } else if constexpr (T == IQ4_XS) {  // w = (d sc) kvalues[q]
                scale_into<MR>(dot, _mm512_mul_ps(hd, cvt_i8(sc)), xd, acc);
            } else {
                scale_into<MR>(dot, cvt_f16(sc), xd, acc);
                if constexpr (T == Q4_1) {
                    const __m512 wm = cvt_f16(sc + 32);
#pragma GCC unroll 16
                    for (int i = 0; i < MR; ++i) acc[i] = _mm512_fmadd_ps(wm, _mm512_set1_ps(xs[i]), acc[i]);
                }
            }
        } else if constexpr (is2bit(T)) {  // a scale per half block; chunk j: plane j % 2 shifted by 2 (j / 2)
            const __m512i planes[2] = {_mm512_loadu_si512(blk), _mm512_loadu_si512(blk + 64)};
            const __m512i three = _mm512_set1_epi8(3);
            const uint8_t* sc = blk + quant_bytes(T);
#pragma GCC unroll 2
            for (int h = 0; h < 2; ++h) {
#pragma GCC unroll 16
                for (int i = 0; i < MR; ++i) dot[i] = T == Q3_K ? _mm512_set1_epi32(xstart[h * MR + i] / 32) : _mm512_setzero_si512();
#pragma GCC unroll 4
                for (int j = 4 * h; j < 4 * h + 4; ++j) {
                    __m512i q = _mm512_and_si512(_mm512_srli_epi16(planes[j % 2], 2 * (j / 2)), three);
                    if constexpr (T == Q3_K) q = _mm512_mask_add_epi8(q, mask64(blk + 128 + 8 * j), q, _mm512_set1_epi8(4));
#pragma GCC unroll 16
                    for (int i = 0; i < MR; ++i) dot[i] = _mm512_dpbusd_epi32(dot[i], q, _mm512_set1_epi32(word(x + (j * MR + i) * 4)));
                }
                if constexpr (T == Q3_K) {  // w = (d sc) (q - 4)
                    scale_into<MR>(dot, _mm512_mul_ps(hd, cvt_i8(sc + 16 * h)), xd, acc);
                } else {  // w = (d sc) q - (dmin m), sc and m the nibbles of one byte
                    const __m512i packed = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 16 * h)));
                    const __m512 scl = _mm512_cvtepi32_ps(_mm512_and_si512(packed, _mm512_set1_epi32(0xF)));
                    scale_into<MR>(dot, _mm512_mul_ps(hd, scl), xd, acc);
                    const __m512 wm = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(hm, _mm512_cvtepi32_ps(_mm512_srli_epi32(packed, 4))));
#pragma GCC unroll 16
                    for (int i = 0; i < MR; ++i)  // the half's sum from its -128 x sum, exactly
                        acc[i] = _mm512_fmadd_ps(wm, _mm512_set1_ps(xd[i] * static_cast<float>(xstart[h * MR + i] / -128)), acc[i]);
                }
            }
        } else if constexpr (T == Q6_K) {  // a scale per half block: q = nibble | high bits << 4 (0..63)
            const __m512i planes[2] = {_mm512_loadu_si512(blk + 256), _mm512_loadu_si512(blk + 320)};
            const __m512i low4 = _mm512_set1_epi8(0x0F), bits45 = _mm512_set1_epi8(0x30);
            const uint8_t* sc = blk + 384;
#pragma GCC unroll 2
            for (int h = 0; h < 2; ++h) {
#pragma GCC unroll 16
                for (int i = 0; i < MR; ++i) dot[i] = _mm512_set1_epi32(xstart[h * MR + i] / 4);  // -32 x the half's sum
#pragma GCC unroll 4
                for (int c = 0; c < 4; ++c) {  // word j = 4h + c: chunk c's low (h = 0) or high nibbles
                    const int j = 4 * h + c, shift = 4 - 2 * (j / 2);  // its high bits from bits 2 (j / 2) to 4
                    const __m512i raw = _mm512_loadu_si512(blk + 64 * c);
                    const __m512i nib = _mm512_and_si512(h ? _mm512_srli_epi16(raw, 4) : raw, low4);
                    const __m512i high = _mm512_and_si512(
                        shift >= 0 ? _mm512_slli_epi16(planes[j % 2], shift) : _mm512_srli_epi16(planes[j % 2], -shift), bits45);
                    const __m512i q = _mm512_or_si512(nib, high);
#pragma GCC unroll 16
                    for (int i = 0; i < MR; ++i) dot[i] = _mm512_dpbusd_epi32(dot[i], q, _mm512_set1_epi32(word(x + (j * MR + i) * 4)));
                }
                scale_into<MR>(dot, _mm512_mul_ps(hd, cvt_i8(sc + 16 * h)), xd, acc);
            }
        } else {
#pragma GCC unroll 16
            for (int i = 0; i < MR; ++i) dot[i] = _mm512_set1_epi32(xstart[i]);
            dot8<MR>(blk, x, dot);
            if constexpr (T == I8) {  // per-row scales come after the whole sum
#pragma GCC unroll 16
                for (int i = 0; i < MR; ++i) acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i]), _mm512_set1_ps(xd[i]), acc[i]);
            } else {
                scale_into<MR>(dot, cvt_f16(blk + 512), xd, acc);
            }
        }
    }
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) result[i] = acc[i];
}

template <int64_t T, int MR>
void tile_rows(const uint8_t* tile, const float* scales, const Activations& a, int64_t m0, int64_t n0, int64_t N,
               const TileOut& out) {
    // The next tile's output lines of these rows, fetched while this one computes: at a wide output
    // (the LM head's 49k columns) each row's line is in another page and misses every cache, and
    // the stores stalled on those reads (256 rows: 43-60 ms a call against 35 for the same tiles
    // into a buffer that stays in L2).
    if (!out.stream && n0 + kTileRows < N)
        for (int i = 0; i < MR; ++i) _mm_prefetch(out.address(m0 + i, n0 + kTileRows), _MM_HINT_T0);
    __m512 res[MR];
    if constexpr (T == BF16) dense_pass<bf16, MR>(tile, a, m0, m0 == 0, res);
    else if constexpr (T == F32) dense_pass<float, MR>(tile, a, m0, m0 == 0, res);
    else tile_pass<T, MR>(tile, a, m0, m0 == 0, res);
    const int64_t valid = std::min<int64_t>(kTileRows, N - n0);
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
    const __m512 sv = scales ? _mm512_maskz_loadu_ps(mask, scales + n0) : _mm512_set1_ps(1.f);
    const __m512 bv = out.bias ? _mm512_maskz_loadu_ps(mask, out.bias + n0) : _mm512_setzero_ps();
    for (int i = 0; i < MR; ++i) {
        const __m512 v = _mm512_fmadd_ps(res[i], sv, bv);
        const int64_t at = out.at(m0 + i, n0);
        if (out.stream && valid == kTileRows) _mm512_stream_ps(static_cast<float*>(out.data) + at, v);
        else if (out.bf16) store16(static_cast<bf16*>(out.data) + at, v, mask);
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
// and widen every product pair, with no offset to take back.
constexpr int kPassRows = kPackRows;

inline __m256i bcast4(const int8_t* p) { return _mm256_set1_epi32(word(p)); }
inline __m128i load16b(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline __m256 cvt_u8x8(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))); }
inline __m256 cvt_i8x8(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))); }
inline __m256 cvt_f16x8(const uint8_t* p) { return _mm256_cvtph_ps(load16b(p)); }
// 32 mask bits (Q3_K, Q5_K) as 32 bytes of `value` (bit set) or 0: byte i takes mask byte i / 8, tests bit i % 8.
inline __m256i high_bytes(const uint8_t* p, char value) {
    uint32_t bits;
    std::memcpy(&bits, p, 4);
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3,
                                            3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ull));
    const __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), spread), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(v, bit), _mm256_set1_epi8(value));
}
// A chunk half's nibbles as the weights the dot product takes: Q5_K's fifth bits added, the IQ4 values
// looked up (plus 128 for vpdpbusd, or signed for the vpmaddubsw path).
template <int64_t T>
inline void expand_nibbles(const uint8_t* blk, int j, int half, __m256i& lo, __m256i& hi, bool unsigned_iq4) {
    if constexpr (T == Q5_K) {
        lo = _mm256_or_si256(lo, high_bytes(blk + 256 + 8 * j + 4 * half, 16));
        hi = _mm256_or_si256(hi, high_bytes(blk + 256 + 32 + 8 * j + 4 * half, 16));
    }
    if constexpr (is_iq4(T)) {
        const __m128i t = unsigned_iq4 ? _mm_load_si128(reinterpret_cast<const __m128i*>(kIQ4Unsigned.v))
                                       : _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4Values));
        const __m256i table = _mm256_broadcastsi128_si256(t);
        lo = _mm256_shuffle_epi8(table, lo), hi = _mm256_shuffle_epi8(table, hi);
    }
}

// dot[i] (+)= the products of an 8-bit block's half `half` with row i.
template <int MR>
inline void dot8(const uint8_t* blk, int half, const int8_t* x, __m256i* dot) {
#if defined(__AVXVNNI__)
    const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
    for (int j = 0; j < 8; ++j) {
        const __m256i w = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * j + 32 * half)), bias);
        for (int i = 0; i < MR; ++i) dot[i] = _mm256_dpbusd_avx_epi32(dot[i], w, bcast4(x + (j * MR + i) * 4));
    }
#else
    const __m256i ones = _mm256_set1_epi16(1);
    for (int j = 0; j < 8; ++j) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * j + 32 * half));
        const __m256i u = _mm256_sign_epi8(w, w);
        for (int i = 0; i < MR; ++i)
            dot[i] = _mm256_add_epi32(dot[i], _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_sign_epi8(bcast4(x + (j * MR + i) * 4), w)), ones));
    }
#endif
}

// The integer accumulators' start for 8-bit weights: the offset of the unsigned form, or none.
template <int MR>
inline void start8(const int32_t* xstart, __m256i* dot) {
#if defined(__AVXVNNI__)
    for (int i = 0; i < MR; ++i) dot[i] = _mm256_set1_epi32(xstart[i]);
#else
    (void)xstart;
    for (int i = 0; i < MR; ++i) dot[i] = _mm256_setzero_si256();
#endif
}

template <int MR>
inline void scale_into(const __m256i* dot, __m256 wd, const float* xd, __m256* acc) {
    for (int i = 0; i < MR; ++i)
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i]), _mm256_mul_ps(wd, _mm256_set1_ps(xd[i])), acc[i]);
}

template <typename W, int MR>
void dense_half_pass(const uint8_t* tile, int half, const Activations& a, int64_t m0, bool prefetch, __m256* acc) {
    for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
    const float* x = a.f.data() + m0 * a.K;
    const uint8_t* w = tile + 8 * sizeof(W) * half;
    for (int64_t k = 0; k < a.K; ++k, x += MR, w += sizeof(W) * kTileRows) {
        if (prefetch && (sizeof(W) == 4 || k % 2 == 0)) _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes, _MM_HINT_T0);
        const __m256 wv = sizeof(W) == 4 ? _mm256_loadu_ps(reinterpret_cast<const float*>(w))
                                         : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(load16b(w)), 16));
        for (int i = 0; i < MR; ++i) acc[i] = _mm256_fmadd_ps(wv, _mm256_set1_ps(x[i]), acc[i]);
    }
}

template <int64_t T, int MR>
void half_pass(const uint8_t* tile, int half, const Activations& a, int64_t m0, bool prefetch, __m256* result) {
    const int64_t nb = a.nb;
    __m256 acc[MR];
    for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
    const int8_t* x = a.q.data() + m0 * a.K;
    const float* xd = a.d.data() + m0 * nb;
    const float* xs = a.s32.data() + m0 * nb;
    const int32_t* xstart = start_values<T>(a) + m0 * nb * (has_half_scales(T) ? 2 : 1);
    __m256 hd = _mm256_setzero_ps(), hm = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b, x += MR * QK, xd += MR, xs += MR, xstart += MR * (has_half_scales(T) ? 2 : 1)) {
        const uint8_t* blk = tile_block(T, tile, b);
        if (prefetch) prefetch_group(T, blk);  // the second half reads the tile again, from cache by then
        if constexpr (has_superblocks(T)) {
            if (b % group_blocks(T) == 0) {
                const uint8_t* head = tile_header(T, tile, b);
                hd = cvt_f16x8(head + 16 * half);
                if constexpr (T == Q2_K || T == Q4_K || T == Q5_K) hm = cvt_f16x8(head + 32 + 16 * half);
            }
        }
        __m256i dot[MR];
        if constexpr (is4bit(T)) {
            const __m256i low4 = _mm256_set1_epi8(0x0F);
#if defined(__AVXVNNI__)
            for (int i = 0; i < MR; ++i) dot[i] = T == Q4_0 || is_iq4(T) ? _mm256_set1_epi32(xstart[i]) : _mm256_setzero_si256();
            for (int j = 0; j < 4; ++j) {
                const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * j + 32 * half));
                __m256i lo = _mm256_and_si256(raw, low4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
                expand_nibbles<T>(blk, j, half, lo, hi, true);
                for (int i = 0; i < MR; ++i) dot[i] = _mm256_dpbusd_avx_epi32(dot[i], lo, bcast4(x + (j * MR + i) * 4));
                for (int i = 0; i < MR; ++i) dot[i] = _mm256_dpbusd_avx_epi32(dot[i], hi, bcast4(x + ((j + 4) * MR + i) * 4));
            }
#else
            const __m256i ones = _mm256_set1_epi16(1);
            for (int i = 0; i < MR; ++i) dot[i] = T == Q4_0 ? _mm256_set1_epi32(xstart[i]) : _mm256_setzero_si256();
            if constexpr (is_iq4(T)) {  // signed values: |w| times x carrying w's sign (a pair sum up to
                // 2 x 127 x 127: each product pair widened on its own, as two would overflow int16)
                for (int j = 0; j < 4; ++j) {
                    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * j + 32 * half));
                    __m256i lo = _mm256_and_si256(raw, low4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
                    expand_nibbles<T>(blk, j, half, lo, hi, false);
                    const __m256i ulo = _mm256_sign_epi8(lo, lo), uhi = _mm256_sign_epi8(hi, hi);
                    for (int i = 0; i < MR; ++i) {
                        const __m256i plo = _mm256_maddubs_epi16(ulo, _mm256_sign_epi8(bcast4(x + (j * MR + i) * 4), lo));
                        const __m256i phi = _mm256_maddubs_epi16(uhi, _mm256_sign_epi8(bcast4(x + ((j + 4) * MR + i) * 4), hi));
                        dot[i] = _mm256_add_epi32(dot[i], _mm256_add_epi32(_mm256_madd_epi16(plo, ones), _mm256_madd_epi16(phi, ones)));
                    }
                }
            } else {
                // Pair sums stay in int16 for as many chunks as cannot overflow it: 4 x 2 x 2 x 15 x 127
                // for nibbles, 2 x 2 x 2 x 31 x 127 for Q5_K's 5-bit values.
                constexpr int kWiden = T == Q5_K ? 2 : 4;
                __m256i s16[MR];
                for (int j = 0; j < 4; ++j) {
                    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * j + 32 * half));
                    __m256i lo = _mm256_and_si256(raw, low4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
                    expand_nibbles<T>(blk, j, half, lo, hi, false);
                    for (int i = 0; i < MR; ++i) {
                        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(x + (j * MR + i) * 4)),
                                                           _mm256_maddubs_epi16(hi, bcast4(x + ((j + 4) * MR + i) * 4)));
                        s16[i] = j % kWiden == 0 ? p : _mm256_add_epi16(s16[i], p);
                    }
                    if (j % kWiden == kWiden - 1)
                        for (int i = 0; i < MR; ++i) dot[i] = _mm256_add_epi32(dot[i], _mm256_madd_epi16(s16[i], ones));
                }
            }
#endif
            const uint8_t* sc = blk + quant_bytes(T);
            if constexpr (T == Q4_K || T == Q5_K) {
                scale_into<MR>(dot, _mm256_mul_ps(hd, cvt_u8x8(sc + 8 * half)), xd, acc);
                const __m256 wm = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(hm, cvt_u8x8(sc + 16 + 8 * half)));
                for (int i = 0; i < MR; ++i) acc[i] = _mm256_fmadd_ps(wm, _mm256_set1_ps(xs[i]), acc[i]);
            } else if constexpr (T == IQ4_XS) {
                scale_into<MR>(dot, _mm256_mul_ps(hd, cvt_i8x8(sc + 8 * half)), xd, acc);
            } else {
                scale_into<MR>(dot, cvt_f16x8(sc + 16 * half), xd, acc);
                if constexpr (T == Q4_1) {
                    const __m256 wm = cvt_f16x8(sc + 32 + 16 * half);
                    for (int i = 0; i < MR; ++i) acc[i] = _mm256_fmadd_ps(wm, _mm256_set1_ps(xs[i]), acc[i]);
                }
            }
        } else if constexpr (is2bit(T)) {
            const __m256i planes[2] = {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 * half)),
                                       _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 + 32 * half))};
            const __m256i three = _mm256_set1_epi8(3);
            const uint8_t* sc = blk + quant_bytes(T);
            for (int h = 0; h < 2; ++h) {
                for (int i = 0; i < MR; ++i) dot[i] = T == Q3_K ? _mm256_set1_epi32(xstart[h * MR + i] / 32) : _mm256_setzero_si256();
#if !defined(__AVXVNNI__)
                __m256i s16[MR];  // pair sums of at most 2 x 7 x 127, four chunks: int16 holds them
#endif
                for (int j = 4 * h; j < 4 * h + 4; ++j) {
                    __m256i q = _mm256_and_si256(_mm256_srli_epi16(planes[j % 2], 2 * (j / 2)), three);
                    if constexpr (T == Q3_K) q = _mm256_or_si256(q, high_bytes(blk + 128 + 8 * j + 4 * half, 4));
#if defined(__AVXVNNI__)
                    for (int i = 0; i < MR; ++i) dot[i] = _mm256_dpbusd_avx_epi32(dot[i], q, bcast4(x + (j * MR + i) * 4));
#else
                    for (int i = 0; i < MR; ++i) {
                        const __m256i p = _mm256_maddubs_epi16(q, bcast4(x + (j * MR + i) * 4));
                        s16[i] = j == 4 * h ? p : _mm256_add_epi16(s16[i], p);
                    }
#endif
                }
#if !defined(__AVXVNNI__)
                for (int i = 0; i < MR; ++i) dot[i] = _mm256_add_epi32(dot[i], _mm256_madd_epi16(s16[i], _mm256_set1_epi16(1)));
#endif
                if constexpr (T == Q3_K) {
                    scale_into<MR>(dot, _mm256_mul_ps(hd, cvt_i8x8(sc + 16 * h + 8 * half)), xd, acc);
                } else {
                    const __m256i packed = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 16 * h + 8 * half)));
                    const __m256 scl = _mm256_cvtepi32_ps(_mm256_and_si256(packed, _mm256_set1_epi32(0xF)));
                    scale_into<MR>(dot, _mm256_mul_ps(hd, scl), xd, acc);
                    const __m256 wm = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(hm, _mm256_cvtepi32_ps(_mm256_srli_epi32(packed, 4))));
                    for (int i = 0; i < MR; ++i)
                        acc[i] = _mm256_fmadd_ps(wm, _mm256_set1_ps(xd[i] * static_cast<float>(xstart[h * MR + i] / -128)), acc[i]);
                }
            }
        } else if constexpr (T == Q6_K) {  // as the AVX-512 kernel: q = nibble | high bits << 4 (0..63)
            const __m256i planes[2] = {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 256 + 32 * half)),
                                       _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 320 + 32 * half))};
            const __m256i low4 = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30);
            const uint8_t* sc = blk + 384;
            for (int h = 0; h < 2; ++h) {
                for (int i = 0; i < MR; ++i) dot[i] = _mm256_set1_epi32(xstart[h * MR + i] / 4);
#if !defined(__AVXVNNI__)
                __m256i s16[MR];  // pair sums of at most 2 x 63 x 127, two chunks: int16 holds them
#endif
                for (int c = 0; c < 4; ++c) {
                    const int j = 4 * h + c, shift = 4 - 2 * (j / 2);
                    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * c + 32 * half));
                    const __m256i nib = _mm256_and_si256(h ? _mm256_srli_epi16(raw, 4) : raw, low4);
                    const __m256i high = _mm256_and_si256(
                        shift >= 0 ? _mm256_slli_epi16(planes[j % 2], shift) : _mm256_srli_epi16(planes[j % 2], -shift), bits45);
                    const __m256i q = _mm256_or_si256(nib, high);
#if defined(__AVXVNNI__)
                    for (int i = 0; i < MR; ++i) dot[i] = _mm256_dpbusd_avx_epi32(dot[i], q, bcast4(x + (j * MR + i) * 4));
#else
                    for (int i = 0; i < MR; ++i) {
                        const __m256i p = _mm256_maddubs_epi16(q, bcast4(x + (j * MR + i) * 4));
                        s16[i] = c % 2 == 0 ? p : _mm256_add_epi16(s16[i], p);
                    }
                    if (c % 2 == 1)
                        for (int i = 0; i < MR; ++i) dot[i] = _mm256_add_epi32(dot[i], _mm256_madd_epi16(s16[i], _mm256_set1_epi16(1)));
#endif
                }
                scale_into<MR>(dot, _mm256_mul_ps(hd, cvt_i8x8(sc + 16 * h + 8 * half)), xd, acc);
            }
        } else {
            start8<MR>(xstart, dot);
            dot8<MR>(blk, half, x, dot);
            if constexpr (T == I8) {
                for (int i = 0; i < MR; ++i) acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i]), _mm256_set1_ps(xd[i]), acc[i]);
            } else {
                scale_into<MR>(dot, cvt_f16x8(blk + 512 + 16 * half), xd, acc);
            }
        }
    }
    for (int i = 0; i < MR; ++i) result[i] = acc[i];
}

template <int64_t T, int MR>
void tile_rows(const uint8_t* tile, const float* scales, const Activations& a, int64_t m0, int64_t n0, int64_t N,
               const TileOut& out) {
    if (n0 + kTileRows < N)  // as in the AVX-512 kernel: the next tile's output lines
        for (int i = 0; i < MR; ++i) _mm_prefetch(out.address(m0 + i, n0 + kTileRows), _MM_HINT_T0);
    for (int half = 0; half < 2; ++half) {
        __m256 res[MR];
        if constexpr (T == BF16) dense_half_pass<bf16, MR>(tile, half, a, m0, m0 == 0 && half == 0, res);
        else if constexpr (T == F32) dense_half_pass<float, MR>(tile, half, a, m0, m0 == 0 && half == 0, res);
        else half_pass<T, MR>(tile, half, a, m0, m0 == 0 && half == 0, res);
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
// Plain C++: the reference of the arithmetic above, one output at a time.
constexpr int kPassRows = 1;

template <int64_t T, int MR>
void tile_rows(const uint8_t* tile, const float* scales, const Activations& a, int64_t m0, int64_t n0, int64_t N,
               const TileOut& out) {
    const int64_t valid = std::min<int64_t>(kTileRows, N - n0);
    for (int i = 0; i < MR; ++i) {
        const int64_t m = m0 + i;
        for (int r = 0; r < valid; ++r) {
            float acc = 0.f;
            if constexpr (T == BF16 || T == F32) {
                using W = std::conditional_t<T == F32, float, bf16>;
                const W* w = reinterpret_cast<const W*>(tile) + r;
                const int64_t g0 = Activations::group_start(m), rows = a.group_rows(g0);
                for (int64_t k = 0; k < a.K; ++k) acc += static_cast<float>(w[k * kTileRows]) * a.f[g0 * a.K + k * rows + m - g0];
                out.store(m, n0 + r, acc);
                continue;
            }
            for (int64_t b = 0; b < a.nb; ++b) {
                const uint8_t* blk = tile_block(T, tile, b);
                const float xd = a.d[a.at(m, b)];
                for (int h = 0; h < 2; ++h) {  // halves: the scales of Q2_K, Q3_K and Q6_K differ
                    int dot = 0, sum = 0;
                    for (int e = 16 * h; e < 16 * h + 16; ++e) {
                        const int v = a.value(m, b, e);
                        dot += tiled_weight(T, blk, r, e) * v, sum += v;
                    }
                    float d, mn;  // w = d q + mn for this half block
                    const uint8_t* sc = blk + quant_bytes(T);
                    const uint8_t* head = tile_header(T, tile, b);
                    switch (T) {
                        case Q4_0: d = half_to_float(fp16_scales(sc)[r]), mn = -8.f * d; break;
                        case Q4_1: d = half_to_float(fp16_scales(sc)[r]), mn = half_to_float(fp16_scales(sc)[16 + r]); break;
                        case Q8_0: d = half_to_float(fp16_scales(sc)[r]), mn = 0.f; break;
                        case Q2_K:
                            d = half_to_float(fp16_scales(head)[r]) * (sc[16 * h + r] & 0xF);
                            mn = -(half_to_float(fp16_scales(head)[16 + r]) * (sc[16 * h + r] >> 4));
                            break;
                        case Q3_K: d = half_to_float(fp16_scales(head)[r]) * static_cast<int8_t>(sc[16 * h + r]), mn = 0.f; break;
                        case Q4_K:
                        case Q5_K:
                            d = half_to_float(fp16_scales(head)[r]) * sc[r];
                            mn = -(half_to_float(fp16_scales(head)[16 + r]) * sc[16 + r]);
                            break;
                        case Q6_K: d = half_to_float(fp16_scales(head)[r]) * static_cast<int8_t>(sc[16 * h + r]), mn = 0.f; break;
                        case IQ4_NL: d = half_to_float(fp16_scales(sc)[r]), mn = 0.f; break;
                        case IQ4_XS: d = half_to_float(fp16_scales(head)[r]) * static_cast<int8_t>(sc[r]), mn = 0.f; break;
                        default: d = 1.f, mn = 0.f;
                    }
                    acc += d * xd * dot + mn * xd * sum;
                }
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
#if defined(__SSE2__)
    if (out.stream) _mm_sfence();  // the streamed lines are visible before the caller's threads join
#endif
}

}  // namespace

void tiles_matmul(int64_t type, const uint8_t* w, const float* row_scales, const Activations& a, int64_t t0,
                  int64_t t1, int64_t N, const TileOut& out) {
    switch (type) {
        case Q4_0: return typed_tiles_matmul<Q4_0>(w, row_scales, a, t0, t1, N, out);
        case Q4_1: return typed_tiles_matmul<Q4_1>(w, row_scales, a, t0, t1, N, out);
        case Q8_0: return typed_tiles_matmul<Q8_0>(w, row_scales, a, t0, t1, N, out);
        case Q2_K: return typed_tiles_matmul<Q2_K>(w, row_scales, a, t0, t1, N, out);
        case Q3_K: return typed_tiles_matmul<Q3_K>(w, row_scales, a, t0, t1, N, out);
        case Q4_K: return typed_tiles_matmul<Q4_K>(w, row_scales, a, t0, t1, N, out);
        case Q5_K: return typed_tiles_matmul<Q5_K>(w, row_scales, a, t0, t1, N, out);
        case Q6_K: return typed_tiles_matmul<Q6_K>(w, row_scales, a, t0, t1, N, out);
        case IQ4_NL: return typed_tiles_matmul<IQ4_NL>(w, row_scales, a, t0, t1, N, out);
        case IQ4_XS: return typed_tiles_matmul<IQ4_XS>(w, row_scales, a, t0, t1, N, out);
        case I8: return typed_tiles_matmul<I8>(w, row_scales, a, t0, t1, N, out);
        case BF16: return typed_tiles_matmul<BF16>(w, row_scales, a, t0, t1, N, out);
        case F32: return typed_tiles_matmul<F32>(w, row_scales, a, t0, t1, N, out);
        default: fail("type ", type, " has no tiled layout");
    }
}

}  // namespace conveyor
