// Prefill attention's two products on AMX tiles (prefill_attention_cpu.cpp, bf16 queries over a bf16
// cache, where the CPU has AMX-BF16 and the caller allows it): the scores of 16 keys x 16 query rows
// and the weighted sums of 16 head-dim entries x 16 rows per tile instruction, instead of one row
// vector a key at a time. The tiles sum in their own order, and the weights enter the sums rounded to
// bf16 (as FlashAttention's), so a query's output is no longer the decode kernel's bits: the caller
// takes this path only where batch invariance is not asked for (models/batch_invariance.py), as the
// linears' oneDNN path on the same CPUs.
//
// Layouts (row tiles of 16 query rows: Rp is a multiple of 16):
//   - a block's K rows row-major, [NB][Dp] bf16 (Dp: D rounded up to 32, zero past D; zero rows for
//     missing keys): a tile's rows are 16 keys;
//   - the queries as bf16 pairs [Dp / 2][Rp] (`query_pairs`, zero past D): a tile's rows are pairs;
//   - a block's V transposed, [Dp][NB] bf16 (zero for missing keys): a tile's rows are 16 entries;
//   - the weights as bf16 pairs of keys [NB / 2][Rp] (`weight_pairs`);
//   - scores st [NB][Rp] and outputs ot [Dp][Rp] in fp32, as the vector path keeps them.
#pragma once

#include "vec_math.h"

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

// st[n][rows] = scale * (K row n . the rows' queries) for keys n < round_up(nk, 16), every row tile;
// mx[c] = max(mx[c], row vector c's scores over keys n < nk).
inline void amx_scores(const bf16* kr, int64_t Dp, const uint32_t* qp, int64_t Rp, int64_t nk, float scale, float* st,
                       vecw* mx) {
    for (int64_t n = 0; n < nk; n += kAmxRows)
        for (int64_t c = 0; c < Rp; c += kAmxRows) {
            _tile_zero(0);
            for (int64_t j = 0; j < Dp; j += 2 * kAmxPairs) {
                _tile_loadd(1, kr + n * Dp + j, Dp * sizeof(bf16));
                _tile_loadd(2, qp + j / 2 * Rp + c, Rp * sizeof(uint32_t));
                _tile_dpbf16ps(0, 1, 2);
            }
            _tile_stored(0, st + n * Rp + c, Rp * sizeof(float));
        }
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

// The weights st [NB][Rp] (fp32) of keys n < nk as bf16 pairs of keys, pp [nk2 / 2][Rp] (nk2: nk rounded
// up to 32), zero past nk: key 2j in a word's low half, 2j + 1 in its high half.
inline void weight_pairs(const float* st, int64_t Rp, int64_t nk, uint32_t* pp) {
    const int64_t nk2 = round_up(nk, 2 * kAmxPairs);
    for (int64_t j = 0; j < nk2 / 2; ++j)
        for (int64_t c = 0; c < Rp; c += W) {
            const __m512 p0 = 2 * j < nk ? _mm512_loadu_ps(st + 2 * j * Rp + c) : _mm512_setzero_ps();
            const __m512 p1 = 2 * j + 1 < nk ? _mm512_loadu_ps(st + (2 * j + 1) * Rp + c) : _mm512_setzero_ps();
            const __m512i lo = _mm512_cvtepu16_epi32(__m256i(_mm512_cvtneps_pbh(p0)));
            const __m512i hi = _mm512_cvtepu16_epi32(__m256i(_mm512_cvtneps_pbh(p1)));
            _mm512_storeu_si512(pp + j * Rp + c, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
}

// ot[d][rows] += the weights pp (`weight_pairs`, keys < nk) times V^T vt [Dp][NB], every entry and row tile.
inline void amx_values(const bf16* vt, int64_t Dp, int64_t NB, const uint32_t* pp, int64_t Rp, int64_t nk, float* ot) {
    const int64_t nk2 = round_up(nk, 2 * kAmxPairs);
    for (int64_t d = 0; d < Dp; d += kAmxRows)
        for (int64_t c = 0; c < Rp; c += kAmxRows) {
            _tile_loadd(0, ot + d * Rp + c, Rp * sizeof(float));
            for (int64_t j = 0; j < nk2; j += 2 * kAmxPairs) {
                _tile_loadd(1, vt + d * NB + j, NB * sizeof(bf16));
                _tile_loadd(2, pp + j / 2 * Rp + c, Rp * sizeof(uint32_t));
                _tile_dpbf16ps(0, 1, 2);
            }
            _tile_stored(0, ot + d * Rp + c, Rp * sizeof(float));
        }
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
// [Dp][NB], bf16, zero past D.
inline void amx_block(const bf16* const* krows, const bf16* const* vrows, int64_t D, int64_t NB, bf16* kr, bf16* vt) {
    const int64_t Dp = amx_head(D);
    std::memset(static_cast<void*>(kr), 0, NB * Dp * sizeof(bf16));
    std::memset(static_cast<void*>(vt), 0, Dp * NB * sizeof(bf16));
    for (int64_t n = 0; n < NB; ++n) {
        std::memcpy(static_cast<void*>(kr + n * Dp), krows[n], D * sizeof(bf16));
        for (int64_t d = 0; d < D; ++d) vt[d * NB + n] = vrows[n][d];
    }
}

}  // namespace conveyor
