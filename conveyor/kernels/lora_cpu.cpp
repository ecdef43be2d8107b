// A LoRA linear's adapter deltas, every adapter of the batch in one call (`layers/lora.py`): the
// shrink and expand phases of lora_delta.h, each one parallel loop.
//
// Run op by op from PyTorch, each adapter costs a gather, two small matmuls and a scatter-add per layer,
// whose dispatch outweighs a decode step's few rows per adapter. x, y, A and B are all fp32 or all bf16;
// a bf16 y gets `bf16(y + delta)` with the delta in fp32.
#include "lora_delta.h"
#include "runtime.h"

#include <vector>

namespace {

template <typename T>
void lora_delta(const T* x, int64_t x_stride, const conveyor::LoRAGroups& g, const conveyor::LoRAWeights<T>& w, T* y,
                int64_t y_stride) {
    std::vector<float> t(g.rows() * w.width(), 0.0f);
    std::vector<conveyor::LoRAShrinkItem> items;
    conveyor::lora_shrink_items(g, w.width(), items);
    conveyor::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t i0, int64_t i1) {
        conveyor::lora_shrink(x, x_stride, w, g, items.data(), i0, i1, t.data());
    });
    conveyor::parallel_for(0, w.vectors(), conveyor::kLoRAVecs, [&](int64_t c0, int64_t c1) {
        conveyor::lora_expand<T>(t.data(), w, g, c0, c1, 0, INT64_MAX, y, y_stride);
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
        const conveyor::LoRAGroups g{order, groups, n_groups};
        if (dtype == conveyor::kF32) {
            using T = float;
            const conveyor::LoRAWeights<T> w{static_cast<const T*>(a), static_cast<const T*>(b), slice_rows,
                                             slice_block, n_slices, rank, blocks, in, out};
            lora_delta(static_cast<const T*>(x), x_stride, g, w, static_cast<T*>(y), y_stride);
        } else {
            using T = conveyor::bf16;
            const conveyor::LoRAWeights<T> w{static_cast<const T*>(a), static_cast<const T*>(b), slice_rows,
                                             slice_block, n_slices, rank, blocks, in, out};
            lora_delta(static_cast<const T*>(x), x_stride, g, w, static_cast<T*>(y), y_stride);
        }
    });
}
