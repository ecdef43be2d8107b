// Decode attention for one request's query heads over its cached K/V rows, read from the pages in
// place (fp32, bf16 or int8 rows; scores, softmax and sums in fp32). Shared by the paged
// decode kernel (paged_attention_cpu.cpp) and the native decode stack (decode_stack_cpu.cpp).
//
// Its arithmetic is attention_blocks.h's, the prefill kernel's: keys in blocks of absolute positions,
// each score one multiply-add chain down the head dim, the online softmax folded block by block, so a
// token decoded here gets the bits a prefill chunk would give it. W keys at a time are turned by
// head-dim entry in registers (`key_columns`), so their scores come out along the vector lanes, one
// broadcast query element per step; where AVX512-BF16 runs, bf16 keys are turned as 32-bit pairs of
// entries (`key_pairs`) for one vdpbf16ps per pair and query head; int8 keys are turned four bytes
// at a time (`key_quads`) into integer dot products with the quantized query, one VNNI vpdpbusd per
// quad and query head. The V rows are summed along the head dim, a broadcast probability per key;
// int8 V rows two keys at a time (`value_pairs`: sign-extended and interleaved into 16-bit pairs)
// into integer sums with the weights p * s_v rounded to 15-bit integers, one vpdpwssd per pair, vector
// and query head.
//
// The paged decode kernel gives each thread a run of (request, kv head) pairs, so one long request
// uses every thread (and the decode stack does the same with fewer rows than threads); each pair's
// arithmetic is the same whichever thread runs it. The context itself is not split across threads:
// a flash-decoding split would combine partial softmaxes in an order prefill does not have.
//
// Decode reads every cached K and V row once per step and does little arithmetic on it: its time is
// the memory's, plus whatever arithmetic the memory does not hide. So the memory streams while the
// arithmetic runs: each position's K and V rows are prefetched into L2 (prefetcht2) kPrefetchBlocks
// key blocks ahead, a row (a few cache lines) every so many multiply-adds of the scores and the value
// sums (`RowStream`), so that the prefetches never queue up in a burst (a burst of a block's rows fills
// the core's miss buffers and the prefetch instruction itself then waits). A thread's next run
// (`DecodeScratch::next`) is prefetched the same way during this one's last blocks: a batch of short
// requests streams as one long one instead of starting each on a cold cache. docs/benchmarks.md has
// the measurements.
#pragma once

#include "attention_blocks.h"
#include "int8_values.h"
#include "vec_math.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace conveyor {

// A run of a request's kv heads as a thread attends it: its block table, length, first position, ring
// (0: none) and first kv head. Equal runs are the same run.
struct DecodeRun {
    const int64_t* table = nullptr;
    int64_t len = 0, first = 0, ring = 0, h0 = 0;
    bool operator==(const DecodeRun&) const = default;
};

// A thread's buffers for `attend_request`, reused across calls.
struct DecodeScratch {
    // Set by the caller before each call: the run this thread attends next in the same cache (none:
    // table nullptr). Its first positions are prefetched during this run's last blocks, so that a short
    // request does not start on a cold cache (`warm`: the run announced last time and how many of its
    // first positions were prefetched).
    DecodeRun next;
    DecodeRun announced;
    int64_t warm = 0;
    std::vector<float> q, o, p, m, l;  // scaled queries, output sums, a block's probabilities, max, sum
    std::vector<uint32_t> qp;           // bf16 keys: the queries as bf16 pairs (unscaled)
    std::vector<int32_t> qi, qsum;      // int8 keys: the queries quantized (`quantize_query`), their sums
    std::vector<float> qs;              // and scales
    std::vector<uint16_t> u;            // int8 values: a block's weights per query head (`weight_levels`)
    std::vector<float> sw;              // and their sums' scales
    std::vector<int64_t> slot;          // each visible position's row offset in the cache
    std::vector<char> zero;             // a zero K row (lanes without a key)
};

namespace detail {
constexpr int kRegisters = W == 16 ? 30 : 14;  // vector registers the products may hold
constexpr int64_t kPrefetchBlocks = 2;          // how far ahead K and V rows are prefetched, in key blocks

// f(std::integral_constant<int, n>{}) for a runtime n in [1, N].
template <int N, typename F>
inline void with_count(int64_t n, F&& f) {
    if constexpr (N > 1) {
        if (n < N) return with_count<N - 1>(n, f);
    }
    f(std::integral_constant<int, N>{});
}

// How a V row's J vectors are read: straight (fp32 rows, or a head dim that is not a whole number of
// vector pairs), or, for bf16, as pairs: vector 2k holds the even entries of values [2kW, 2(k+1)W),
// 2k + 1 the odd ones (one load, a shift and a mask for two vectors).
template <typename T>
constexpr bool kPairs = std::is_same_v<T, bf16>;

template <bool Pairs, bool Full, typename T, int J>
inline void value_vectors(const T* row, int64_t D, vecw* v) {
    if constexpr (Pairs) {
        for (int k = 0; k < J / 2; ++k) split_bf16_pairs(row + 2 * k * W, v[2 * k], v[2 * k + 1]);
    } else {
        for (int j = 0; j < J; ++j) {
            if (Full || (j + 1) * W <= D) {
                v[j] = loadw(row + j * W);
            } else {
                float tmp[W] = {};
                for (int64_t d = j * W; d < D; ++d) tmp[d - j * W] = to_float(row[d]);
                v[j] = loadw(tmp);
            }
        }
    }
}

// One block for C query heads: head c's scores s[c] (NV vectors; lanes [lo, hi) hold keys, the rest
// none) folded into its running max m[c] and sum l[c], its output o + c * Dp (J vectors) rescaled if m[c]
// moved; p + c * kKeyBlock gets its probabilities (exactly 0 where no key). The order of every operation
// is attention_blocks.h's, head by head; the heads go through each stage together, so that their
// chains (the max across lanes, the exponentials, the sum) overlap instead of running one after another.
// J is a loop bound, not a template argument: the scores need not be compiled once per head dim.
template <int NV, int C>
inline void block_softmax(vecw (*s)[NV], int64_t lo, int64_t hi, float cap, float* m, float* l, float* o, int64_t Dp,
                          int64_t J, float* p) {
    ivecw lane;
    for (int i = 0; i < W; ++i) lane[i] = i;
    ivecw key[NV];
    for (int v = 0; v < NV; ++v)
        key[v] = (lane + v * W >= static_cast<int32_t>(lo)) & (lane + v * W < static_cast<int32_t>(hi));
    float m1[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
        vecw mx = splat(kMasked);
        for (int v = 0; v < NV; ++v) {
            vecw x = s[c][v];
            if (cap > 0.f) x = vtanh(x / cap) * cap;
            s[c][v] = select(key[v], x, splat(kMasked));
            mx = vmax(mx, s[c][v]);
        }
        m1[c] = std::max(lane_max(mx), m[c]);
    }
    float sum[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
        vecw e[NV];
        for (int v = 0; v < NV; ++v) {
            e[v] = select(key[v], vexp(s[c][v] - m1[c]), vecw{});
            storew(p + c * kKeyBlock + v * W, e[v]);
        }
        sum[c] = block_sum<NV>(e);
    }
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
        if (m1[c] > m[c]) {
            const float alpha = vexp(splat(m[c] - m1[c]))[0];
            l[c] = fmadd(l[c], alpha, sum[c]);
            m[c] = m1[c];
            for (int64_t j = 0; j < J; ++j) storew(o + c * Dp + j * W, loadw(o + c * Dp + j * W) * alpha);
        } else {
            l[c] = l[c] + sum[c];
        }
    }
}

// o[c] = fmadd(p[c][i], v_i, o[c]) for key lanes i in [lo, hi) in order, C query heads at once (o: [C][J * W],
// as `value_vectors` lays a row out; p: [C][kKeyBlock]); v_i is rows[i] + offset (D values, widened;
// int8 rows: p already times the row's scale, attention_blocks.h).
// `each_key(i)` runs before key i's products (the caller's prefetches, spread through the arithmetic).
template <bool Pairs, bool Full, typename T, int C, int J, typename F>
inline void block_values(const T* const* rows, int64_t offset, int64_t lo, int64_t hi, int64_t D, const float* p,
                         float* o, F&& each_key) {
    vecw a[C][J];
    for (int c = 0; c < C; ++c)
        for (int j = 0; j < J; ++j) a[c][j] = loadw(o + (c * J + j) * W);
    for (int64_t i = lo; i < hi; ++i) {
        each_key(i);
        vecw v[J];
        value_vectors<Pairs, Full, T, J>(rows[i] + offset, D, v);
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) {
            const vecw x = splat(p[c * kKeyBlock + i]);
#pragma GCC unroll 32
            for (int j = 0; j < J; ++j) a[c][j] = fmadd(x, v[j], a[c][j]);
        }
    }
    for (int c = 0; c < C; ++c)
        for (int j = 0; j < J; ++j) storew(o + (c * J + j) * W, a[c][j]);
}

// The K and V rows of the positions ahead, prefetched into L2 (prefetcht2) a row at a time at the pace
// of the arithmetic: `pace(macs)` after each W keys' scores and each key's value sums issues the rows
// those multiply-adds are worth, so that the prefetches in flight stay level. (Issued a
// position at a time during the value sums only, they came in bursts that filled the core's miss
// buffers: the prefetch instructions themselves then waited, and the memory's time added to the
// arithmetic's instead of hiding under it. A line at a time, the bookkeeping cost more than the
// bursts of a row's few lines: docs/benchmarks.md.)
struct RowStream {
    const char *k, *v;     // the K and V caches
    const int64_t* slot;   // each position's row offset, in elements of `elem` bytes
    int64_t elem, row_bytes;
    int64_t pos = 0, limit = 0;  // the next position whose rows are fetched; none from `limit` on
    int64_t num = 0, den = 1, credit = 0;  // rows per multiply-add: num / den
    bool in_v = false;                     // the next row is pos's V row (else its K row)

    __attribute__((always_inline)) inline void one() {  // the next row's lines
        if (pos >= limit) return;
        const uintptr_t p = reinterpret_cast<uintptr_t>((in_v ? v : k) + slot[pos] * elem);
        for (uintptr_t a = p & ~uintptr_t{63}; a < p + row_bytes; a += 64)
            __builtin_prefetch(reinterpret_cast<const void*>(a), 0, 1);
        if (in_v) ++pos;
        in_v = !in_v;
    }
    __attribute__((always_inline)) inline void pace(int64_t macs) {
        if (pos >= limit) return;
        for (credit += macs * num; credit >= den; credit -= den) one();
    }
    // Everything before position p (at most the limit) fetched: what the pace left behind.
    void until(int64_t p) {
        while (pos < std::min(p, limit)) one();
    }
};

// Each of the first n positions' row offset in the cache (rows of `row` values, head rows of Dr) for
// `run`: position first + t at slot index first + t (or its remainder by the ring), its kv head h0's row.
inline void slot_offsets(const DecodeRun& run, int64_t n, int64_t page, int64_t row, int64_t Dr, int64_t* out) {
    int64_t i = run.ring > 0 ? run.first % run.ring : run.first, b = i / page, o = i % page;
    for (int64_t t = 0; t < n; ++t) {
        out[t] = (run.table[b] * page + o) * row + run.h0 * Dr;
        if (++i == run.ring) i = b = o = 0;  // the ring wraps around
        else if (++o == page) o = 0, ++b;
    }
}

constexpr int GK = W == 16 ? 8 : 4;  // query heads per pass over K rows

// A query's form for int8 keys (attention_blocks.h): values as quads (nq words a head), sums, scales.
struct Int8Query {
    const int32_t* values;
    int64_t nq;
    const int32_t* sums;
    const float* scales;
};

// Queries over bf16 keys: each head's bf16 pairs (np apart), unscaled, and the scale for the scores.
struct PairQuery {
    const uint32_t* pairs;
    int64_t np;
    float scale;
};

// One block's scores for `count` (<= GK) query heads of one kv head (queries q, Dp apart; K rows
// krows[i] + offset), W keys turned by head-dim entry at a time into the chains (int8 keys: by quads
// into `dot_quads` with the quantized queries qi, then `int8_scores`; bf16 keys: by pairs into
// `dot_bf16_pairs` with the queries' pairs qp, then the scale), then the heads'
// `block_softmax` together (each its running max m, sum l, output o of J vectors, Dp apart, probabilities p,
// kKeyBlock apart). Not inlined and not per head dim: compiled once per cache dtype.
template <typename T>
__attribute__((noinline)) void score_heads(const T* const* krows, int64_t offset, int64_t D, const float* q, int64_t Dp,
                                           Int8Query qi, PairQuery qp, int64_t count, int64_t nv, int64_t lo, int64_t hi,
                                           float cap, float* m, float* l, float* o, int64_t J, float* p, RowStream& pf) {
    with_count<kBlockVectors>(nv, [&](auto nvc) {
        constexpr int NV = decltype(nvc)::value;
        with_count<GK>(count, [&](auto cc) {
            constexpr int C = decltype(cc)::value;
            vecw s[C][NV];
            for (int v = 0; v < NV; ++v) {
                if constexpr (kScaled<T>) {  // int8 keys: integer dot products, times the two scales
                    ivecw acc[C] = {};
                    key_quads(krows + v * W, offset, qi.nq, [&](int64_t j, ivecw k) {
#pragma GCC unroll 8
                        for (int c = 0; c < C; ++c) acc[c] = dot_quads(acc[c], k, splat_i(qi.values[c * qi.nq + j]));
                    });
                    pf.pace(C * W * D);
                    float scales[W];
                    for (int i = 0; i < W; ++i) scales[i] = row_scale(krows[v * W + i] + offset, D);
                    for (int c = 0; c < C; ++c)
                        s[c][v] = int8_scores(acc[c], splat_i(qi.sums[c]), splat(qi.scales[c]) * loadw(scales));
                } else if constexpr (kBf16Pairs<T>) {  // bf16 keys: chains over pairs, then the scale
                    vecw acc[C] = {};
                    key_pairs(krows + v * W, offset, D, [&](int64_t j, uvecw k) {
#pragma GCC unroll 8
                        for (int c = 0; c < C; ++c) acc[c] = dot_bf16_pairs(acc[c], k, qp.pairs[c * qp.np + j]);
                    });
                    pf.pace(C * W * D);
                    for (int c = 0; c < C; ++c) s[c][v] = acc[c] * splat(qp.scale);
                } else {
                    vecw acc[C] = {};
                    key_columns(krows + v * W, offset, D, [&](int64_t d, vecw k) {
#pragma GCC unroll 8
                        for (int c = 0; c < C; ++c) acc[c] = fmadd(splat(q[c * Dp + d]), k, acc[c]);
                    });
                    pf.pace(C * W * D);  // after the turn, not in it: there it kept `key_columns` from inlining
                    for (int c = 0; c < C; ++c) s[c][v] = acc[c];
                }
            }
            block_softmax<NV, C>(s, lo, hi, cap, m, l, o, Dp, J, p);
        });
    });
}

template <typename T, int J>
void attend(const float* q, const T* kc, const T* vc, const int64_t* table, int64_t len, int64_t first, int64_t ring,
            int64_t page, int64_t Hkv, int64_t D, int64_t G, int64_t h0, int64_t h1, float scale, float cap,
            const float* sinks, DecodeScratch& sc, float* out) {
    constexpr int64_t Dp = J * W;
    constexpr int GV = std::max(1, std::min(8, (kRegisters - J) / J));  // query heads per pass over V rows
    constexpr int GQ = W == 16 ? 4 : 2;  // the same over int8 V rows (4 sums a head, 4 value pairs)
    const int64_t nh = h1 - h0, heads = nh * G;
    const bool pairs = kPairs<T> && D == Dp && J % 2 == 0;
    const int64_t Dr = head_row<T>(D);  // a head's row in the cache (int8: its scale after the values)
    // Row offsets of this run's positions, then of the next run's first `ahead` (prefetched only).
    constexpr int64_t ahead = kPrefetchBlocks * kKeyBlock;  // positions
    const DecodeRun run{table, len, first, ring, h0};
    const int64_t extra = sc.next.table ? std::min(ahead, sc.next.len) : 0, npf = len + extra;
    sc.slot.resize(npf);
    slot_offsets(run, len, page, Hkv * Dr, Dr, sc.slot.data());
    if (extra > 0) slot_offsets(sc.next, extra, page, Hkv * Dr, Dr, sc.slot.data() + len);
    const int64_t np = kBf16Pairs<T> ? bf16_pairs(D) : 0;
    if constexpr (kBf16Pairs<T>) {  // the queries as unscaled bf16 pairs (the scaled fp32 ones go unread)
        sc.q.resize(heads * Dp);
        sc.qp.resize(heads * np);
        for (int64_t r = 0; r < heads; ++r) query_pairs(q + r * D, D, sc.qp.data() + r * np, 1);
    } else {  // the queries scaled, in fp32 (int8 keys: what `quantize_query` takes)
        sc.q.assign(heads * Dp, 0.f);
        for (int64_t r = 0; r < heads; ++r)
            for (int64_t d = 0; d < D; ++d) sc.q[r * Dp + d] = q[r * D + d] * scale;
    }
    const int64_t nq = kScaled<T> ? quads(D) : 0;
    if constexpr (kScaled<T>) {
        sc.qi.resize(heads * nq), sc.qsum.resize(heads), sc.qs.resize(heads);
        for (int64_t r = 0; r < heads; ++r)
            sc.qsum[r] = quantize_query(sc.q.data() + r * Dp, D, sc.qi.data() + r * nq, sc.qs[r]);
    }
    sc.o.assign(heads * Dp, 0.f);
    sc.m.resize(heads);
    sc.l.resize(heads);
    for (int64_t r = 0; r < heads; ++r) start_row(sinks ? sinks + h0 * G + r : nullptr, sc.m[r], sc.l[r]);
    sc.p.resize(heads * kKeyBlock);
    if constexpr (kScaled<T>) sc.u.resize(heads * kKeyBlock), sc.sw.resize(heads);
    sc.zero.assign((nh * Dr + Dp) * sizeof(T), 0);  // zero values (and scales) for every head's read
    const T* zero = reinterpret_cast<const T*>(sc.zero.data());

    // The memory streams while the arithmetic runs: rows are prefetched into L2 kPrefetchBlocks blocks
    // ahead, a row at a time at the arithmetic's pace (`RowStream`: a block's K and V rows over its
    // multiply-adds, 2 x G x D a key and kv head), each kv head's share of the block's positions made up
    // after its pass; past this run's end, the next run's (as many kv heads' rows as this run's).
    // Positions [0, ahead) are fetched at the start, but for those the last call did, if it announced this run.
    const int64_t row_bytes = nh * Dr * static_cast<int64_t>(sizeof(T));
    RowStream pf{reinterpret_cast<const char*>(kc), reinterpret_cast<const char*>(vc), sc.slot.data(),
                 static_cast<int64_t>(sizeof(T)), row_bytes};
    pf.limit = std::min(npf, ahead);
    pf.pos = sc.announced == run ? std::min(sc.warm, pf.limit) : 0;
    pf.until(pf.limit);  // the first blocks' rows at once: nothing computes before them
    pf.num = 2;  // a position's rows, K and V
    pf.den = 2 * nh * G * D;            // its multiply-adds
    const T *krows[kKeyBlock], *vrows[kKeyBlock];
    for (int64_t t0 = 0; t0 < len;) {
        // A block: positions [p0, p0 + kKeyBlock); its lanes [lo, hi) hold positions first + t0, ...
        const int64_t p0 = block_start(first + t0), lo = first + t0 - p0, hi = std::min(kKeyBlock, first + len - p0);
        const int64_t t1 = t0 + hi - lo;
        for (int64_t n = 0; n < kKeyBlock; ++n) {  // each lane's rows, kv head h0's (zero rows where no key)
            const bool key = n >= lo && n < hi;
            krows[n] = key ? kc + sc.slot[t0 + n - lo] : zero;
            vrows[n] = key ? vc + sc.slot[t0 + n - lo] : zero;
        }
        const int64_t nv = (hi + W - 1) / W;
        pf.limit = std::min(npf, t1 + ahead);
        for (int64_t h = 0; h < nh; ++h) {
            for (int64_t g0 = 0; g0 < G; g0 += GK) {
                const int64_t r = h * G + g0;
                const Int8Query qi{sc.qi.data() + r * nq, nq, sc.qsum.data() + r, sc.qs.data() + r};
                const PairQuery qp{sc.qp.data() + r * np, np, scale};
                score_heads(krows, h * Dr, D, sc.q.data() + r * Dp, Dp, qi, qp, std::min<int64_t>(GK, G - g0), nv, lo,
                            hi, cap, sc.m.data() + r, sc.l.data() + r, sc.o.data() + r * Dp, J,
                            sc.p.data() + r * kKeyBlock, pf);
            }
            if constexpr (kScaled<T>) {  // int8 V rows: integer sums, the weights p * s_v as integers
                alignas(64) float vs[kKeyBlock];
                for (int64_t n = 0; n < kKeyBlock; ++n) vs[n] = row_scale(vrows[n] + h * Dr, D);
                for (int64_t r = h * G; r < (h + 1) * G; ++r) {
                    const float* pr = sc.p.data() + r * kKeyBlock;
                    vecw w[kBlockVectors], wmax = {};
                    for (int64_t v = 0; v < nv; ++v) wmax = vmax(wmax, w[v] = loadw(pr + v * W) * loadw(vs + v * W));
                    const float top = lane_max(wmax);
                    const vecw inv = splat(weight_inverse(top));
                    sc.sw[r] = weight_scale(top);
                    for (int64_t v = 0; v < nv; ++v) {
                        const auto levels = __builtin_convertvector(weight_levels(w[v], inv), hvecw);
                        std::memcpy(sc.u.data() + r * kKeyBlock + v * W, &levels, sizeof levels);
                    }
                }
                for (int64_t g0 = 0; g0 < G; g0 += GQ)
                    with_count<GQ>(std::min<int64_t>(GQ, G - g0), [&](auto count) {
                        constexpr int C = decltype(count)::value;
                        const int64_t r0 = h * G + g0;
                        const auto each_key = [&pf, macs = C * D](int64_t) { pf.pace(macs); };
                        const uint16_t* u = sc.u.data() + r0 * kKeyBlock;
                        if (D % (4 * W) == 0)
                            value_pair_sums<true, C>(vrows, h * Dr, lo, hi, D, Dp, u, sc.sw.data() + r0, sc.o.data() + r0 * Dp, each_key);
                        else
                            value_pair_sums<false, C>(vrows, h * Dr, lo, hi, D, Dp, u, sc.sw.data() + r0, sc.o.data() + r0 * Dp, each_key);
                    });
            } else {
                for (int64_t g0 = 0; g0 < G; g0 += GV)
                    with_count<GV>(std::min<int64_t>(GV, G - g0), [&](auto count) {
                        constexpr int C = decltype(count)::value;
                        const int64_t r0 = h * G + g0;
                        const auto each_key = [&pf, macs = C * D](int64_t) { pf.pace(macs); };
                        const float* pr = sc.p.data() + r0 * kKeyBlock;
                        float* orow = sc.o.data() + r0 * Dp;
                        if (pairs) block_values<kPairs<T>, true, T, C, J>(vrows, h * Dr, lo, hi, D, pr, orow, each_key);
                        else if (D == Dp) block_values<false, true, T, C, J>(vrows, h * Dr, lo, hi, D, pr, orow, each_key);
                        else block_values<false, false, T, C, J>(vrows, h * Dr, lo, hi, D, pr, orow, each_key);
                    });
            }
            pf.until(t0 + ahead + (h + 1) * (hi - lo) / nh);
        }
        t0 = t1;
    }
    sc.announced = sc.next;
    sc.warm = std::max<int64_t>(0, pf.pos - len);
    for (int64_t r = 0; r < heads; ++r) {
        const float inv = 1.f / sc.l[r];
        const float* o_r = sc.o.data() + r * Dp;
        for (int64_t d = 0; d < D; ++d) {  // entry d of the row sits where `value_vectors` put it
            const int64_t at = kScaled<T> ? pair_entry(d) : pairs ? (d / (2 * W) * 2 + d % 2) * W + d % (2 * W) / 2 : d;
            out[r * D + d] = o_r[at] * inv;
        }
    }
}
}  // namespace detail

// The largest head dim `attend_request` takes: 32 vectors a row.
constexpr int64_t kMaxDecodeHeadDim = 32 * W;

// Attention of one request's kv heads [h0, h1), each with its G query heads (q and out: fp32
// [(h1 - h0) * G, D], contiguous), over `len` cached positions first, first + 1, ...: position p at
// slot index p (or p % ring for a sliding window's ring of `ring` slots; ring 0: no ring) of the
// pages of `page` slots listed in `table`, rows of Hkv head rows (K at kc, V at vc; a head row is D
// values, int8 ones followed by their scale: attention_blocks.h). `cap` > 0
// soft-caps the scores as Gemma 2 does (tanh(s / cap) * cap). `sinks` (nullptr: none): one attention
// sink logit per query head of the model (all H of them, not just [h0 * G, h1 * G)), attention_blocks.h.
// D <= kMaxDecodeHeadDim.
template <typename T>
void attend_request(const float* q, const T* kc, const T* vc, const int64_t* table, int64_t len, int64_t first,
                    int64_t ring, int64_t page, int64_t Hkv, int64_t D, int64_t G, int64_t h0, int64_t h1, float scale,
                    float cap, const float* sinks, DecodeScratch& sc, float* out) {
    const int64_t vectors = (D + W - 1) / W;
    const auto run = [&](auto j) {
        detail::attend<T, decltype(j)::value>(q, kc, vc, table, len, first, ring, page, Hkv, D, G, h0, h1, scale, cap,
                                              sinks, sc, out);
    };
    if constexpr (!kScaled<T>) {  // int8: whole groups of four vectors (`value_pairs`)
        if (vectors <= 1) return run(std::integral_constant<int, 1>{});
        if (vectors <= 2) return run(std::integral_constant<int, 2>{});
        if (vectors <= 3) return run(std::integral_constant<int, 3>{});
        if (vectors > 4 && vectors <= 6) return run(std::integral_constant<int, 6>{});
    }
    if (vectors <= 4) run(std::integral_constant<int, 4>{});
    else if (vectors <= 8) run(std::integral_constant<int, 8>{});
    else if (vectors <= 12) run(std::integral_constant<int, 12>{});
    else if (vectors <= 16) run(std::integral_constant<int, 16>{});
    else if (vectors <= 24) run(std::integral_constant<int, 24>{});
    else run(std::integral_constant<int, 32>{});
}

// Compiled once per cache dtype, in decode_attention_{f32,bf16,i8}.cpp (the paged
// decode kernel and the decode stack call the same code; each instantiation takes seconds to compile).
extern template void attend_request<float>(const float* q, const float* kc, const float* vc, const int64_t* table, int64_t len,
                                   int64_t first, int64_t ring, int64_t page, int64_t Hkv, int64_t D, int64_t G,
                                   int64_t h0, int64_t h1, float scale, float cap, const float* sinks,
                                   DecodeScratch& sc, float* out);
extern template void attend_request<bf16>(const float* q, const bf16* kc, const bf16* vc, const int64_t* table, int64_t len,
                                   int64_t first, int64_t ring, int64_t page, int64_t Hkv, int64_t D, int64_t G,
                                   int64_t h0, int64_t h1, float scale, float cap, const float* sinks,
                                   DecodeScratch& sc, float* out);
extern template void attend_request<int8_t>(const float* q, const int8_t* kc, const int8_t* vc, const int64_t* table, int64_t len,
                                   int64_t first, int64_t ring, int64_t page, int64_t Hkv, int64_t D, int64_t G,
                                   int64_t h0, int64_t h1, float scale, float cap, const float* sinks,
                                   DecodeScratch& sc, float* out);

}  // namespace conveyor
