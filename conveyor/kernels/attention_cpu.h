// Decode attention for one query head over a request's cached K/V rows, read from the pages in
// place (fp32 or bf16 rows widened to fp32; scores, softmax and sums in fp32). Shared by the paged
// decode kernel and the native decode stack.
#pragma once

#include <torch/extension.h>

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

}  // namespace conveyor
