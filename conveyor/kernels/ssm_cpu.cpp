// Mamba-2's decode rows on CPU (layers/mamba2.py): from each row's in_proj output to the gated norm's output
// that feeds out_proj, the convolution's ring and the SSM state read and written in place in the KV pool
// (mamba_row.h's layout and arithmetic, which the native decode stack runs too, so a row gets the same bits on
// either path). Op by op in PyTorch each state was read out of the pool, copied through four state-sized
// temporaries and written back (docs/benchmarks.md, "Granite 4.0"). Phases 1 and 3 split the rows across
// threads, phase 2 the (row, head) pairs.
#include "mamba_row.h"

#include <vector>

using namespace conveyor;

// proj [rows, in_width] of `dtype` (fp32 or bf16, row stride `proj_ld`); the layer's pool `kv` [2, kv_slots,
// kv_row] of the same dtype; per row its run of blocks (`tables` [rows, width]) and position; the layer's
// weights (fp32); out [rows, inner] of `dtype`.
CONVEYOR_API int conveyor_mamba_decode(int dtype, const void* proj, int64_t proj_ld, int64_t rows, void* kv,
                                       int64_t kv_slots, int64_t kv_row, const int64_t* tables, int64_t width,
                                       const int64_t* positions, int64_t page, int64_t heads, int64_t p, int64_t n,
                                       int64_t groups, int64_t kernel, int64_t conv_dim, const float* taps,
                                       const float* conv_bias, const float* a, const float* d, const float* dt_bias,
                                       const float* norm, float eps, void* out, int threads) {
    return guarded(threads, [&] {
        CONVEYOR_CHECK(heads % groups == 0, "heads (", heads, ") must be a multiple of groups (", groups, ")");
        const MambaSpec m{heads, p, n, groups, kernel, conv_dim, taps, conv_bias, a, d, dt_bias, norm, eps};
        const auto run = [&](auto* tag) {
            using T = std::remove_pointer_t<decltype(tag)>;
            const T* in = static_cast<const T*>(proj);
            T* kc = static_cast<T*>(kv);
            T* vc = kc + kv_slots * kv_row;
            const int64_t W = m.in_width(), S = m.scratch(), I = m.inner();
            std::vector<float> rowsf(rows * W), conv(rows * S), y(rows * I), normed(rows * I);
            parallel_for(0, rows, 1, [&](int64_t b0, int64_t b1) {
                for (int64_t b = b0; b < b1; ++b) {
                    for (int64_t i = 0; i < W; ++i) rowsf[b * W + i] = to_float(in[b * proj_ld + i]);
                    mamba_conv_row<T, T>(m, rowsf.data() + b * W, kc, vc, kv_row, tables + b * width, positions[b],
                                         page, conv.data() + b * S);
                }
            });
            parallel_for(0, rows * heads, 1, [&](int64_t p0, int64_t p1) {
                for (int64_t ph = p0; ph < p1; ++ph) {
                    const int64_t b = ph / heads, h = ph % heads;
                    mamba_state_head<T>(m, h, kc, vc, kv_row, tables + b * width, page, positions[b] > 0,
                                        conv.data() + b * S, y.data() + b * I + h * p);
                }
            });
            T* o = static_cast<T*>(out);
            parallel_for(0, rows, 1, [&](int64_t b0, int64_t b1) {
                for (int64_t b = b0; b < b1; ++b) {
                    mamba_norm_row<T>(m, rowsf.data() + b * W, y.data() + b * I, normed.data() + b * I);
                    for (int64_t i = 0; i < I; ++i) o[b * I + i] = static_cast<T>(normed[b * I + i]);
                }
            });
        };
        if (dtype == kF32) run(static_cast<float*>(nullptr));
        else run(static_cast<bf16*>(nullptr));
    });
}
