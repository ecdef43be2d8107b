// A LoRA linear's adapter deltas, every adapter of the batch at once: after the base matmul,
// `y[row] += B_slot (A_slot x[row])` for the rows that have an adapter, grouped by slot (the caller
// sorted them once per step: `order`, and `groups` of (slot, start, end) over it). Shared by the
// per-layer kernel (lora_cpu.cpp, its own parallel loops) and the decode stack (decode_stack_cpu.cpp,
// whose thread team runs the phases between its barriers), so both compute the same bits.
//
// Two phases: (1) the shrink, `t[p] = A_slot x[order[p]]` for every grouped row p (all blocks of the
// slot, fp32 accumulation), split into work items of rows and columns of t; (2) the expand, split by
// kV-column blocks of the output: each output row o of each slice adds `B_slot[o] . t[p, block]` to
// `y[order[p], o]` for the group's rows, so a B row is read once per group and no two threads write
// one value.
//
// Layout (the `LoRALinear`'s): A `[slots, in, blocks * rank]` (transposed), B `[slots, rank, out]` with
// the scaling folded in; `slice_rows` the slices' output offsets (`n_slices + 1`), `slice_block[slot,
// slice]` the block of t a slice reads (-1: the adapter has none there). y gets `R(y + delta)` with the
// delta in fp32, R the type whose rounding y's values keep (y holds R, or floats that hold R values).
#pragma once

#include "row_ops.h"
#include "runtime.h"

#include <vector>

namespace conveyor {

constexpr int64_t kLoRAV = 16;     // output columns of one expand block: one AVX-512 vector of fp32
constexpr int64_t kLoRAW = 64;     // columns of t one shrink item sums (a rank-16 q/k/v adapter's 48 in one)
constexpr int64_t kLoRARows = 4;   // rows of the shrink's tile (each with its accumulators)

// One projection's stacked adapter weights (W: fp32 or bf16).
template <typename W>
struct LoRAWeights {
    const W* a;
    const W* b;
    const int64_t* slice_rows;
    const int64_t* slice_block;
    int64_t n_slices, rank, blocks, in, out;
    int64_t width() const { return blocks * rank; }  // t's row: every block of the slot
};

// The step's grouped rows.
struct LoRAGroups {
    const int64_t* order;
    const int64_t* groups;
    int64_t n_groups;
    int64_t rows() const { return n_groups ? groups[3 * (n_groups - 1) + 2] : 0; }
};

// A shrink work item: a tile of rows [p0, p1) of one slot's group, kW columns of t from k0.
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

// (1) items [i0, i1) of the shrink into t `[rows, width]`: each sums over `in` the A^T row's kW columns
// (converted once) times each tile row's x (fp32 accumulators).
template <typename X, typename W>
void lora_shrink(const X* x, int64_t x_stride, const LoRAWeights<W>& w, const LoRAGroups& g,
                 const LoRAShrinkItem* items, int64_t i0, int64_t i1, float* t) {
    const int64_t width = w.width(), in = w.in;
    for (int64_t it = i0; it < i1; ++it) {
        const LoRAShrinkItem& s = items[it];
        const int64_t n = std::min(kLoRAW, width - s.k0), m = s.p1 - s.p0;
        const X* xr[kLoRARows];
        for (int64_t r = 0; r < kLoRARows; ++r) xr[r] = x + g.order[s.p0 + std::min(r, m - 1)] * x_stride;
        float acc[kLoRARows][kLoRAW] = {};
        float col[kLoRAW] = {};
        const W* at = w.a + s.slot * in * width + s.k0;
        for (int64_t i = 0; i < in; ++i) {
            for (int64_t j = 0; j < n; ++j) col[j] = static_cast<float>(at[i * width + j]);
#pragma GCC unroll 4
            for (int64_t r = 0; r < kLoRARows; ++r) {
                const float xi = static_cast<float>(xr[r][i]);
#pragma omp simd
                for (int64_t j = 0; j < kLoRAW; ++j) acc[r][j] += xi * col[j];
            }
        }
        for (int64_t r = 0; r < m; ++r)
            for (int64_t j = 0; j < n; ++j) t[(s.p0 + r) * width + s.k0 + j] = acc[r][j];
    }
}

// (2) kV-column blocks [c0, c1) of the expand: a block's B columns for the slice's rank (converted once
// per group, into `bt`: rank * kV floats) times each grouped row's t, summed in fp32, added to y once.
template <typename R, typename W, typename Y>
void lora_expand(const float* t, const LoRAWeights<W>& w, const LoRAGroups& g, int64_t c0, int64_t c1, Y* y,
                 int64_t y_stride, float* bt) {
    const int64_t width = w.width(), rank = w.rank, out = w.out, n_slices = w.n_slices;
    for (int64_t c = c0; c < c1; ++c) {
        const int64_t o0 = c * kLoRAV, n = std::min(kLoRAV, out - o0);
        int64_t s = 0;
        while (w.slice_rows[s + 1] <= o0) ++s;
        for (int64_t gi = 0; gi < g.n_groups; ++gi) {
            const int64_t slot = g.groups[3 * gi], start = g.groups[3 * gi + 1], end = g.groups[3 * gi + 2];
            // a column block may straddle two slices (widths not multiples of kV): per column its block
            int64_t col_block[kLoRAV];
            bool any = false;
            for (int64_t j = 0, sj = s; j < kLoRAV; ++j) {
                while (j < n && w.slice_rows[sj + 1] <= o0 + j) ++sj;
                col_block[j] = j < n ? w.slice_block[slot * n_slices + sj] : -1;
                any |= col_block[j] >= 0;
            }
            if (!any) continue;
            const W* bs = w.b + slot * rank * out + o0;
            for (int64_t r = 0; r < rank; ++r)
                for (int64_t j = 0; j < kLoRAV; ++j) bt[r * kLoRAV + j] = j < n ? static_cast<float>(bs[r * out + j]) : 0.0f;
            bool uniform = true;  // every column reads one block: a broadcast; else per column
            for (int64_t j = 1; j < n; ++j) uniform &= col_block[j] == col_block[0];
            for (int64_t p = start; p < end; ++p) {
                const float* tp = t + p * width;
                float acc[kLoRAV] = {};
                if (uniform) {
                    const float* tb = tp + col_block[0] * rank;
                    for (int64_t r = 0; r < rank; ++r) {
                        const float wr = tb[r], *br = &bt[r * kLoRAV];
#pragma omp simd
                        for (int64_t j = 0; j < kLoRAV; ++j) acc[j] += wr * br[j];
                    }
                } else {
                    for (int64_t j = 0; j < n; ++j)
                        if (col_block[j] >= 0)
                            for (int64_t r = 0; r < rank; ++r) acc[j] += tp[col_block[j] * rank + r] * bt[r * kLoRAV + j];
                }
                Y* yr = y + g.order[p] * y_stride + o0;
                for (int64_t j = 0; j < n; ++j) yr[j] = static_cast<Y>(round_as<R>(static_cast<float>(yr[j]) + acc[j]));
            }
        }
    }
}

}  // namespace conveyor
