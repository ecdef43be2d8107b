// Decode attention for one request's query heads over its cached K/V rows, read from the pages in
// place (fp32, or bf16 widened to fp32; scores, softmax and sums in fp32). Shared by the paged
// decode kernel (paged_attention_cpu.cpp) and the native decode stack (decode_stack_cpu.cpp).
//
// Decode reads every cached K and V row once per step and does little arithmetic on it (at 64 rows
// of ~200 tokens, ~10 MB a layer): its time is the memory's, plus whatever arithmetic the memory
// does not hide. So a request's K rows (then its V rows) are first pulled into L2 by a loop of plain
// loads, a chunk at a time, then used: measured on one core with K/V from DRAM, the memory streams
// such a loop 2-3x faster than the same lines read among the arithmetic (software prefetches, in
// bursts or spread between the heads' work, changed nothing). The arithmetic goes in blocks of W
// positions, whole rows (every kv head asked for, as the pages lay them out): a row's vectors are
// loaded straight into the products (bf16 widened two vectors per load with a shift and a mask:
// even, then odd elements, the order queries are taken in and outputs given back in), scores for
// 8 positions x up to 3 query heads a kv head from each row vector loaded, summed W at a time
// (`group_sums`), and each V row read once into registers for a chunk of its kv head's query heads.
#pragma once

#include "vec_math.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace conveyor {

// A thread's buffers for `attend_request`, reused across calls.
struct DecodeScratch {
    std::vector<float> q, s, o, inv;  // queries (row order, scaled), scores, output sums (row order), 1 / sum
    std::vector<int64_t> slot;        // each position's offset in the cache
    std::vector<char> pad;            // a block of rows copied and zero-padded when D is not a whole number of pairs
};

// Vector j of a row: fp32 in place; bf16 two vectors per 2W values, the even-indexed then the odd.
inline vecw row_vec(const float* p, int j) { return loadw(p + j * W); }
inline vecw row_vec(const bf16* p, int j) {
    uvecw x;
    std::memcpy(&x, p + j / 2 * 2 * W, sizeof x);
    const uvecw w = j % 2 ? x & 0xffff0000u : x << 16;
    vecw v;
    std::memcpy(&v, &w, sizeof v);
    return v;
}
// x[0:D] * scale into row order, zero-padded to J vectors (y), and y * scale back (x).
template <typename T>
inline void to_row_order(const float* x, int64_t D, float scale, float* y, int64_t J) {
    float tmp[2 * W];
    for (int64_t j = 0; j < J; j += 2) {
        const float* src = x + j * W;
        if ((j + 2) * W > D) {  // the last, partial pair
            for (int64_t d = 0; d < 2 * W; ++d) tmp[d] = j * W + d < D ? src[d] : 0.f;
            src = tmp;
        }
        vecw a = loadw(src) * scale, b = loadw(src + W);
        b *= scale;
        if constexpr (std::is_same_v<T, bf16>) deinterleave(a, b, a, b);
        storew(y + j * W, a);
        storew(y + (j + 1) * W, b);
    }
}
template <typename T>
inline void from_row_order(const float* y, int64_t J, float scale, float* x, int64_t D) {
    for (int64_t j = 0; j < J; j += 2) {
        vecw a = loadw(y + j * W) * scale, b = loadw(y + (j + 1) * W);
        b *= scale;
        if constexpr (std::is_same_v<T, bf16>) interleave(a, b, a, b);
        if ((j + 2) * W <= D) {
            storew(x + j * W, a);
            storew(x + (j + 1) * W, b);
        } else {
            float tmp[2 * W];
            storew(tmp, a);
            storew(tmp + W, b);
            for (int64_t d = 0; j * W + d < D; ++d) x[j * W + d] = tmp[d];
        }
    }
}

namespace detail {
constexpr int kRegisters = W == 16 ? 30 : 14;  // vector registers the V pass may hold
constexpr int64_t kChunkBytes = 128 << 10;      // K or V rows pulled into L2 at a time

// f(std::integral_constant<int, n>{}) for a runtime n in [1, N].
template <int N, typename F>
inline void with_count(int64_t n, F&& f) {
    if constexpr (N > 1) {
        if (n < N) return with_count<N - 1>(n, f);
    }
    f(std::integral_constant<int, N>{});
}

template <typename T, int J>
void attend(const float* q, const T* kc, const T* vc, const int64_t* table, int64_t len, int64_t page, int64_t Hkv,
            int64_t D, int64_t G, int64_t h0, int64_t h1, float scale, float cap, DecodeScratch& sc, float* out) {
    constexpr int64_t Dp = J * W;
    constexpr int GB = std::max(1, std::min(8, (kRegisters - J) / J));  // query heads per V chunk
    constexpr int GK = W == 16 ? 3 : 1;  // query heads per score chunk: 8 positions x GK accumulators
    const int64_t nh = h1 - h0, heads = nh * G, lp = round_up(len, W);
    const bool direct = D == Dp;           // rows read in place, else copied into `pad`, zero-padded
    const int64_t hs = direct ? D : Dp;    // a kv head's offset within a row
    sc.slot.resize(len);
    for (int64_t t0 = 0, b = 0; t0 < len; t0 += page, ++b)
        for (int64_t t = t0, first = (table[b] * page - t0) * Hkv * D + h0 * D; t < std::min(len, t0 + page); ++t)
            sc.slot[t] = first + t * Hkv * D;
    sc.q.resize(heads * Dp);
    for (int64_t r = 0; r < heads; ++r) to_row_order<T>(q + r * D, D, scale, sc.q.data() + r * Dp, J);
    sc.s.resize(heads * lp);
    sc.o.assign(heads * Dp, 0.f);
    sc.inv.resize(heads);
    if (!direct) sc.pad.assign(W * nh * Dp * sizeof(T), 0);
    T* pad = reinterpret_cast<T*>(sc.pad.data());

    // Rows are pulled in a chunk at a time by a loop of plain loads, one a line and nothing between
    // them, then used from L2: measured here (one thread, K/V from DRAM), the memory streams such a
    // loop 2-3x faster than the same lines read among the arithmetic, with software prefetches or not.
    const int64_t row_bytes = nh * D * static_cast<int64_t>(sizeof(T));
    const int64_t chunk = std::max<int64_t>(W, kChunkBytes / row_bytes / W * W);  // positions
    const auto touch = [&](const T* base, int64_t t0, int64_t t1) {
        uint32_t x = 0;
        for (int64_t t = t0; t < t1; ++t) {
            const uintptr_t p = reinterpret_cast<uintptr_t>(base + sc.slot[t]);
            for (uintptr_t l = p & ~uintptr_t{63}; l < p + row_bytes; l += 64) x |= *reinterpret_cast<const uint32_t*>(l);
        }
        asm volatile("" : : "r"(x));
    };
    const T* rows[W];
    const auto block = [&](const T* base, int64_t t0, int64_t nb) {  // rows[i]: position t0 + i (the last for i >= nb)
        for (int64_t i = 0; i < W; ++i) {
            const T* src = base + sc.slot[t0 + std::min(i, nb - 1)];
            if (direct) {
                rows[i] = src;
            } else if (i < nb) {
                for (int64_t h = 0; h < nh; ++h) std::copy(src + h * D, src + h * D + D, pad + (i * nh + h) * Dp);
                rows[i] = pad + i * nh * Dp;
            } else {
                rows[i] = rows[nb - 1];
            }
        }
    };
    for (int64_t t0 = 0; t0 < len; t0 += W) {  // scores: W positions x every query head
        if (t0 % chunk == 0) touch(kc, t0, std::min(len, t0 + chunk));
        block(kc, t0, std::min<int64_t>(W, len - t0));
        for (int64_t h = 0; h < nh; ++h)
            for (int64_t g0 = 0; g0 < G; g0 += GK)
                with_count<GK>(std::min<int64_t>(GK, G - g0), [&](auto count) {
                    constexpr int C = decltype(count)::value;
                    const float* qr = sc.q.data() + (h * G + g0) * Dp;
                    vecw part[C][W / 8];
                    for (int group = 0; group < W / 8; ++group) {
                        vecw acc[C][8] = {};
#pragma GCC unroll 8
                        for (int i = 0; i < 8; ++i) {
                            const T* row = rows[sum_lane(group, i)] + h * hs;
#pragma GCC unroll 32
                            for (int j = 0; j < J; ++j) {
                                const vecw k = row_vec(row, j);
#pragma GCC unroll 8
                                for (int c = 0; c < C; ++c) acc[c][i] += loadw(qr + c * Dp + j * W) * k;
                            }
                        }
                        for (int c = 0; c < C; ++c) part[c][group] = group_sums(acc[c]);
                    }
                    for (int c = 0; c < C; ++c)  // lanes past len: padding, never read
                        storew(sc.s.data() + (h * G + g0 + c) * lp + t0, join_groups(part[c]));
                });
    }
    constexpr float inf = std::numeric_limits<float>::infinity();
    for (int64_t r = 0; r < heads; ++r) {  // softmax (its 1 / sum applied to the output)
        float* s = sc.s.data() + r * lp;
        const int64_t full = len / W * W;
        vecw mx = splat(-inf);
        for (int64_t t = 0; t < lp; t += W) {
            vecw x = loadw(s + t);
            if (cap > 0.f) x = vtanh(x / cap) * cap;
            if (t >= full) {  // the last, partial block: its padding lanes out of the max and the sum
                for (int64_t i = len - t; i < W; ++i) x[i] = -inf;
            }
            storew(s + t, x);
            mx = vmax(mx, x);
        }
        const vecw m = splat(lane_max(mx));
        vecw sum = {};
        for (int64_t t = 0; t < lp; t += W) {
            vecw e = vexp(loadw(s + t) - m);
            if (t >= full) {
                for (int64_t i = len - t; i < W; ++i) e[i] = 0.f;
            }
            storew(s + t, e);
            sum += e;
        }
        sc.inv[r] = 1.f / lane_sum(sum);
    }
    for (int64_t t0 = 0; t0 < len; t0 += W) {  // weighted sums of the V rows
        const int64_t nb = std::min<int64_t>(W, len - t0);
        if (t0 % chunk == 0) touch(vc, t0, std::min(len, t0 + chunk));
        block(vc, t0, nb);
        for (int64_t h = 0; h < nh; ++h)
            for (int64_t g0 = 0; g0 < G; g0 += GB)
                with_count<GB>(std::min<int64_t>(GB, G - g0), [&](auto count) {
                    constexpr int C = decltype(count)::value;
                    const int64_t r0 = h * G + g0;
                    vecw a[C][J];
                    for (int c = 0; c < C; ++c)
                        for (int j = 0; j < J; ++j) a[c][j] = loadw(sc.o.data() + (r0 + c) * Dp + j * W);
                    for (int64_t i = 0; i < nb; ++i) {
                        vecw v[J];
#pragma GCC unroll 32
                        for (int j = 0; j < J; ++j) v[j] = row_vec(rows[i] + h * hs, j);
#pragma GCC unroll 8
                        for (int c = 0; c < C; ++c) {
                            const vecw p = splat(sc.s[(r0 + c) * lp + t0 + i]);
#pragma GCC unroll 32
                            for (int j = 0; j < J; ++j) a[c][j] += p * v[j];
                        }
                    }
                    for (int c = 0; c < C; ++c)
                        for (int j = 0; j < J; ++j) storew(sc.o.data() + (r0 + c) * Dp + j * W, a[c][j]);
                });
    }
    for (int64_t r = 0; r < heads; ++r) from_row_order<T>(sc.o.data() + r * Dp, J, sc.inv[r], out + r * D, D);
}
}  // namespace detail

// The largest head dim `attend_request` takes: 32 vectors a row.
constexpr int64_t kMaxDecodeHeadDim = 32 * W;

// Attention of one request's kv heads [h0, h1), each with its G query heads (q and out: fp32
// [(h1 - h0) * G, D], contiguous), over its first `len` cached positions: pages of `page` slots
// listed in `table`, rows of Hkv * D values (K at kc, V at vc). `cap` > 0 soft-caps the scores as
// Gemma 2 does (tanh(s / cap) * cap). D <= kMaxDecodeHeadDim.
template <typename T>
void attend_request(const float* q, const T* kc, const T* vc, const int64_t* table, int64_t len, int64_t page,
                    int64_t Hkv, int64_t D, int64_t G, int64_t h0, int64_t h1, float scale, float cap, DecodeScratch& sc,
                    float* out) {
    const int64_t pairs = (D + 2 * W - 1) / (2 * W);  // J = 2 * pairs vectors a row, rounded up below
    const auto run = [&](auto j) {
        detail::attend<T, decltype(j)::value>(q, kc, vc, table, len, page, Hkv, D, G, h0, h1, scale, cap, sc, out);
    };
    if (pairs <= 1) run(std::integral_constant<int, 2>{});
    else if (pairs <= 2) run(std::integral_constant<int, 4>{});
    else if (pairs <= 3) run(std::integral_constant<int, 6>{});
    else if (pairs <= 4) run(std::integral_constant<int, 8>{});
    else if (pairs <= 6) run(std::integral_constant<int, 12>{});
    else if (pairs <= 8) run(std::integral_constant<int, 16>{});
    else if (pairs <= 12) run(std::integral_constant<int, 24>{});
    else run(std::integral_constant<int, 32>{});
}

}  // namespace conveyor
