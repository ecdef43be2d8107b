// One token of a short causal convolution (LFM2's conv layers) whose state is a ring of the request's last
// `kernel` inputs in its KV pages, as layers/short_conv.py lays it out: position q at ring index q % kernel,
// a row of `hidden` values over r slots, each slot's K then V half (`kv_row` values each) in turn. The
// decode stack's conv layers call it per row; it computes what the eager layer computes, bit for bit.
#pragma once

#include "row_ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace conveyor {

// Slots one ring row of `hidden` values takes: a slot holds a K and a V row of `kv_row` values.
inline int64_t ring_row_slots(int64_t hidden, int64_t kv_row) { return (hidden + 2 * kv_row - 1) / (2 * kv_row); }

// The pool slot of index j in a request's run of blocks `bt`.
inline int64_t run_slot(const int64_t* bt, int64_t j, int64_t page) { return bt[j / page] * page + j % page; }

// The pool slot of the k-th of position q's r slots in a ring of `kernel` rows (blocks `bt`).
inline int64_t ring_slot(const int64_t* bt, int64_t q, int64_t k, int64_t kernel, int64_t r, int64_t page) {
    return run_slot(bt, (q % kernel) * r + k, page);
}

// acc [hidden] = the convolution at position p of the ring's previous `kernel - 1` rows (zeros before
// position 0) and `current`, one fp32 multiply-add a tap, oldest first, from the bias (`bias` or nullptr):
// layers/short_conv.py's order, which is oneDNN's.
template <typename C>
void ring_conv(const float* current, const float* taps, const float* bias, int64_t kernel, int64_t hidden,
               const C* kc, const C* vc, int64_t kv_row, const int64_t* bt, int64_t p, int64_t page, float* acc) {
    const int64_t H = hidden, r = ring_row_slots(H, kv_row);
    for (int64_t i = 0; i < H; ++i) acc[i] = bias ? bias[i] : 0.f;
    for (int64_t t = 0; t < kernel; ++t) {
        const int64_t q = p - (kernel - 1) + t;
        const float* w = taps + t * H;
        const bool first = t == 0 && !bias;  // the first product is not added to anything
        if (t == kernel - 1) {
            for (int64_t i = 0; i < H; ++i) acc[i] = first ? current[i] * w[i] : std::fma(current[i], w[i], acc[i]);
        } else if (q >= 0) {
            for (int64_t k = 0; k < r; ++k)
                for (int half = 0; half < 2; ++half) {
                    const C* src = (half ? vc : kc) + ring_slot(bt, q, k, kernel, r, page) * kv_row;
                    const int64_t i0 = (2 * k + half) * kv_row, n = std::min(kv_row, H - i0);
                    for (int64_t i = 0; i < n; ++i) {
                        const float x = to_float(src[i]);
                        acc[i0 + i] = first ? x * w[i0 + i] : std::fma(x, w[i0 + i], acc[i0 + i]);
                    }
                }
        } else if (first) {
            for (int64_t i = 0; i < H; ++i) acc[i] = 0.f * w[i];
        }
    }
}

// `row` [hidden] stored as position p's row of the ring.
template <typename C>
void store_ring_row(const float* row, int64_t kernel, int64_t hidden, C* kc, C* vc, int64_t kv_row, const int64_t* bt,
                    int64_t p, int64_t page) {
    const int64_t H = hidden, r = ring_row_slots(H, kv_row);
    for (int64_t k = 0; k < r; ++k)
        for (int half = 0; half < 2; ++half) {
            const int64_t i0 = (2 * k + half) * kv_row;
            C* dst = (half ? vc : kc) + ring_slot(bt, p, k, kernel, r, page) * kv_row;
            for (int64_t i = 0; i < std::min(kv_row, H - i0); ++i) dst[i] = static_cast<C>(row[i0 + i]);
        }
}

// `bcx` [3 * hidden]: the row's in_proj output (B, C, x; biased and rounded to T). B * x (rounded) goes
// in place of B and is convolved (`ring_conv`, `acc` [hidden] its scratch); `y` [hidden] gets C times the
// result (both rounded to T); B * x is stored at position `p` of the ring (tables `bt`).
template <typename T, typename C>
void short_conv_row(float* bcx, const float* taps, const float* bias, int64_t kernel, int64_t hidden, C* kc, C* vc,
                    int64_t kv_row, const int64_t* bt, int64_t p, int64_t page, float* acc, float* y) {
    const int64_t H = hidden;
    float* bx = bcx;  // B * x, over B
    for (int64_t i = 0; i < H; ++i) bx[i] = round_as<T>(bcx[i] * bcx[2 * H + i]);
    ring_conv(bx, taps, bias, kernel, H, kc, vc, kv_row, bt, p, page, acc);
    for (int64_t i = 0; i < H; ++i) y[i] = round_as<T>(bcx[H + i] * round_as<T>(acc[i]));
    store_ring_row(bx, kernel, H, kc, vc, kv_row, bt, p, page);
}

}  // namespace conveyor
