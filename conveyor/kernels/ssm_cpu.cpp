// Mamba-2's decode step on CPU (layers/mamba2.py): every decode row's SSM state updated in place in the KV
// pool, and its output, in one pass over the state. The PyTorch path reads each state out of the pool, makes
// four state-sized temporaries and writes it back: at 2 MiB a state per layer and row, that traffic and those
// dispatches were most of a step's time beside the matmuls.
//
// A row's state, `heads * P * N` fp32 values, lies over its `s` pool slots (`slots [rows, s]`): the value of
// flat index e at byte 4e of the run formed by each slot's K half, then its V half (`half_bytes` each, the V
// halves `v_offset` bytes after the K halves: the pool tensor `[2, slots, ...]`). A state row of N values
// lies within one half (checked by the caller). Per row r, head h and state row p:
//   S = started ? S : 0;  S = S * decay[r, h] + (dt[r, h] * B[r, g, :]) * x[r, h, p];  y = S . C[r, g, :] + x * D[h]
// with g the head's group. Built with -ffp-contract=off: the update rounds as the PyTorch ops do (each product
// and the sum rounded, decay computed by the caller with torch.exp), so the states are PyTorch's bits; the
// dot product with C adds in 16 lanes, not in the matmul's order.
#include "runtime.h"

using namespace conveyor;

namespace {

constexpr int kLanes = 16;

// One state row of n values: updated in place, its dot product with c returned.
inline float update_row(float* s, bool started, float decay, float dt, const float* b, float x, const float* c,
                        int64_t n) {
    float lanes[kLanes] = {};
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) {
        for (int l = 0; l < kLanes; ++l) {
            const float prev = started ? s[i + l] : 0.0f;
            const float v = prev * decay + (dt * b[i + l]) * x;
            s[i + l] = v;
            lanes[l] += v * c[i + l];
        }
    }
    for (; i < n; ++i) {
        const float prev = started ? s[i] : 0.0f;
        const float v = prev * decay + (dt * b[i]) * x;
        s[i] = v;
        lanes[0] += v * c[i];
    }
    float sum = 0.0f;
    for (int l = 0; l < kLanes; ++l) sum += lanes[l];
    return sum;
}

}  // namespace

// x [rows, heads, p], dt and decay [rows, heads], b and c [rows, groups, n], d [heads], started [rows] (0: the
// state is zeros, whatever the pool holds), y [rows, heads, p] out; all fp32 and contiguous.
CONVEYOR_API int conveyor_ssm_decode(void* pool, int64_t v_offset, int64_t half_bytes, const int64_t* slots,
                                     int64_t s, int64_t rows, int64_t heads, int64_t p, int64_t n, int64_t groups,
                                     const float* x, const float* dt, const float* decay, const float* b,
                                     const float* c, const float* d, const uint8_t* started, float* y,
                                     int threads) {
    return guarded(threads, [&] {
        CONVEYOR_CHECK(half_bytes % (n * 4) == 0, "a state row of ", n, " values must lie within one half of ",
                       half_bytes, " bytes");
        CONVEYOR_CHECK(heads % groups == 0, "heads (", heads, ") must be a multiple of groups (", groups, ")");
        char* base = static_cast<char*>(pool);
        const int64_t per_group = heads / groups, slot_bytes = 2 * half_bytes;
        parallel_for(0, rows * heads, 1, [&](int64_t begin, int64_t end) {
            for (int64_t rh = begin; rh < end; ++rh) {
                const int64_t r = rh / heads, h = rh % heads, g = h / per_group;
                const int64_t* row_slots = slots + r * s;
                const float* br = b + (r * groups + g) * n;
                const float* cr = c + (r * groups + g) * n;
                for (int64_t q = 0; q < p; ++q) {
                    const int64_t byte = ((h * p + q) * n) * 4;
                    const int64_t slot = byte / slot_bytes, within = byte % slot_bytes;
                    const int64_t half = within / half_bytes, offset = within % half_bytes;
                    float* state = reinterpret_cast<float*>(base + half * v_offset + row_slots[slot] * half_bytes +
                                                            offset);
                    const float xv = x[rh * p + q];
                    const float dot = update_row(state, started[r] != 0, decay[rh], dt[rh], br, xv, cr, n);
                    y[rh * p + q] = dot + xv * d[h];
                }
            }
        });
    });
}
