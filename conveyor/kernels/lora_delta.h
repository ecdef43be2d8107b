// A LoRA linear's adapter deltas, every adapter of the batch at once: after the base matmul,
// `y[row] += B_slot (A_slot x[row])` for the rows that have an adapter, grouped by slot (the caller
// sorted them once per step: `order`, and `groups` of (slot, start, end) over it). Shared by the
// per-layer kernel (lora_cpu.cpp, its own parallel loops) and the decode stack (decode_stack_cpu.cpp,
// whose thread team runs the phases between its barriers), so both compute the same bits.
//
// Two phases: (1) the shrink, `t[p] = A_slot x[order[p]]` for every grouped row p (all blocks of the
// slot), split into work items of rows and columns of t; (2) the expand: `y[order[p], o] +=
// B_slot[o] . t[p, block]` for the output columns and output rows a caller asks for (the per-layer
// kernel splits the columns across threads, the decode stack the rows). Both run as tiles of up to
// kLoRARows rows times kLoRAVecs vectors, whose accumulators stay in registers: a weight vector is
// loaded (and widened from bf16) once for all the tile's rows. Every sum runs in fp32 in order over
// its inner index with one rounding per multiply-add (`fmadd`), so a value does not depend on the
// tile it fell in, nor on whether a vector or the scalar tail computed it.
//
// Layout (the `LoRALinear`'s): A `[slots, in, blocks * rank]` (transposed), B `[slots, rank, out]` with
// the scaling folded in; `slice_rows` the slices' output offsets (`n_slices + 1`), `slice_block[slot,
// slice]` the block of t a slice reads (-1: the adapter has none there). y gets `R(y + delta)` with the
// delta in fp32, R the type whose rounding y's values keep (y holds R, or floats that hold R values).
#pragma once

#include "row_ops.h"
#include "runtime.h"
#include "vec_math.h"

#include <vector>

namespace conveyor {

#ifdef __AVX512F__
constexpr int64_t kLoRARows = 4;  // rows of a tile: 4 x kLoRAVecs accumulators of 32 vector registers
#else
constexpr int64_t kLoRARows = 2;  // (16 vector registers)
#endif
constexpr int64_t kLoRAVecs = 4;           // vectors of columns one tile sums
constexpr int64_t kLoRAW = kLoRAVecs * W;  // columns of t one shrink item sums

// One projection's stacked adapter weights (Wt: fp32 or bf16).
template <typename Wt>
struct LoRAWeights {
    const Wt* a;
    const Wt* b;
    const int64_t* slice_rows;
    const int64_t* slice_block;
    int64_t n_slices, rank, blocks, in, out;
    int64_t width() const { return blocks * rank; }  // t's row: every block of the slot
    int64_t vectors() const { return (out + W - 1) / W; }  // the expand's column vectors
};

// The step's grouped rows.
struct LoRAGroups {
    const int64_t* order;
    const int64_t* groups;
    int64_t n_groups;
    int64_t rows() const { return n_groups ? groups[3 * (n_groups - 1) + 2] : 0; }
};

// A shrink work item: a tile of rows [p0, p1) of one slot's group, kLoRAW columns of t from k0.
struct LoRAShrinkItem {
    int64_t slot, p0, p1, k0;
};

inline void lora_shrink_items(const LoRAGroups& g, int64_t width, std::vector<LoRAShrinkItem>& items) {
    items.clear();
    for (int64_t i = 0; i < g.n_groups; ++i)
        for (int64_t p = g.groups[3 * i + 1]; p < g.groups[3 * i + 2]; p += kLoRARows)
            for (int64_t k0 = 0; k0 < width; k0 += kLoRAW)
                items.push_back({g.groups[3 * i], p, std::min(p + kLoRARows, g.groups[3 * i + 2]), k0});
}

namespace lora_detail {

// n < W values from p as floats, the other lanes 0 (no read past the n).
template <typename T>
inline vecw load_part(const T* p, int64_t n) {
#ifdef __AVX512F__
    return vecw(load16(p, static_cast<__mmask16>((1u << n) - 1)));
#else
    float tmp[W] = {};
    for (int64_t j = 0; j < n; ++j) tmp[j] = to_float(p[j]);
    return loadw(tmp);
#endif
}

// v rounded to R (fp32: as it is; bf16: to nearest even, widened back).
template <typename R>
inline vecw round_w(vecw v) {
    if constexpr (std::is_same_v<R, float>) {
        return v;
    } else {
#ifdef __AVX512F__
        return vecw(round_bf16(__m512(v)));
#else
        float tmp[W];
        storew(tmp, v);
        for (float& f : tmp) f = round_as<R>(f);
        return loadw(tmp);
#endif
    }
}

inline void store_w(float* p, vecw v) { storew(p, v); }
inline void store_w(bf16* p, vecw v) {  // v holds bf16 values: exact
#ifdef __AVX512F__
    store16(p, __m512(v));
#else
    float tmp[W];
    storew(tmp, v);
    for (int64_t j = 0; j < W; ++j) p[j] = bf16(tmp[j]);
#endif
}

// acc[r][v] = the sum over k < depth of x[r][k] * w[k * ld + v * W + (0, W)], in order over k, one
// rounding per multiply-add; n columns of w (the last vector may be partial: nothing past n is read).
// The shrink and the expand are both this product of a tile of rows with a block of weight vectors.
template <int NV, typename X, typename Wt>
void tile_products(const X* const* x, const Wt* w, int64_t ld, int64_t depth, int64_t n, vecw (&acc)[kLoRARows][NV]) {
    const int64_t full = n / W, part = n - full * W;
    for (int64_t k = 0; k < depth; ++k) {
        const Wt* wk = w + k * ld;
        vecw col[NV];
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) col[v] = v < full ? loadw(wk + v * W) : load_part(wk + v * W, part);
#pragma GCC unroll 4
        for (int r = 0; r < kLoRARows; ++r) {
            const vecw xk = splat(to_float(x[r][k]));
#pragma GCC unroll 4
            for (int v = 0; v < NV; ++v) acc[r][v] = fmadd(xk, col[v], acc[r][v]);
        }
    }
}

// t[r][0, n) = A^T's columns [0, n) (at, rows of `width`) times x[r] over `in`, for NV vectors of columns;
// rows [m, kLoRARows) repeat row m - 1 and are not stored.
template <int NV, typename X, typename Wt>
void shrink_tile(const X* const* x, const Wt* at, int64_t width, int64_t in, int64_t n, float* const* t, int64_t m) {
    vecw acc[kLoRARows][NV] = {};
    tile_products(x, at, width, in, n, acc);
    for (int64_t r = 0; r < m; ++r)
        for (int v = 0; v < NV; ++v) {
            float out[W];
            storew(out, acc[r][v]);
            std::copy(out, out + std::min<int64_t>(W, n - v * W), t[r] + v * W);
        }
}

// y[r][0, NV W) = R(y + sum over k < rank of t[r][k] * b[k * out + (0, NV W)]) for rows r < m.
template <int NV, typename R, typename Wt, typename Y>
void expand_tile(const float* const* t, const Wt* b, int64_t out, int64_t rank, Y* const* y, int64_t m) {
    vecw acc[kLoRARows][NV] = {};
    tile_products(t, b, out, rank, NV * W, acc);
    for (int64_t r = 0; r < m; ++r)
        for (int v = 0; v < NV; ++v) store_w(y[r] + v * W, round_w<R>(loadw(y[r] + v * W) + acc[r][v]));
}

// The block of t that output columns [o0, o0 + n) of `slot` read: one for all (>= 0), none (-1), or
// several slices' (-2: per column).
template <typename Wt>
int64_t columns_block(const LoRAWeights<Wt>& w, int64_t slot, int64_t o0, int64_t n) {
    int64_t s = 0;
    while (w.slice_rows[s + 1] <= o0) ++s;
    return o0 + n <= w.slice_rows[s + 1] ? w.slice_block[slot * w.n_slices + s] : -2;
}

// The same sums one column at a time: columns [o0, o1) of rows r < m, each reading its slice's block.
template <typename R, typename Wt, typename Y>
void expand_columns(const float* const* t, const LoRAWeights<Wt>& w, int64_t slot, int64_t o0, int64_t o1,
                    Y* const* y, int64_t m) {
    const Wt* b = w.b + slot * w.rank * w.out;
    for (int64_t o = o0; o < o1; ++o) {
        const int64_t block = columns_block(w, slot, o, 1);
        if (block < 0) continue;
        for (int64_t r = 0; r < m; ++r) {
            float acc = 0.f;
            for (int64_t k = 0; k < w.rank; ++k) acc = fmadd(t[r][block * w.rank + k], to_float(b[k * w.out + o]), acc);
            y[r][o] = static_cast<Y>(round_as<R>(static_cast<float>(y[r][o]) + acc));
        }
    }
}

}  // namespace lora_detail

// (1) items [i0, i1) of the shrink into t `[rows, width]`.
template <typename X, typename Wt>
void lora_shrink(const X* x, int64_t x_stride, const LoRAWeights<Wt>& w, const LoRAGroups& g,
                 const LoRAShrinkItem* items, int64_t i0, int64_t i1, float* t) {
    const int64_t width = w.width();
    for (int64_t it = i0; it < i1; ++it) {
        const LoRAShrinkItem& s = items[it];
        const int64_t n = std::min(kLoRAW, width - s.k0), m = s.p1 - s.p0;
        const X* xr[kLoRARows];
        float* tr[kLoRARows];
        for (int64_t r = 0; r < kLoRARows; ++r) {
            xr[r] = x + g.order[s.p0 + std::min(r, m - 1)] * x_stride;
            tr[r] = t + (s.p0 + r) * width + s.k0;
        }
        const Wt* at = w.a + s.slot * w.in * width + s.k0;
        switch ((n + W - 1) / W) {
            case 1: lora_detail::shrink_tile<1>(xr, at, width, w.in, n, tr, m); break;
            case 2: lora_detail::shrink_tile<2>(xr, at, width, w.in, n, tr, m); break;
            case 3: lora_detail::shrink_tile<3>(xr, at, width, w.in, n, tr, m); break;
            default: lora_detail::shrink_tile<4>(xr, at, width, w.in, n, tr, m); break;
        }
    }
}

// (2) the expand for column vectors [c0, c1) (W columns each) of the grouped rows whose output row is
// in [row0, row1).
template <typename R, typename Wt, typename Y>
void lora_expand(const float* t, const LoRAWeights<Wt>& w, const LoRAGroups& g, int64_t c0, int64_t c1,
                 int64_t row0, int64_t row1, Y* y, int64_t y_stride) {
    const int64_t width = w.width(), rank = w.rank;
    for (int64_t gi = 0; gi < g.n_groups; ++gi) {
        const int64_t slot = g.groups[3 * gi], end = g.groups[3 * gi + 2];
        const Wt* b = w.b + slot * rank * w.out;
        for (int64_t p = g.groups[3 * gi + 1]; p < end;) {
            int64_t tile[kLoRARows], m = 0;  // the next rows of the group that are ours
            for (; p < end && m < kLoRARows; ++p)
                if (g.order[p] >= row0 && g.order[p] < row1) tile[m++] = p;
            if (m == 0) break;
            const float* tp[kLoRARows];
            Y* yp[kLoRARows];
            for (int64_t r = 0; r < kLoRARows; ++r) {
                const int64_t q = tile[std::min(r, m - 1)];
                tp[r] = t + q * width;
                yp[r] = y + g.order[q] * y_stride;
            }
            for (int64_t c = c0; c < c1; c += kLoRAVecs) {
                const int64_t o0 = c * W, o1 = std::min(std::min(c1, c + kLoRAVecs) * W, w.out);
                const int64_t block = lora_detail::columns_block(w, slot, o0, o1 - o0);
                if (block == -1) continue;
                const int64_t nv = block >= 0 ? (o1 - o0) / W : 0;  // whole vectors of one block
                const float* tb[kLoRARows];
                Y* yo[kLoRARows];
                for (int64_t r = 0; r < kLoRARows; ++r) {
                    tb[r] = tp[r] + std::max<int64_t>(block, 0) * rank;
                    yo[r] = yp[r] + o0;
                }
                switch (nv) {
                    case 0: break;
                    case 1: lora_detail::expand_tile<1, R>(tb, b + o0, w.out, rank, yo, m); break;
                    case 2: lora_detail::expand_tile<2, R>(tb, b + o0, w.out, rank, yo, m); break;
                    case 3: lora_detail::expand_tile<3, R>(tb, b + o0, w.out, rank, yo, m); break;
                    default: lora_detail::expand_tile<4, R>(tb, b + o0, w.out, rank, yo, m); break;
                }
                lora_detail::expand_columns<R>(tp, w, slot, o0 + nv * W, o1, yp, m);
            }
        }
    }
}

}  // namespace conveyor
