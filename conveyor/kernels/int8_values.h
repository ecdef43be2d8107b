// Integer value sums over int8 V rows (kv_cache_dtype "int8"; the arithmetic is attention_blocks.h's):
// a block's softmax weights times the rows' scales, w = p * s_v, rounded to 15-bit integers on the
// block's own scale, then summed against the rows' int8 values exactly, two keys at a time (VNNI's
// vpdpwssd, or vpmaddwd and an add), and the sum folded into the fp32 output once per block. Against
// widening every value to fp32 and a multiply-add per key and entry, a fraction of the instructions;
// and integer sums have no order, so decode (along the head dim) and prefill (along query rows) get
// the same bits. docs/design/kv-cache.md has what the rounding costs.
#pragma once

#include "attention_blocks.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>

namespace conveyor {

// A block's weights for one row: `weight_inverse` gives kWeightLevels / w_max (0 for a block of tiny
// weights), `weight_scale` the sum's scale w_max / kWeightLevels, `weight_levels` the integers
// nearbyint(w * inv) in [0, kWeightLevels], in each lane's low 16 bits (fp32's 1.5 * 2^23 added rounds to an integer in the low mantissa bits, ties to
// even, as nearbyint). 15 bits, not bytes (vpdpbusd, four keys an instruction): measured on the
// built-in model, bytes cost 0.3% perplexity, 15 bits 0.1% (docs/design/kv-cache.md).
constexpr float kWeightLevels = 32767.f;
constexpr float kTinyWeight = 1e-30f;
inline float weight_inverse(float wmax) { return wmax >= kTinyWeight ? kWeightLevels / wmax : 0.f; }
inline float weight_scale(float wmax) { return wmax >= kTinyWeight ? wmax / kWeightLevels : 0.f; }
inline vecw weight_inverse(vecw wmax) { return select(wmax >= kTinyWeight, splat(kWeightLevels) / wmax, vecw{}); }
inline vecw weight_scale(vecw wmax) { return select(wmax >= kTinyWeight, wmax / splat(kWeightLevels), vecw{}); }
inline ivecw weight_levels(vecw w, vecw inv) {
    const vecw x = w * inv + splat(12582912.f);
    ivecw u;
    std::memcpy(&u, &x, sizeof u);
    return u & 0xffff;
}

// Two keys' int8 value rows as pairs for `dot_pairs`: 32-bit words each holding the two keys' values
// at one head-dim entry as 16-bit integers (key 0 in the low half). Groups of 4W entries, four
// vectors each, in the "pair layout" that a 16-bit unpack within 16-byte lanes gives: vector 4g + 2h
// + k, lane l holds entry 4Wg + 2Wh + 8(l / 4) + 4k + l % 4 (`pair_entry` is the inverse). Entries
// past D read zeros.
typedef int8_t pbytes __attribute__((vector_size(2 * W)));
typedef int16_t pshorts __attribute__((vector_size(4 * W)));
constexpr int64_t pair_groups(int64_t D) { return (D + 4 * W - 1) / (4 * W); }
constexpr int64_t pair_entry(int64_t d) {
    const int64_t r = d % (2 * W);
    return d - r + r % 8 / 4 * W + r / 8 * 4 + r % 4;
}
namespace detail {
template <bool Hi, int... E>
inline ivecw unpack_pairs(pshorts a, pshorts b, std::integer_sequence<int, E...>) {
    const pshorts z = __builtin_shufflevector(a, b, (E / 8 * 8 + (Hi ? 4 : 0) + E % 8 / 2 + E % 2 * 2 * W)...);
    ivecw out;
    std::memcpy(&out, &z, sizeof out);
    return out;
}
}  // namespace detail
// 2W bytes sign-extended to 16 bits: one vpmovsxbw (GCC's znver4 tuning splits the generic form into
// two halves and an insert).
inline pshorts widen_bytes(const int8_t* p) {
#if defined(__AVX512BW__)
    return pshorts(_mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif defined(__AVX2__)
    return pshorts(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
    pbytes b;
    std::memcpy(&b, p, sizeof b);
    return __builtin_convertvector(b, pshorts);
#endif
}

template <bool Full>
inline void value_pairs(const int8_t* const* rows, int64_t offset, int64_t D, int64_t g, ivecw* out) {
    for (int h = 0; h < 2; ++h) {
        const int64_t d0 = (2 * g + h) * 2 * W;
        pshorts r[2];
        for (int i = 0; i < 2; ++i) {
            if (Full) {
                r[i] = widen_bytes(rows[i] + offset + d0);
            } else {
                alignas(64) int8_t tail[2 * W] = {};
                if (d0 < D) std::memcpy(tail, rows[i] + offset + d0, std::min<int64_t>(2 * W, D - d0));
                r[i] = widen_bytes(tail);
            }
        }
        out[2 * h] = detail::unpack_pairs<false>(r[0], r[1], std::make_integer_sequence<int, 2 * W>{});
        out[2 * h + 1] = detail::unpack_pairs<true>(r[0], r[1], std::make_integer_sequence<int, 2 * W>{});
    }
}

// Decode's sums (attention_cpu.h's `block_values` for int8 rows): C query heads' weights u
// ([C][kKeyBlock]) times the value pairs of keys [lo, hi), two keys at a time, group by group of 4W
// head-dim entries; each head's sums folded into o ([C][Dp], the pair layout) as
// fmadd(float(sum), sw[c], o). `each_key(i)` runs before key i's products (the caller's prefetches).
template <bool Full, int C, typename F>
inline void value_pair_sums(const int8_t* const* rows, int64_t offset, int64_t lo, int64_t hi, int64_t D, int64_t Dp,
                            const uint16_t* u, const float* sw, float* o, F&& each_key) {
    for (int64_t g = 0; g < pair_groups(D); ++g) {
        ivecw acc[C][4] = {};
        for (int64_t i = lo / 2 * 2; i < hi; i += 2) {
            if (g == 0)
                for (int64_t k = std::max(i, lo); k < std::min(i + 2, hi); ++k) each_key(k);
            ivecw v[4];
            value_pairs<Full>(rows + i, offset, D, g, v);
#pragma GCC unroll 8
            for (int c = 0; c < C; ++c) {
                int32_t word;
                std::memcpy(&word, u + c * kKeyBlock + i, sizeof word);
                const ivecw x = splat_i(word);
                for (int k = 0; k < 4; ++k) acc[c][k] = dot_pairs(acc[c][k], x, v[k]);
            }
        }
        for (int c = 0; c < C; ++c)
            for (int k = 0; k < 4; ++k) {
                float* at = o + c * Dp + (4 * g + k) * W;
                storew(at, fmadd(__builtin_convertvector(acc[c][k], vecw), splat(sw[c]), loadw(at)));
            }
    }
}

// Prefill's register block over int8 rows, for its scores (`dot_quads`) and its value sums (`dot_pairs`):
// acc[i][c] = dot(acc[i][c], splat(S(i, j)), C row vectors of rows[j]) for j < nj in order, R broadcast
// words S(i, j) against rows ([nj][Rp], the query rows' words).
template <int R, int C, typename Splat, typename Dot>
inline void integer_tile(ivecw (&acc)[R][C], Splat S, const int32_t* rows, int64_t nj, int64_t Rp, Dot dot) {
    for (int64_t j = 0; j < nj; ++j) {
        ivecw r[C];
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) std::memcpy(&r[c], rows + j * Rp + c * W, sizeof(ivecw));
#pragma GCC unroll 8
        for (int i = 0; i < R; ++i) {
            const ivecw x = splat_i(S(i, j));
#pragma GCC unroll 8
            for (int c = 0; c < C; ++c) acc[i][c] = dot(acc[i][c], x, r[c]);
        }
    }
}

// Prefill's sums (prefill_attention_cpu.cpp's `pv_tile` for int8 rows, along query rows): ot[d][rows]
// = fmadd(float(sum), sw[rows], ot[d][rows] * alpha[rows]), the sum over pairs j < nj of `dot_pairs`
// of the rows' weights pq[j] ([nj][Rp]) with entry d's value pair, for R entries d (entry d + i at
// at[i] of each pair row of vp, [nj][Dq]: `value_pairs`' layout) and C row vectors.
template <int R, int C>
inline void pv_tile_i8(const int32_t* vp, int64_t Dq, const int64_t* at, int64_t d, const int32_t* pq, int64_t nj,
                       int64_t Rp, const vecw* alpha, const float* sw, float* ot) {
    ivecw acc[R][C] = {};
    integer_tile<R, C>(acc, [vp, Dq, at](int i, int64_t j) { return vp[j * Dq + at[i]]; }, pq, nj, Rp,
                       [](ivecw a, ivecw x, ivecw p) { return dot_pairs(a, p, x); });
    for (int i = 0; i < R; ++i)
        for (int c = 0; c < C; ++c) {
            float* o = ot + (d + i) * Rp + c * W;
            storew(o, fmadd(__builtin_convertvector(acc[i][c], vecw), loadw(sw + c * W), loadw(o) * alpha[c]));
        }
}

// A block's int8 V rows (rows[n], n < kKeyBlock) as value pairs, vp [kKeyBlock / 2][Dq] (`value_pairs`'
// layout), laid out once for all of the block's query tiles.
inline void block_value_pairs(const int8_t* const* rows, int64_t D, int32_t* vp) {
    const int64_t Dq = pair_groups(D) * 4 * W;
    ivecw v[4];
    for (int64_t j = 0; j < kKeyBlock / 2; ++j)
        for (int64_t g = 0; g < pair_groups(D); ++g) {
            if (D % (4 * W) == 0) value_pairs<true>(rows + 2 * j, 0, D, g, v);
            else value_pairs<false>(rows + 2 * j, 0, D, g, v);
            std::memcpy(vp + j * Dq + g * 4 * W, v, sizeof v);
        }
}

}  // namespace conveyor
