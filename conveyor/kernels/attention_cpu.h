// Decode attention for one query head over a request's cached K/V rows, read from the pages in
// place (fp32 or bf16 rows widened to fp32; scores, softmax and sums in fp32). Shared by the paged
// decode kernel and the native decode stack.
#pragma once

#include <torch/extension.h>

#include <immintrin.h>

#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace conveyor {

using bf16 = at::BFloat16;

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) { return static_cast<float>(x); }  // a 16-bit shift

// 8 floats: one AVX register (GCC/Clang vector extension, portable). Decode is bound by memory
// bandwidth, so 8-wide strips are enough, and the fp32 path keeps its summation order.
typedef float vec8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

inline vec8 load8(const float* p) {
    vec8 v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

inline vec8 load8(const bf16* p) {
    u16x8 h;
    std::memcpy(&h, p, sizeof h);
    const u32x8 w = __builtin_convertvector(h, u32x8) << 16;
    vec8 v;
    std::memcpy(&v, &w, sizeof v);
    return v;
}

inline float hsum8(vec8 v) { return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7])); }

// s[t] = q . rows[t][off:off+D] for every token t; D a multiple of 8.
template <typename T>
void head_scores(const float* q, const T* const* rows, int64_t off, int64_t len, int64_t D, float* s) {
    int64_t t = 0;
    for (; t + 4 <= len; t += 4) {
        const T *r0 = rows[t] + off, *r1 = rows[t + 1] + off, *r2 = rows[t + 2] + off, *r3 = rows[t + 3] + off;
        vec8 a0 = {}, a1 = {}, a2 = {}, a3 = {};
        for (int64_t d = 0; d < D; d += 8) {
            const vec8 qv = load8(q + d);
            a0 += qv * load8(r0 + d);
            a1 += qv * load8(r1 + d);
            a2 += qv * load8(r2 + d);
            a3 += qv * load8(r3 + d);
        }
        s[t] = hsum8(a0);
        s[t + 1] = hsum8(a1);
        s[t + 2] = hsum8(a2);
        s[t + 3] = hsum8(a3);
    }
    for (; t < len; ++t) {
        vec8 a = {};
        for (int64_t d = 0; d < D; d += 8) a += load8(q + d) * load8(rows[t] + off + d);
        s[t] = hsum8(a);
    }
}

// out[0:D] = sum_t p[t] * rows[t][off:off+D]; D a multiple of 8. Strips of 32 (or 8) outputs stay
// in registers over the whole loop on t.
template <typename T>
void head_output(const float* p, const T* const* rows, int64_t off, int64_t len, int64_t D, float* out) {
    int64_t d0 = 0;
    for (; d0 + 32 <= D; d0 += 32) {
        vec8 a0 = {}, a1 = {}, a2 = {}, a3 = {};
        for (int64_t t = 0; t < len; ++t) {
            const T* v = rows[t] + off + d0;
            const float w = p[t];
            a0 += w * load8(v);
            a1 += w * load8(v + 8);
            a2 += w * load8(v + 16);
            a3 += w * load8(v + 24);
        }
        std::memcpy(out + d0, &a0, sizeof a0);
        std::memcpy(out + d0 + 8, &a1, sizeof a1);
        std::memcpy(out + d0 + 16, &a2, sizeof a2);
        std::memcpy(out + d0 + 24, &a3, sizeof a3);
    }
    for (; d0 < D; d0 += 8) {
        vec8 a = {};
        for (int64_t t = 0; t < len; ++t) a += p[t] * load8(rows[t] + off + d0);
        std::memcpy(out + d0, &a, sizeof a);
    }
}

// Pointers to the K and V rows (every kv head of a token) of a request's first `len` positions.
template <typename T>
void context_rows(const T* kp, const T* vp, const int64_t* table, int64_t len, int64_t page_size, int64_t row,
                  std::vector<const T*>& krows, std::vector<const T*>& vrows) {
    krows.resize(len);
    vrows.resize(len);
    for (int64_t t = 0; t < len; ++t) {
        const int64_t slot = table[t / page_size] * page_size + t % page_size;
        krows[t] = kp + slot * row;
        vrows[t] = vp + slot * row;
    }
}

// out[0:D] = softmax(scale * q . K) V for one query head whose kv head starts at `off` within a row;
// `cap` > 0 soft-caps the scores (tanh(s / cap) * cap). `s` holds `len` floats of scratch.
template <typename T>
void attend_head(const float* q, const T* const* krows, const T* const* vrows, int64_t off, int64_t len, int64_t D,
                 float scale, float cap, float* s, float* out) {
    const bool vectorized = D % 8 == 0;
    if (vectorized) {
        head_scores(q, krows, off, len, D, s);
    } else {
        for (int64_t t = 0; t < len; ++t) {
            float dot = 0.f;
            for (int64_t d = 0; d < D; ++d) dot += q[d] * to_float(krows[t][off + d]);
            s[t] = dot;
        }
    }
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < len; ++t) {
        const float score = s[t] * scale;
        s[t] = cap > 0.f ? std::tanh(score / cap) * cap : score;
        mx = std::max(mx, s[t]);
    }
    float sum = 0.f;
    for (int64_t t = 0; t < len; ++t) sum += (s[t] = std::exp(s[t] - mx));
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < len; ++t) s[t] *= inv;
    if (vectorized) {
        head_output(s, vrows, off, len, D, out);
    } else {
        for (int64_t d = 0; d < D; ++d) {
            float acc = 0.f;
            for (int64_t t = 0; t < len; ++t) acc += s[t] * to_float(vrows[t][off + d]);
            out[d] = acc;
        }
    }
}

// The G query heads that share one kv head (GQA), over one request's rows: q [G, D] and out [G, D]
// contiguous, `s` G * len floats of scratch. Each K and V row is read (and widened) once for all G
// heads. AVX-512 where D is a multiple of 16 and G <= 4 and there is no soft-capping; else head by head.
template <typename T>
void attend_group(const float* q, const T* const* krows, const T* const* vrows, int64_t off, int64_t len, int64_t D,
                  int64_t G, float scale, float cap, float* s, float* out) {
#if defined(__AVX512F__)
    constexpr int64_t kMaxG = 4, kMaxJ = 8;  // up to 4 heads and D = 128 in registers
    if (D % 16 == 0 && D / 16 <= kMaxJ && G <= kMaxG && cap <= 0.f) {
        const int64_t J = D / 16;
        __m512 qv[kMaxG][kMaxJ];
        for (int64_t g = 0; g < G; ++g)
            for (int64_t j = 0; j < J; ++j) qv[g][j] = _mm512_mul_ps(_mm512_loadu_ps(q + g * D + 16 * j), _mm512_set1_ps(scale));
        for (int64_t t = 0; t < len; ++t) {
            __m512 k[kMaxJ];
            for (int64_t j = 0; j < J; ++j) k[j] = load16(krows[t] + off + 16 * j);
            for (int64_t g = 0; g < G; ++g) {
                __m512 acc = _mm512_mul_ps(qv[g][0], k[0]);
                for (int64_t j = 1; j < J; ++j) acc = _mm512_fmadd_ps(qv[g][j], k[j], acc);
                s[g * len + t] = _mm512_reduce_add_ps(acc);
            }
        }
        for (int64_t g = 0; g < G; ++g) {
            float* sg = s + g * len;
            __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
            int64_t t = 0;
            for (; t + 16 <= len; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sg + t));
            float m = _mm512_reduce_max_ps(mx);
            for (; t < len; ++t) m = std::max(m, sg[t]);
            __m512 sum = _mm512_setzero_ps();
            const __m512 mv = _mm512_set1_ps(m);
            for (t = 0; t + 16 <= len; t += 16) {
                const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + t), mv));
                _mm512_storeu_ps(sg + t, e);
                sum = _mm512_add_ps(sum, e);
            }
            if (t < len) {
                const __mmask16 mask = static_cast<__mmask16>((1u << (len - t)) - 1);
                const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, sg + t), mv));
                _mm512_mask_storeu_ps(sg + t, mask, e);
                sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(mask, e));
            }
            const float inv = 1.f / _mm512_reduce_add_ps(sum);
            for (t = 0; t < len; ++t) sg[t] *= inv;
        }
        __m512 acc[kMaxG][kMaxJ];
        for (int64_t g = 0; g < G; ++g)
            for (int64_t j = 0; j < J; ++j) acc[g][j] = _mm512_setzero_ps();
        for (int64_t t = 0; t < len; ++t) {
            __m512 v[kMaxJ];
            for (int64_t j = 0; j < J; ++j) v[j] = load16(vrows[t] + off + 16 * j);
            for (int64_t g = 0; g < G; ++g) {
                const __m512 p = _mm512_set1_ps(s[g * len + t]);
                for (int64_t j = 0; j < J; ++j) acc[g][j] = _mm512_fmadd_ps(p, v[j], acc[g][j]);
            }
        }
        for (int64_t g = 0; g < G; ++g)
            for (int64_t j = 0; j < J; ++j) _mm512_storeu_ps(out + g * D + 16 * j, acc[g][j]);
        return;
    }
#endif
    for (int64_t g = 0; g < G; ++g) attend_head(q + g * D, krows, vrows, off, len, D, scale, cap, s, out + g * D);
}

// prefill_attention_cpu.cpp: every prefill chunk's rows into `out`, before the pass writes the new K/V.
void paged_prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor kv_cache,
                             torch::Tensor ctx_slots, torch::Tensor chunks, int64_t window, double scale,
                             double softcap, torch::Tensor out);
int64_t prefill_vector_width();

}  // namespace conveyor
