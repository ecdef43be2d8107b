// One decode row of a Mamba-2 mixer (layers/mamba2.py), from its in_proj output to the gated norm's output that
// feeds out_proj, with its state in the request's KV pages as layers/mamba2.py lays it out: the convolution's
// ring first (position q's row of `conv_dim` values at ring index q % kernel, over r slots, each slot's K then
// V half), then the SSM state in fp32 (flat index e at byte 4e of the run of the following slots' K, then V,
// halves). Written once for the eager layer's decode rows (ssm_cpu.cpp) and the native decode stack
// (decode_stack_cpu.cpp), which are built with different contraction flags: every product that feeds an add
// passes through `unfused` or is an explicit fma, so both give the same bits. T: the model's dtype (values
// held in fp32 arrays, T-exact); C: the pool's element type.
//
// Three phases, so that the state update (most of the bytes) can split a row's heads across threads:
// `mamba_conv_row` (the convolution with its bias and SiLU, the ring's new row, dt = softplus(dt + dt_bias)
// and each head's decay exp(dt * A)), `mamba_state_head` (S = S * decay + (dt * B) * x in place, y = S . C +
// x * D), `mamba_norm_row` (RMSNorm per group of y * silu(gate), times the weight, rounded as the eager
// layer's bf16 tensors round).
#pragma once

#include "row_ops.h"
#include "short_conv.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace conveyor {

struct MambaSpec {
    int64_t heads = 0, P = 0, N = 0, groups = 1, kernel = 0, conv_dim = 0;
    const float* taps = nullptr;  // [kernel][conv_dim]
    const float* conv_bias = nullptr;  // [conv_dim] or null
    const float *A = nullptr, *D = nullptr, *dt_bias = nullptr;  // [heads]
    const float* norm = nullptr;  // [heads * P]
    float eps = 1e-6f;

    int64_t inner() const { return heads * P; }
    int64_t in_width() const { return inner() + conv_dim + heads; }  // in_proj's output: gate, xBC, dt
    int64_t scratch() const { return conv_dim + 2 * heads; }  // a row's conv output, dt and decay
};

// A MambaSpec's arrays, owned (the decode stack's copy of a layer's).
struct MambaWeights {
    MambaSpec spec;
    std::vector<float> taps, conv_bias, A, D, dt_bias, norm;

    void assign(const MambaSpec& s) {
        spec = s;
        taps.assign(s.taps, s.taps + s.kernel * s.conv_dim);
        if (s.conv_bias) conv_bias.assign(s.conv_bias, s.conv_bias + s.conv_dim);
        A.assign(s.A, s.A + s.heads), D.assign(s.D, s.D + s.heads), dt_bias.assign(s.dt_bias, s.dt_bias + s.heads);
        norm.assign(s.norm, s.norm + s.inner());
        spec.taps = taps.data(), spec.conv_bias = conv_bias.empty() ? nullptr : conv_bias.data();
        spec.A = A.data(), spec.D = D.data(), spec.dt_bias = dt_bias.data(), spec.norm = norm.data();
    }
};

// v = v * sigmoid(v) over n values (fp32; a vector e^x where the target has one, libm's on the tail).
inline void silu_row(float* v, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 one = _mm512_set1_ps(1.f);
    for (; i + 16 <= n; i += 16) {
        const __m512 x = _mm512_loadu_ps(v + i);
        _mm512_storeu_ps(v + i, _mm512_div_ps(x, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), x)))));
    }
#endif
    for (; i < n; ++i) v[i] = v[i] / (1.f + std::exp(-v[i]));
}


// Phase 1 of row `proj` [in_width] (biased, T-exact) at position p: `out` [scratch()] gets the convolution of
// xBC with the ring's previous kernel - 1 rows (zeros before position 0), one fma a tap from the bias, rounded
// to T and through SiLU; then dt (softplus, as torch's: x above 20 kept) and decay. xBC is stored in the ring.
template <typename T, typename C>
void mamba_conv_row(const MambaSpec& m, const float* proj, C* kc, C* vc, int64_t kv_row, const int64_t* bt, int64_t p,
                    int64_t page, float* out) {
    const int64_t H = m.conv_dim;
    const float* xbc = proj + m.inner();
    ring_conv(xbc, m.taps, m.conv_bias, m.kernel, H, kc, vc, kv_row, bt, p, page, out);
    for (int64_t i = 0; i < H; ++i) out[i] = round_as<T>(out[i]);
    silu_row(out, H);
    store_ring_row(xbc, m.kernel, H, kc, vc, kv_row, bt, p, page);
    const float* dt_raw = proj + m.inner() + H;
    float* dt = out + H;
    float* decay = dt + m.heads;
    for (int64_t h = 0; h < m.heads; ++h) {
        const float x = dt_raw[h] + m.dt_bias[h];
        dt[h] = x > 20.f ? x : std::log1p(std::exp(x));
        decay[h] = std::exp(dt[h] * m.A[h]);
    }
}

// Phase 2, head h of a row whose phase 1 left `conv` [scratch()]: its state (zeros where `started` is false,
// whatever the pages hold) updated in place, `y` [P] its outputs with the D skip.
template <typename C>
void mamba_state_head(const MambaSpec& m, int64_t h, C* kc, C* vc, int64_t kv_row, const int64_t* bt, int64_t page,
                      bool started, const float* conv, float* y) {
    constexpr int kLanes = 16;
    const int64_t N = m.N, g = h / (m.heads / m.groups), half_bytes = kv_row * static_cast<int64_t>(sizeof(C));
    const int64_t base = m.kernel * ring_row_slots(m.conv_dim, kv_row);
    const float* x = conv + h * m.P;
    const float* b = conv + m.inner() + g * N;
    const float* c = conv + m.inner() + m.groups * N + g * N;
    const float dt = conv[m.conv_dim + h], decay = conv[m.conv_dim + m.heads + h];
    for (int64_t q = 0; q < m.P; ++q) {
        const int64_t byte = (h * m.P + q) * N * 4, slot = byte / (2 * half_bytes), within = byte % (2 * half_bytes);
        C* half = (within >= half_bytes ? vc : kc) + run_slot(bt, base + slot, page) * kv_row;
        float* s = reinterpret_cast<float*>(reinterpret_cast<char*>(half) + within % half_bytes);
        const float xv = x[q];
        float lanes[kLanes] = {};
        int64_t i = 0;
#if defined(__AVX512F__)
        const __m512 vdecay = _mm512_set1_ps(decay), vdt = _mm512_set1_ps(dt), vx = _mm512_set1_ps(xv);
        __m512 acc = _mm512_setzero_ps();
        for (; i + kLanes <= N; i += kLanes) {
            const __m512 prev = started ? _mm512_loadu_ps(s + i) : _mm512_setzero_ps();
            const __m512 dbx = unfused(_mm512_mul_ps(unfused(_mm512_mul_ps(vdt, _mm512_loadu_ps(b + i))), vx));
            const __m512 v = _mm512_add_ps(unfused(_mm512_mul_ps(prev, vdecay)), dbx);
            _mm512_storeu_ps(s + i, v);
            acc = _mm512_fmadd_ps(v, _mm512_loadu_ps(c + i), acc);
        }
        _mm512_storeu_ps(lanes, acc);
#endif
        for (; i + kLanes <= N; i += kLanes)
            for (int l = 0; l < kLanes; ++l) {
                const float prev = started ? s[i + l] : 0.f;
                const float v = unfused(prev * decay) + unfused(unfused(dt * b[i + l]) * xv);
                s[i + l] = v;
                lanes[l] = std::fma(v, c[i + l], lanes[l]);
            }
        for (; i < N; ++i) {
            const float prev = started ? s[i] : 0.f;
            const float v = unfused(prev * decay) + unfused(unfused(dt * b[i]) * xv);
            s[i] = v;
            lanes[0] = std::fma(v, c[i], lanes[0]);
        }
        float dot = 0.f;
        for (int l = 0; l < kLanes; ++l) dot += lanes[l];
        y[q] = dot + unfused(xv * m.D[h]);
    }
}

// Phase 3: `out` [inner] = weight * rms_norm_per_group(y * silu(gate)), gate the first `inner` of `proj`; the
// normalized values rounded to T before the weight's product, which is rounded again (the eager layer's).
template <typename T>
void mamba_norm_row(const MambaSpec& m, const float* proj, const float* y, float* out) {
    const int64_t inner = m.inner(), width = inner / m.groups;
    std::copy(proj, proj + inner, out);
    silu_row(out, inner);
    for (int64_t i = 0; i < inner; ++i) out[i] = y[i] * out[i];
    for (int64_t g = 0; g < m.groups; ++g) {
        float* h = out + g * width;
        float lanes[16] = {};
        int64_t i = 0;
        for (; i + 16 <= width; i += 16)
            for (int l = 0; l < 16; ++l) lanes[l] = std::fma(h[i + l], h[i + l], lanes[l]);
        for (; i < width; ++i) lanes[0] = std::fma(h[i], h[i], lanes[0]);
        float sum = 0.f;
        for (int l = 0; l < 16; ++l) sum += lanes[l];
        const float rs = 1.f / std::sqrt(sum / static_cast<float>(width) + m.eps);
        for (int64_t j = 0; j < width; ++j) h[j] = round_as<T>(m.norm[g * width + j] * round_as<T>(h[j] * rs));
    }
}

}  // namespace conveyor
