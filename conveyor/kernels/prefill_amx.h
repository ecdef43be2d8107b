// Prefill attention's two products on AMX tiles (prefill_attention_cpu.cpp, bf16 queries over a bf16
// cache, where the CPU has AMX-BF16 and the caller allows it): the scores of 16 keys x 16 query rows
// and the weighted sums of 16 head-dim entries x 16 rows per tile instruction, instead of one row
// vector a key at a time. The tiles sum in their own order, and the weights enter the sums as two bf16
// parts (16 bits of each), so a query's output is no longer the decode kernel's bits: the caller
// takes this path only where batch invariance is not asked for (models/batch_invariance.py), as the
// linears' oneDNN path on the same CPUs.
//
// Layouts (row tiles of 16 query rows: Rp is a multiple of 16):
//   - a block's K rows row-major, [NB][Dp] bf16 (Dp: D rounded up to 32, zero past D; zero rows for
//     missing keys): a tile's rows are 16 keys;
//   - the queries as bf16 pairs [Dp / 2][Rp] (`query_pairs`, zero past D): a tile's rows are pairs;
//   - a block's V transposed, [Dp][NB] bf16 (zero for missing keys): a tile's rows are 16 entries;
//   - the weights as bf16 pairs of keys, two parts one after the other, each [nk / 2][Rp] (`weight_pairs`);
//   - scores st [NB][Rp] and outputs ot [Dp][Rp] in fp32, as the vector path keeps them.
#pragma once

#include "vec_math.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define CONVEYOR_AMX 1
#endif

namespace conveyor {

constexpr int64_t kAmxRows = 16;     // rows of a tile
constexpr int64_t kAmxPairs = 16;    // bf16 pairs along a tile's row (64 bytes)
constexpr int64_t amx_head(int64_t D) { return round_up(D, 2 * kAmxPairs); }

#ifdef CONVEYOR_AMX
constexpr bool kAmx = true;

// Linux hands a process the tiles' state only when asked (ARCH_REQ_XCOMP_PERM for XTILEDATA); asked once.
inline bool amx_usable() {
    static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return ok;
}

// Every tile 16 rows of 64 bytes. A constant, so no store to it can be dropped before the load reads it.
struct alignas(64) TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};
inline constexpr TileConfig kTileConfig = {1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64},
                                           {16, 16, 16, 16, 16, 16, 16, 16}};

// The tiles configured for this thread's scope and released after it (oneDNN's kernels on the same
// threads configure their own each time).
struct AmxScope {
    AmxScope() { _tile_loadconfig(&kTileConfig); }
    ~AmxScope() { _tile_release(); }
    AmxScope(const AmxScope&) = delete;
    AmxScope& operator=(const AmxScope&) = delete;
};

// A tile operand: rows `stride` bytes apart; its second tile (of a 2 x 2 block) `next` bytes on, its next
// step along the sum `step` bytes on.
struct TileOperand {
    const char* p;
    int64_t stride, next, step;
};

// A block of M x N output tiles (M, N <= 2) in fp32 at c (rows `stride` bytes apart, tile (m, n) at c + m *
// cm + n * cn floats): loaded (or zero) in tiles 0-3, plus the sum over `steps` of A(m) B(n) (A in tiles
// 4-5, B in 6-7, each loaded once for its two products), stored back. A's steps repeat every `period`
// (B holds two parts of one operand one after the other, both times A).
template <int M, int N>
inline void tile_block(const TileOperand& a, const TileOperand& b, int64_t steps, int64_t period, float* c,
                       int64_t stride, int64_t cm, int64_t cn, bool load) {
    if (load) {
        _tile_loadd(0, c, stride);
        if constexpr (N > 1) _tile_loadd(1, c + cn, stride);
        if constexpr (M > 1) _tile_loadd(2, c + cm, stride);
        if constexpr (M > 1 && N > 1) _tile_loadd(3, c + cm + cn, stride);
    } else {
        _tile_zero(0);
        if constexpr (N > 1) _tile_zero(1);
        if constexpr (M > 1) _tile_zero(2);
        if constexpr (M > 1 && N > 1) _tile_zero(3);
    }
    for (int64_t s = 0, sa = 0; s < steps; ++s, sa = sa + 1 == period ? 0 : sa + 1) {
        _tile_loadd(4, a.p + sa * a.step, a.stride);
        if constexpr (M > 1) _tile_loadd(5, a.p + a.next + sa * a.step, a.stride);
        _tile_loadd(6, b.p + s * b.step, b.stride);
        if constexpr (N > 1) _tile_loadd(7, b.p + b.next + s * b.step, b.stride);
        _tile_dpbf16ps(0, 4, 6);
        if constexpr (N > 1) _tile_dpbf16ps(1, 4, 7);
        if constexpr (M > 1) _tile_dpbf16ps(2, 5, 6);
        if constexpr (M > 1 && N > 1) _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, c, stride);
    if constexpr (N > 1) _tile_stored(1, c + cn, stride);
    if constexpr (M > 1) _tile_stored(2, c + cm, stride);
    if constexpr (M > 1 && N > 1) _tile_stored(3, c + cm + cn, stride);
}

// C [16 mt][16 nt] (+)= A B over `steps` (A's repeating every `period`), in 2 x 2 blocks of tiles (the edges
// in smaller ones): A's tile m at a.p + m * a_tile bytes, B's n at b.p + n * b_tile, C's (m, n) at c + m * cm
// + n * cn floats.
inline void tile_products(TileOperand a, int64_t a_tile, TileOperand b, int64_t b_tile, int64_t mt, int64_t nt,
                          int64_t steps, int64_t period, float* c, int64_t stride, int64_t cm, int64_t cn, bool load) {
    a.next = a_tile, b.next = b_tile;
    for (int64_t m = 0; m < mt; m += 2)
        for (int64_t n = 0; n < nt; n += 2) {
            const TileOperand am{a.p + m * a_tile, a.stride, a.next, a.step};
            const TileOperand bn{b.p + n * b_tile, b.stride, b.next, b.step};
            float* cmn = c + m * cm + n * cn;
            if (m + 1 < mt && n + 1 < nt) tile_block<2, 2>(am, bn, steps, period, cmn, stride, cm, cn, load);
            else if (m + 1 < mt) tile_block<2, 1>(am, bn, steps, period, cmn, stride, cm, cn, load);
            else if (n + 1 < nt) tile_block<1, 2>(am, bn, steps, period, cmn, stride, cm, cn, load);
            else tile_block<1, 1>(am, bn, steps, period, cmn, stride, cm, cn, load);
        }
}

// st[n][rows] = scale * (K row n . the rows' queries) for keys n < round_up(nk, 16), every row tile;
// mx[c] = max(mx[c], row vector c's scores over keys n < nk).
inline void amx_scores(const bf16* kr, int64_t Dp, const uint32_t* qp, int64_t Rp, int64_t nk, float scale, float* st,
                       vecw* mx) {
    const auto* keys = reinterpret_cast<const char*>(kr);
    const auto* queries = reinterpret_cast<const char*>(qp);
    tile_products({keys, Dp * 2, 0, 2 * kAmxPairs * 2}, kAmxRows * Dp * 2,
                  {queries, Rp * 4, 0, kAmxPairs * Rp * 4}, kAmxRows * 4, round_up(nk, kAmxRows) / kAmxRows,
                  Rp / kAmxRows, Dp / (2 * kAmxPairs), Dp / (2 * kAmxPairs), st, Rp * 4, kAmxRows * Rp, kAmxRows,
                  false);
    for (int64_t c = 0; c < Rp / W; ++c) {
        vecw m = mx[c];
        for (int64_t n = 0; n < nk; ++n) {
            const vecw x = loadw(st + n * Rp + c * W) * splat(scale);
            storew(st + n * Rp + c * W, x);
            m = vmax(m, x);
        }
        mx[c] = m;
    }
}

// A weight p as two bf16 parts, p ~ hi + lo: hi rounded from p, lo from what hi leaves (16 bits of p).
inline void split_weight(__m512 p, __m512i& hi, __m512i& lo) {
    hi = _mm512_cvtepu16_epi32(__m256i(_mm512_cvtneps_pbh(p)));
    const __m512 rest = _mm512_sub_ps(p, _mm512_castsi512_ps(_mm512_slli_epi32(hi, 16)));
    lo = _mm512_cvtepu16_epi32(__m256i(_mm512_cvtneps_pbh(rest)));
}

// The weights st [NB][Rp] (fp32) of keys n < nk as bf16 pairs of keys into pp, their high parts first and
// the rest after them (`split_weight`: one bf16 rounding would cost a weight 8 bits), each [nk2 / 2][Rp] (nk2:
// nk rounded up to 32), zero past nk: key 2j in a word's low half, 2j + 1 in its high half.
inline void weight_pairs(const float* st, int64_t Rp, int64_t nk, uint32_t* pp) {
    const int64_t nk2 = round_up(nk, 2 * kAmxPairs);
    uint32_t *hi = pp, *lo = pp + nk2 / 2 * Rp;
    for (int64_t j = 0; j < nk2 / 2; ++j)
        for (int64_t c = 0; c < Rp; c += W) {
            const __m512 p0 = 2 * j < nk ? _mm512_loadu_ps(st + 2 * j * Rp + c) : _mm512_setzero_ps();
            const __m512 p1 = 2 * j + 1 < nk ? _mm512_loadu_ps(st + (2 * j + 1) * Rp + c) : _mm512_setzero_ps();
            __m512i h0, l0, h1, l1;
            split_weight(p0, h0, l0);
            split_weight(p1, h1, l1);
            _mm512_storeu_si512(hi + j * Rp + c, _mm512_or_si512(h0, _mm512_slli_epi32(h1, 16)));
            _mm512_storeu_si512(lo + j * Rp + c, _mm512_or_si512(l0, _mm512_slli_epi32(l1, 16)));
        }
}

// ot[d][rows] += the weights pp (`weight_pairs`, keys < nk: both parts, one pass over the output tiles)
// times V^T vt [Dp][NB], every entry and row tile.
inline void amx_values(const bf16* vt, int64_t Dp, int64_t NB, const uint32_t* pp, int64_t Rp, int64_t nk, float* ot) {
    const auto* values = reinterpret_cast<const char*>(vt);
    const auto* weights = reinterpret_cast<const char*>(pp);
    const int64_t steps = round_up(nk, 2 * kAmxPairs) / (2 * kAmxPairs);
    tile_products({values, NB * 2, 0, 2 * kAmxPairs * 2}, kAmxRows * NB * 2,
                  {weights, Rp * 4, 0, kAmxPairs * Rp * 4}, kAmxRows * 4, Dp / kAmxRows, Rp / kAmxRows,
                  2 * steps, steps, ot, Rp * 4, kAmxRows * Rp, kAmxRows, true);
}
#else
constexpr bool kAmx = false;
inline bool amx_usable() { return false; }
struct AmxScope {};
// Declared for the kernel's discarded branches only.
void amx_scores(const bf16*, int64_t, const uint32_t*, int64_t, int64_t, float, float*, vecw*);
void weight_pairs(const float*, int64_t, int64_t, uint32_t*);
void amx_values(const bf16*, int64_t, int64_t, const uint32_t*, int64_t, int64_t, float*);
#endif

// A block's K rows (rows[n], n < NB) row-major into kr [NB][Dp] and its V rows transposed into vt
// [Dp][NB], bf16, zero past D (only the padding is zeroed: the rows overwrite the rest). The transpose goes
// by 32-bit words: keys 2j and 2j + 1's entry d side by side (word j of vt's row d), W x W words at a time.
inline void amx_block(const bf16* const* krows, const bf16* const* vrows, int64_t D, int64_t NB, bf16* kr, bf16* vt) {
    const int64_t Dp = amx_head(D);
    for (int64_t n = 0; n < NB; ++n) {
        std::memcpy(static_cast<void*>(kr + n * Dp), krows[n], D * sizeof(bf16));
        std::memset(static_cast<void*>(kr + n * Dp + D), 0, (Dp - D) * sizeof(bf16));
    }
    for (int64_t j0 = 0; j0 < NB / 2; j0 += W)
        for (int64_t d0 = 0; d0 < D; d0 += W) {
            const int64_t nd = std::min<int64_t>(W, D - d0);
            const auto entries = [&](const bf16* row) {  // entries d0 .. d0 + nd of a row, widened to words
                hvecw h = {};
                std::memcpy(&h, row + d0, nd == W ? sizeof h : nd * sizeof(bf16));
                return __builtin_convertvector(h, uvecw);
            };
            vecw w[W];
            for (int64_t j = 0; j < W; ++j) {
                const uvecw word = entries(vrows[2 * (j0 + j)]) | entries(vrows[2 * (j0 + j) + 1]) << 16;
                std::memcpy(&w[j], &word, sizeof word);
            }
            transpose(w);
            for (int64_t d = 0; d < nd; ++d) std::memcpy(vt + (d0 + d) * NB + 2 * j0, &w[d], sizeof w[d]);
        }
    std::memset(static_cast<void*>(vt + D * NB), 0, (Dp - D) * NB * sizeof(bf16));
}

}  // namespace conveyor
