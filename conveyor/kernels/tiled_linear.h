// A linear layer as the native layer code holds it (the decode stack, the grouped experts): row
// segments of one weight in the kernels' tiles, each a quantized type or dense, and the activations
// between the MLP's two products (SiLU * up; gpt-oss's clamped SwiGLU).
#pragma once

#include "quant.h"
#include "vec_math.h"

#include <algorithm>
#include <cmath>

namespace conveyor {

// One row segment of a weight as the caller passes it (kernels/matmul_ops.py, which keeps the tensors
// alive): tiles of a quantized type or dense, their row scales (I8; nullptr if none), its rows.
struct SegmentSpec {
    const uint8_t* data;
    const float* scales;
    int64_t type, rows;
};

// One row segment of a linear: rows [n0, n0 + rows) of the output, in the kernels' tiles (a quantized
// type or BF16).
struct Segment {
    const uint8_t* data;
    const float* scales;
    int64_t type, rows, n0;
    int64_t tiles() const { return (rows + kTileRows - 1) / kTileRows; }
};

struct Linear {
    std::vector<Segment> segments;
    std::vector<float> bias;  // fp32 [N] or empty
    int64_t N = 0, K = 0;
    bool quantized = false, floats = false;  // what its input must be prepared as: int8 blocks, packed fp32

    // Segments in output order.
    void add_segments(const SegmentSpec* parts, int64_t count) {
        for (int64_t i = 0; i < count; ++i) {
            const SegmentSpec& t = parts[i];
            CONVEYOR_CHECK(is_kernel_type(t.type), "no kernel takes weight type ", t.type);
            segments.push_back(Segment{t.data, t.scales, t.type, t.rows, N});
            N += t.rows;
            (is_dense(t.type) ? floats : quantized) = true;
        }
    }
    // An fp32 bias [N] (nullptr: none), copied.
    void set_bias(const float* b) {
        if (b) bias.assign(b, b + N);
    }
    int64_t tiles() const {
        int64_t n = 0;
        for (const Segment& s : segments) n += s.tiles();
        return n;
    }
    // Rows [m0, m1) of x (fp32, ldx apart) into `a` as this linear's input (shaped for them already).
    void prepare(const float* x, int64_t ldx, int64_t m0, int64_t m1, Activations& a) const {
        if (quantized) quantize_rows(x, ldx, m0, m1, a);
        if (floats) pack_float_rows(x, ldx, m0, m1, a);
    }
    void shape(Activations& a, int64_t rows) const {
        if (quantized) a.shape(rows, K);
        if (floats) a.shape_floats(rows, K);
    }
    // Tiles [u0, u1) of the whole weight (counted across the segments): out [M, N] (row stride ldo).
    void run_tiles(const Activations& a, float* out, int64_t ldo, int64_t u0, int64_t u1) const {
        int64_t first = 0;
        for (const Segment& s : segments) {
            const int64_t lo = std::max(u0 - first, int64_t{0}), hi = std::min(u1 - first, s.tiles());
            if (lo < hi)
                tiles_matmul(s.type, s.data, s.scales, a, lo, hi, s.rows, TileOut{out + s.n0, ldo});
            first += s.tiles();
        }
    }
    // This thread's share of every segment: out [M, N] (row stride ldo) from the prepared input `a`.
    void run(const Activations& a, float* out, int64_t ldo, int thread, int threads) const {
        for (const Segment& s : segments) {
            const int64_t u = s.tiles(), u0 = u * thread / threads, u1 = u * (thread + 1) / threads;
            if (u0 == u1) continue;
            tiles_matmul(s.type, s.data, s.scales, a, u0, u1, s.rows, TileOut{out + s.n0, ldo});
        }
    }
    void add_bias_row(float* row) const {
        for (size_t n = 0; n < bias.size(); ++n) row[n] += bias[n];
    }
};

// a = silu(gate) * up, with a vector e^x (per element libm expf calls took ~6% of a 64-row step).
inline void silu_mul(const float* gate, const float* up, int64_t n, float* a) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) {
        const __m512 g = _mm512_loadu_ps(gate + i);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
        _mm512_storeu_ps(a + i, _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)), _mm512_loadu_ps(up + i)));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
        _mm256_storeu_ps(a + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e)), _mm256_loadu_ps(up + i)));
    }
#endif
    for (; i < n; ++i) a[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
}

// gpt-oss's clamped SwiGLU (transformers' `GptOssExperts._apply_gate`): g = min(gate, limit), u =
// clamp(up, -limit, limit), a = (u + 1) * (g * sigmoid(g * alpha)); the sigmoid as 1 / (1 + e^-x) with
// the vector e^x.
inline void clamped_swiglu(const float* gate, const float* up, int64_t n, float alpha, float limit, float* a) {
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 lim = _mm512_set1_ps(limit), nlim = _mm512_set1_ps(-limit), one = _mm512_set1_ps(1.f);
    for (; i + 16 <= n; i += 16) {
        const __m512 g = _mm512_min_ps(_mm512_loadu_ps(gate + i), lim);
        const __m512 u = _mm512_max_ps(_mm512_min_ps(_mm512_loadu_ps(up + i), lim), nlim);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(g, _mm512_set1_ps(alpha))));
        const __m512 glu = _mm512_mul_ps(g, _mm512_div_ps(one, _mm512_add_ps(one, e)));
        _mm512_storeu_ps(a + i, _mm512_mul_ps(_mm512_add_ps(u, one), glu));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256 lim = _mm256_set1_ps(limit), nlim = _mm256_set1_ps(-limit), one = _mm256_set1_ps(1.f);
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_min_ps(_mm256_loadu_ps(gate + i), lim);
        const __m256 u = _mm256_max_ps(_mm256_min_ps(_mm256_loadu_ps(up + i), lim), nlim);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(g, _mm256_set1_ps(alpha))));
        const __m256 glu = _mm256_mul_ps(g, _mm256_div_ps(one, _mm256_add_ps(one, e)));
        _mm256_storeu_ps(a + i, _mm256_mul_ps(_mm256_add_ps(u, one), glu));
    }
#endif
    for (; i < n; ++i) {
        const float g = std::min(gate[i], limit), u = std::max(std::min(up[i], limit), -limit);
        a[i] = (u + 1.f) * (g * (1.f / (1.f + std::exp(-(g * alpha)))));
    }
}

}  // namespace conveyor
