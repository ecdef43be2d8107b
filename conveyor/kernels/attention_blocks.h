// The arithmetic the CPU attention kernels share for one query row, written down once so that a
// query's output is the same bits whichever kernel computes it (prefill, prefill_attention_cpu.cpp;
// decode, attention_cpu.h), whatever chunk of its prompt it sits in and whatever it is batched with:
//
//   - keys are taken in blocks of kKeyBlock ABSOLUTE positions, [b * kKeyBlock, (b + 1) * kKeyBlock),
//     in order; lane n of a block is position b * kKeyBlock + n, so nothing depends on where the
//     query's chunk started;
//   - a score is one fused multiply-add chain down the head dim, d = 0, 1, ..., D - 1, from 0:
//     s = fmadd(q[d] * scale, k[d], s) (bf16 keys widened to fp32, exactly); soft-capped,
//     tanh(s / cap) * cap. Over bf16 keys on a CPU that multiplies bf16 pairs (AVX512-BF16's vdpbf16ps,
//     `kBf16Pairs`), the query is rounded to bf16 unscaled (exact for a bf16 model's query) and the
//     chain goes by pairs of entries, one `dot_bf16_pairs` per pair j (entry 2j + 1's product, then
//     2j's, each fused, from 0), then s = s * scale: half the instructions of widening the keys (the
//     products of two bf16 values are exact in fp32: only the chain's order differs);
//   - per block, over its visible keys: m1 = max(m, the block's max score); alpha = e^(m - m1) (skipped
//     where m1 == m: it is 1); p = e^(s - m1), exactly 0 for a masked or missing key; sum = `block_sum`
//     of the p (lane chains, then a fixed tree); l = fmadd(l, alpha, sum) (l + sum when unmoved);
//     o = o * alpha; then o = fmadd(p, v, o) key by key in position order;
//   - out = o * (1 / l); m starts at kMasked, l and o at 0;
//   - an attention sink (gpt-oss: a learned logit per query head that joins the softmax's denominator
//     and has no value) is the row's first key: m starts at the sink, l at 1 (= e^(sink - sink)), o at
//     0 (`start_row`). One place, before any block, so prefill and decode fold it identically; a model
//     without sinks starts as before and pays nothing.
//
//   - int8 K/V rows (kv_cache_dtype "int8", cache/kv_format.py) hold a head's D integer values and
//     then its fp32 scale. Over int8 keys the query row (q * scale, fp32) is quantized as a K row is
//     (`quantize_head_row`: a scale s_q, integer values), and a score is the exact integer dot
//     product of the two rows' values, times the scales: s = float(dot) * (s_q * s_k) (then the cap).
//     Integer sums have no order, so the kernels take them four bytes at a time with VNNI's
//     vpdpbusd (`dot_quads`: unsigned times signed bytes, so the key bytes go in offset by 128 and
//     the dot is the sum less 128 * the query's values' sum, `int8_scores`). A block's value rows
//     enter as one integer sum too: each row's weights w = p * s_v (fp32) are
//     rounded to 15-bit integers, u = nearbyint(w * (32767 / w_max)) with w_max the block's largest
//     (`weight_levels`), the sum_n u_n * v_int[n] taken exactly (`dot_pairs`, the values turned into
//     pairs of two keys at one head-dim entry: `value_pairs`), then o = fmadd(float(sum), w_max /
//     32767, o) (int8_values.h). l sums the unscaled p. A block whose weights are all below
//     kTinyWeight adds nothing (32767 / w_max would overflow).
//
// Every operation is lane-wise, so it does not matter which lane a row or a key lands in: prefill
// vectorizes along query rows, decode along keys. `fmadd` (vec_math.h) makes the fusing explicit; the
// kernels are built without the compiler's contraction.
#pragma once

#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace conveyor {

constexpr int64_t kKeyBlock = 64;  // a multiple of W and of the prefill kernel's key register block
constexpr int kBlockVectors = kKeyBlock / W;

// Masked scores: finite, so a row with nothing visible yet has a finite max (its probabilities are
// then exactly 0: masked) and padding rows stay finite.
constexpr float kMasked = -1e30f;

// A row's running max and sum before its first block: the sink's (see above), or none (sink nullptr).
inline void start_row(const float* sink, float& m, float& l) {
    m = sink ? *sink : kMasked;
    l = sink ? 1.f : 0.f;
}

// Whether a cache row type carries a scale (int8), a head row's length in T, and its scale (1 if none).
template <typename T>
constexpr bool kScaled = std::is_same_v<T, int8_t>;
template <typename T>
constexpr int64_t head_row(int64_t D) {
    return kScaled<T> ? D + static_cast<int64_t>(sizeof(float)) : D;
}
// Over bf16 keys, where the CPU multiplies bf16 pairs (`kBf16Dot`), a score is a chain over pairs of
// head-dim entries (`dot_bf16_pairs`), the query rounded to bf16 pairs too: bf16_pairs(D) of them, the
// last one's high half 0 where D is odd.
template <typename T>
constexpr bool kBf16Pairs = std::is_same_v<T, bf16> && kBf16Dot;
constexpr int64_t bf16_pairs(int64_t D) { return (D + 1) / 2; }

template <typename T>
inline float row_scale(const T* row, int64_t D) {
    if constexpr (kScaled<T>) {
        float s;
        std::memcpy(&s, row + D, sizeof s);
        return s;
    } else {
        return 1.f;
    }
}

// x[0:D] (fp32) as an int8 head row, bit for bit as cache/kv_format.py's `quantize_kv`: s = max|x| /
// 127, values nearbyint(x * (1 / s)) (0 where s is 0), then s's four bytes.
inline void quantize_head_row(const float* x, int64_t D, int8_t* dst) {
    vecw m = splat(0.f);
    int64_t d = 0;
    for (; d + W <= D; d += W) {
        const vecw v = loadw(x + d);
        m = vmax(m, select(v < 0.f, -v, v));
    }
    float amax = lane_max(m);
    for (; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
    const float s = amax / 127.f, inv = s > 0.f ? 1.f / s : 0.f;
    for (d = 0; d < D; ++d) dst[d] = static_cast<int8_t>(std::clamp(std::nearbyint(x[d] * inv), -127.f, 127.f));
    std::memcpy(dst + D, &s, sizeof s);
}

// An int8 row's values taken four bytes at a time (`dot_quads`): quads(D) 32-bit words, the last
// padded with zero bytes in a query (so whatever bytes a key row has there count for nothing).
constexpr int64_t quads(int64_t D) { return (D + 3) / 4; }

// A query row x[0:D] (q * scale, fp32) quantized for int8 keys: its values into `values` (quads(D)
// words, zero-padded) and its scale; returns the values' sum (`int8_scores`' offset).
inline int32_t quantize_query(const float* x, int64_t D, int32_t* values, float& s) {
    thread_local std::vector<int8_t> buffer;
    buffer.resize(D + 4);
    int8_t* row = buffer.data();
    quantize_head_row(x, D, row);
    std::memcpy(&s, row + D, sizeof s);
    std::memset(row + D, 0, 4);
    std::memcpy(values, row, quads(D) * 4);
    int32_t sum = 0;
    for (int64_t d = 0; d < D; ++d) sum += row[d];
    return sum;
}

// A query row x[0:D] as `dot_bf16_pairs` takes it over bf16 keys (`kBf16Pairs`): rounded to bf16, unscaled,
// pair j (entries 2j low, 2j + 1 high; 0 past D) at out[j * stride].
template <typename Q>
inline void query_pairs(const Q* x, int64_t D, uint32_t* out, int64_t stride) {
    int64_t j = 0;
    if constexpr (std::is_same_v<Q, bf16>)  // already bf16: the pairs are the row's 32-bit words
        for (; 2 * j + 1 < D; ++j) std::memcpy(out + j * stride, x + 2 * j, sizeof(uint32_t));
    for (; j < bf16_pairs(D); ++j) {
        const uint32_t lo = bf16(to_float(x[2 * j])).x, hi = 2 * j + 1 < D ? bf16(to_float(x[2 * j + 1])).x : 0u;
        out[j * stride] = lo | hi << 16;
    }
}

// A key row's quad as `dot_quads` takes it: its four bytes offset by 128 (unsigned).
inline int32_t key_quad(const int8_t* row, int64_t j) {
    uint32_t x;
    std::memcpy(&x, row + 4 * j, sizeof x);
    return static_cast<int32_t>(x ^ 0x80808080u);
}

// Scores from `dot_quads` sums over offset key bytes: float(sum - 128 * query sum) * (s_q * s_k),
// lane-wise (the lanes are keys in decode, query rows in prefill: the same operations either way).
inline vecw int8_scores(ivecw sums, ivecw query_sums, vecw scales) {
    return __builtin_convertvector(sums - (query_sums << 7), vecw) * scales;
}

// First position of the block holding position `pos` (>= 0).
constexpr int64_t block_start(int64_t pos) { return pos / kKeyBlock * kKeyBlock; }

// The sum of a block's probabilities p[0..kKeyBlock) (missing keys: 0), in this order: lane chains
// c[l] = ((p[l] + p[W + l]) + p[2W + l]) + ..., then a tree, c[l] = c[l] + c[l + h] for h = W/2, ..., 1;
// the sum is c[0]. Decode takes it on the block's vectors (`block_sum`); prefill, whose lanes are
// rows, keeps the W chains of each row in W vectors (`fold_chains`).
namespace detail {
template <int H, int... L>
inline vecw fold_lanes(vecw c, std::integer_sequence<int, L...> lanes) {  // c[l] + c[l + H], then H / 2, ...
    if constexpr (H >= 1) return fold_lanes<H / 2>(c + __builtin_shufflevector(c, c, ((L + H) % W)...), lanes);
    else return c;
}
}  // namespace detail
template <int NV>
inline float block_sum(const vecw* p) {
    vecw c = p[0];
    for (int v = 1; v < NV; ++v) c = c + p[v];
    return detail::fold_lanes<W / 2>(c, std::make_integer_sequence<int, W>{})[0];
}
inline vecw fold_chains(vecw* c) {
    for (int h = W / 2; h >= 1; h /= 2)
        for (int l = 0; l < h; ++l) c[l] = c[l] + c[l + h];
    return c[0];
}

// A vector of 32-bit bf16 pairs as two fp32 vectors: the low halves (even entries), the high ones (odd).
inline void split_bf16_pairs(const void* pairs, vecw& even, vecw& odd) {
    uvecw x, e, o;
    std::memcpy(&x, pairs, sizeof x);
    e = x << 16;
    o = x & 0xffff0000u;
    std::memcpy(&even, &e, sizeof even);
    std::memcpy(&odd, &o, sizeof odd);
}

// Calls f(d, column) for d = 0, 1, ..., D - 1 in order, column holding element d of W key rows
// (rows[i] + offset for lane i, widened): a block of keys turned by head-dim entry, so a score is a
// chain of multiply-adds down a column. bf16 rows are turned as 32-bit pairs, split after (half the
// shuffles of widening first: the turn is what costs at depth); a tail of fewer than W entries is
// gathered. (Where `kBf16Pairs`, bf16 keys are turned as pairs and not split, `key_pairs`; int8 keys
// as quads, `key_quads`.)
template <typename T, typename F>
inline void key_columns(const T* const* rows, int64_t offset, int64_t D, F&& f) {
    int64_t d0 = 0;
    vecw r[W];
    if constexpr (std::is_same_v<T, bf16>) {
        for (; d0 + 2 * W <= D; d0 += 2 * W) {
            for (int i = 0; i < W; ++i) std::memcpy(&r[i], rows[i] + offset + d0, sizeof(vecw));
            transpose(r);
            for (int j = 0; j < W; ++j) {
                vecw e, o;
                split_bf16_pairs(&r[j], e, o);
                f(d0 + 2 * j, e);
                f(d0 + 2 * j + 1, o);
            }
        }
    }
    for (; d0 + W <= D; d0 += W) {
        for (int i = 0; i < W; ++i) r[i] = loadw(rows[i] + offset + d0);
        transpose(r);
        for (int j = 0; j < W; ++j) f(d0 + j, r[j]);
    }
    for (; d0 < D; ++d0) {
        float c[W];
        for (int i = 0; i < W; ++i) c[i] = to_float(rows[i][offset + d0]);
        f(d0, loadw(c));
    }
}

// Calls f(j, column) for pairs j = 0, 1, ..., bf16_pairs(D) - 1, column holding head-dim entries 2j
// (low half) and 2j + 1 (high half) of W bf16 key rows (rows[i] + offset for lane i) as 32-bit lanes:
// the rows turned as 32-bit words, not widened (`dot_bf16_pairs` takes them so); a tail of fewer than
// 2W entries is gathered.
template <typename F>
inline void key_pairs(const bf16* const* rows, int64_t offset, int64_t D, F&& f) {
    int64_t d0 = 0;
    vecw r[W];
    for (; d0 + 2 * W <= D; d0 += 2 * W) {
        for (int i = 0; i < W; ++i) std::memcpy(&r[i], rows[i] + offset + d0, sizeof(vecw));
        transpose(r);
        for (int j = 0; j < W; ++j) {
            uvecw x;
            std::memcpy(&x, &r[j], sizeof x);
            f(d0 / 2 + j, x);
        }
    }
    for (; d0 < D; d0 += 2) {
        uint32_t c[W];
        for (int i = 0; i < W; ++i) {
            uint16_t lo, hi = 0;
            std::memcpy(&lo, rows[i] + offset + d0, 2);
            if (d0 + 1 < D) std::memcpy(&hi, rows[i] + offset + d0 + 1, 2);
            c[i] = lo | static_cast<uint32_t>(hi) << 16;
        }
        uvecw x;
        std::memcpy(&x, c, sizeof x);
        f(d0 / 2, x);
    }
}

// Calls f(j, column) for quads j = 0, 1, ..., nq - 1, column holding quad j of W int8 key rows (rows[i]
// + offset for lane i) as `key_quad` gives it: 4W-byte slices of the rows turned as 32-bit words.
template <typename F>
inline void key_quads(const int8_t* const* rows, int64_t offset, int64_t nq, F&& f) {
    const ivecw bias = splat_i(static_cast<int32_t>(0x80808080u));
    int64_t j0 = 0;
    for (; j0 + W <= nq; j0 += W) {  // whole groups: turned and consumed in registers
        vecw r[W];
        for (int i = 0; i < W; ++i) std::memcpy(&r[i], rows[i] + offset + 4 * j0, sizeof(vecw));
        transpose(r);
#pragma GCC unroll 16
        for (int j = 0; j < W; ++j) {
            ivecw x;
            std::memcpy(&x, &r[j], sizeof x);
            f(j0 + j, x ^ bias);
        }
    }
    if (j0 < nq) {  // the last, partial group: the rows' remaining words, zeros after
        const int64_t n = nq - j0;
        vecw r[W];
        for (int i = 0; i < W; ++i) {
            r[i] = vecw{};
            std::memcpy(&r[i], rows[i] + offset + 4 * j0, n * 4);
        }
        transpose(r);
        for (int64_t j = 0; j < n; ++j) {
            ivecw x;
            std::memcpy(&x, &r[j], sizeof x);
            f(j0 + j, x ^ bias);
        }
    }
}

}  // namespace conveyor
