// A LoRA linear's adapter deltas, every adapter of the batch in one call (`layers/lora.py`): after the
// base matmul, `y[row] += B_slot (A_slot x[row])` for the rows that have an adapter, grouped by slot
// (the caller sorted them once per step: `order`, and `groups` of (slot, start, end) over it).
//
// Run op by op from PyTorch, each adapter costs a gather, two small matmuls and a scatter-add per layer,
// whose dispatch outweighs a decode step's few rows per adapter. Here two phases, each one parallel
// loop: (1) the shrink, `t[p] = A_slot x[order[p]]` for every grouped row p (all blocks of the slot,
// fp32 accumulation), split by rows; (2) the expand, split by output rows: each output row o
// of each slice adds `B_slot[o] . t[p, block]` to `y[order[p], o]` for the group's rows, so a B row is
// read once per group and no two threads write one value.
//
// Layout (the `LoRALinear`'s): A `[slots, blocks * rank, in]`, B `[slots, out, rank]` with the scaling
// folded in; `slice_rows` the slices' output offsets (`n_slices + 1`), `slice_block[slot, slice]` the
// block of t a slice reads (-1: the adapter has none there). x, y, A and B are all fp32 or all bf16;
// a bf16 y gets `bf16(y + delta)` with the delta in fp32.
#include "runtime.h"

#include <vector>

namespace {

using conveyor::bf16;

constexpr int64_t kV = 16;     // output columns of one expand block: one AVX-512 vector of fp32
constexpr int64_t kW = 64;     // columns of t one shrink item sums (a rank-16 q/k/v adapter's 48 in one)
constexpr int64_t kRows = 4;   // rows of the shrink's tile (each with its accumulators)

template <typename T>
void lora_delta(const T* x, int64_t x_stride, int64_t in, const int64_t* order, const int64_t* groups,
                int64_t n_groups, const T* a, const T* b, const int64_t* slice_rows, const int64_t* slice_block,
                int64_t n_slices, int64_t rank, int64_t blocks, T* y, int64_t y_stride, int64_t out) {
    const int64_t width = blocks * rank;  // t's row: every block of the slot
    const int64_t rows = n_groups ? groups[3 * (n_groups - 1) + 2] : 0;
    std::vector<float> t(rows * width, 0.0f);
    // (1) the shrink: work items (group, tile of kRows rows, kW columns of t), each summing over `in` the
    // A^T row's kW columns (converted once) times each tile row's x (fp32 accumulators)
    struct Item {
        int64_t slot, p0, p1, k0;
    };
    std::vector<Item> items;
    for (int64_t g = 0; g < n_groups; ++g)
        for (int64_t p = groups[3 * g + 1]; p < groups[3 * g + 2]; p += kRows)
            for (int64_t k0 = 0; k0 < width; k0 += kW)
                items.push_back({groups[3 * g], p, std::min(p + kRows, groups[3 * g + 2]), k0});
    conveyor::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t i0, int64_t i1) {
        for (int64_t it = i0; it < i1; ++it) {
            const Item& w = items[it];
            const int64_t n = std::min(kW, width - w.k0), m = w.p1 - w.p0;
            const T* xr[kRows];
            for (int64_t r = 0; r < kRows; ++r) xr[r] = x + order[w.p0 + std::min(r, m - 1)] * x_stride;
            float acc[kRows][kW] = {};
            float col[kW] = {};
            const T* at = a + w.slot * in * width + w.k0;
            for (int64_t i = 0; i < in; ++i) {
                for (int64_t j = 0; j < n; ++j) col[j] = static_cast<float>(at[i * width + j]);
#pragma GCC unroll 4
                for (int64_t r = 0; r < kRows; ++r) {
                    const float xi = static_cast<float>(xr[r][i]);
#pragma omp simd
                    for (int64_t j = 0; j < kW; ++j) acc[r][j] += xi * col[j];
                }
            }
            for (int64_t r = 0; r < m; ++r)
                for (int64_t j = 0; j < n; ++j) t[(w.p0 + r) * width + w.k0 + j] = acc[r][j];
        }
    });
    // (2) the expand, by kV-column blocks of the output: a block's B columns for the slice's rank
    // (converted once per group) times each grouped row's t, summed in fp32, added to y once
    const int64_t col_blocks = (out + kV - 1) / kV;
    conveyor::parallel_for(0, col_blocks, 4, [&](int64_t c0, int64_t c1) {
        std::vector<float> bt(rank * kV);
        for (int64_t c = c0; c < c1; ++c) {
            const int64_t o0 = c * kV, n = std::min(kV, out - o0);
            int64_t s = 0;
            while (slice_rows[s + 1] <= o0) ++s;
            for (int64_t g = 0; g < n_groups; ++g) {
                const int64_t slot = groups[3 * g], start = groups[3 * g + 1], end = groups[3 * g + 2];
                // a column block may straddle two slices (widths not multiples of kV): per column its block
                int64_t col_block[kV];
                bool any = false;
                for (int64_t j = 0, sj = s; j < kV; ++j) {
                    while (j < n && slice_rows[sj + 1] <= o0 + j) ++sj;
                    col_block[j] = j < n ? slice_block[slot * n_slices + sj] : -1;
                    any |= col_block[j] >= 0;
                }
                if (!any) continue;
                const T* bs = b + slot * rank * out + o0;
                for (int64_t r = 0; r < rank; ++r)
                    for (int64_t j = 0; j < kV; ++j) bt[r * kV + j] = j < n ? static_cast<float>(bs[r * out + j]) : 0.0f;
                bool uniform = true;  // every column reads one block: a broadcast; else per column
                for (int64_t j = 1; j < n; ++j) uniform &= col_block[j] == col_block[0];
                for (int64_t p = start; p < end; ++p) {
                    const float* tp = &t[p * width];
                    float acc[kV] = {};
                    if (uniform) {
                        const float* tb = tp + col_block[0] * rank;
                        for (int64_t r = 0; r < rank; ++r) {
                            const float w = tb[r], *br = &bt[r * kV];
#pragma omp simd
                            for (int64_t j = 0; j < kV; ++j) acc[j] += w * br[j];
                        }
                    } else {
                        for (int64_t j = 0; j < n; ++j)
                            if (col_block[j] >= 0)
                                for (int64_t r = 0; r < rank; ++r) acc[j] += tp[col_block[j] * rank + r] * bt[r * kV + j];
                    }
                    T* yr = y + order[p] * y_stride + o0;
                    for (int64_t j = 0; j < n; ++j) yr[j] = static_cast<T>(static_cast<float>(yr[j]) + acc[j]);
                }
            }
        }
    });
}

}  // namespace

CONVEYOR_API int conveyor_lora_delta(int dtype, const void* x, int64_t x_stride, int64_t in, const int64_t* order,
                                     const int64_t* groups, int64_t n_groups, const void* a, const void* b,
                                     const int64_t* slice_rows, const int64_t* slice_block, int64_t n_slices,
                                     int64_t rank, int64_t blocks, void* y, int64_t y_stride, int64_t out,
                                     int threads) {
    return conveyor::guarded(threads, [&] {
        CONVEYOR_CHECK(dtype == conveyor::kF32 || dtype == conveyor::kBF16, "lora_delta: dtype must be fp32 or bf16");
        CONVEYOR_CHECK(slice_rows[n_slices] == out, "lora_delta: the slices cover ", slice_rows[n_slices],
                       " output rows, the layer has ", out);
        if (dtype == conveyor::kF32)
            lora_delta(static_cast<const float*>(x), x_stride, in, order, groups, n_groups,
                       static_cast<const float*>(a), static_cast<const float*>(b), slice_rows, slice_block, n_slices,
                       rank, blocks, static_cast<float*>(y), y_stride, out);
        else
            lora_delta(static_cast<const bf16*>(x), x_stride, in, order, groups, n_groups, static_cast<const bf16*>(a),
                       static_cast<const bf16*>(b), slice_rows, slice_block, n_slices, rank, blocks,
                       static_cast<bf16*>(y), y_stride, out);
    });
}
