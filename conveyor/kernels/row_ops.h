// The per-row arithmetic of the Llama layer's elementwise ops (RMSNorm, rotate-half RoPE, SiLU * up),
// written once for the fused ops the eager layers call (fused_cpu.cpp) and for the native decode stack
// (decode_stack_cpu.cpp), so that a token's row gets the same bits on either path: T is the model's
// activation dtype, and in bf16 each op rounds where the PyTorch bf16 sequence it replaces rounds
// (values may be held in fp32 arrays, bf16-exact, as the stack holds them). A product that feeds an add
// passes through `unfused`, so no build fuses the two into one multiply-add (the stack's extension is
// built with contraction on, the fused ops' without).
#pragma once

#include "vec_math.h"

#include <cmath>
#include <cstdint>
#include <type_traits>

namespace conveyor {

// x rounded to T, as a PyTorch op on T-typed tensors rounds its result (round to nearest even).
template <typename T>
inline float round_as(float x) {
    if constexpr (std::is_same_v<T, float>) return x;
    else return static_cast<float>(bf16(x));
}

// x[0:n] rounded to T in place where T is bf16 (what a bf16 tensor holds); fp32 keeps it.
template <typename T>
inline void round_row(float* x, int64_t n) {
    if constexpr (std::is_same_v<T, float>) return;
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, round_bf16(_mm512_loadu_ps(x + i)));
#endif
    for (; i < n; ++i) x[i] = round_as<T>(x[i]);
}

// x, opaque to the optimizer: the product it holds is not fused into the add that uses it.
inline float unfused(float x) {
    asm("" : "+x"(x));
    return x;
}
#if defined(__AVX2__)
inline __m256 unfused(__m256 x) {
    asm("" : "+x"(x));
    return x;
}
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
#endif
#if defined(__AVX512F__)
inline __m512 unfused(__m512 x) {
    asm("" : "+v"(x));
    return x;
}
#endif

// x = x + r over a row of n, rounded to T (bf16: the fp32 sum rounded once, as PyTorch's bf16 add).
template <typename T>
inline void add_row(T* x, const T* r, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) store16(x + i, _mm512_add_ps(load16(x + i), load16(r + i)));
#endif
    for (; i < n; ++i) x[i] = T(to_float(x[i]) + to_float(r[i]));
}

// out = weight * (x * rsqrt(mean(x^2) + eps)) over a row of n, as transformers' LlamaRMSNorm: the
// statistics in fp32 (the sum of squares in 8 interleaved partial sums), the normalized x rounded to T
// before the product with the weight.
template <typename T, typename In, typename Out>
inline void rms_norm_row(const In* x, const In* w, int64_t n, float eps, Out* out) {
    constexpr bool bf = std::is_same_v<T, bf16>;
    float part[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    int64_t i = 0;
#if defined(__AVX2__)
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 v = load8(x + i);
        acc = _mm256_add_ps(acc, unfused(_mm256_mul_ps(v, v)));
    }
    _mm256_storeu_ps(part, acc);
#else
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; ++l) part[l] = part[l] + unfused(to_float(x[i + l]) * to_float(x[i + l]));
#endif
    float ss = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
    for (; i < n; ++i) ss = ss + unfused(to_float(x[i]) * to_float(x[i]));
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
    int64_t j = 0;
#if defined(__AVX512F__)
    const __m512 iv = _mm512_set1_ps(inv);
    for (; j + 16 <= n; j += 16) {
        __m512 v = _mm512_mul_ps(load16(x + j), iv);
        if constexpr (bf) v = round_bf16(v);
        __m512 y = _mm512_mul_ps(load16(w + j), v);
        if constexpr (bf && !std::is_same_v<Out, bf16>) y = round_bf16(y);  // (a bf16 store rounds itself)
        store16(out + j, y);
    }
#endif
    for (; j < n; ++j) out[j] = Out(round_as<T>(to_float(w[j]) * round_as<T>(to_float(x[j]) * inv)));
}

// Rotate-half RoPE in place on one head of D values, v = v * c + rotate_half(v) * s (c, s: D values);
// in bf16 each product and the sum round to bf16, as the PyTorch expression does.
template <typename T, typename V, typename C>
inline void rope_head(V* v, const C* c, const C* s, int64_t D) {
    constexpr bool bf = std::is_same_v<T, bf16>;
    const int64_t half = D / 2;
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i < half; i += 16) {
        const __mmask16 m = static_cast<__mmask16>(half - i >= 16 ? 0xFFFF : (1u << (half - i)) - 1);
        const __m512 x1 = load16(v + i, m), x2 = load16(v + half + i, m);
        const __m512 c1 = load16(c + i, m), c2 = load16(c + half + i, m);
        const __m512 s1 = load16(s + i, m), s2 = load16(s + half + i, m);
        __m512 a = _mm512_mul_ps(x1, c1), b = _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2), s1);
        __m512 e = _mm512_mul_ps(x2, c2), f = _mm512_mul_ps(x1, s2);
        if constexpr (bf) a = round_bf16(a), b = round_bf16(b), e = round_bf16(e), f = round_bf16(f);
        __m512 lo = _mm512_add_ps(unfused(a), unfused(b)), hi = _mm512_add_ps(unfused(e), unfused(f));
        if constexpr (bf && !std::is_same_v<V, bf16>) lo = round_bf16(lo), hi = round_bf16(hi);  // (as above)
        store16(v + i, lo, m);
        store16(v + half + i, hi, m);
    }
#endif
    for (; i < half; ++i) {
        const float x1 = to_float(v[i]), x2 = to_float(v[i + half]);
        v[i] = V(round_as<T>(unfused(round_as<T>(x1 * to_float(c[i]))) + unfused(round_as<T>((-x2) * to_float(s[i])))));
        v[i + half] = V(round_as<T>(unfused(round_as<T>(x2 * to_float(c[i + half]))) +
                                    unfused(round_as<T>(x1 * to_float(s[i + half])))));
    }
}

// o = silu(g) * u over n values, in fp32, rounded once to T (a vector e^x where the target has one).
template <typename T, typename In, typename Out>
inline void silu_mul_row(const In* g, const In* u, int64_t n, Out* o) {
    constexpr bool bf = std::is_same_v<T, bf16>;
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 one = _mm512_set1_ps(1.f);
    for (; i + 16 <= n; i += 16) {
        const __m512 gi = load16(g + i);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gi));
        __m512 y = _mm512_mul_ps(_mm512_div_ps(gi, _mm512_add_ps(one, e)), load16(u + i));
        if constexpr (bf && !std::is_same_v<Out, bf16>) y = round_bf16(y);  // (a bf16 store rounds itself)
        store16(o + i, y);
    }
#elif defined(__AVX2__) && defined(__FMA__)
    if constexpr (!bf && std::is_same_v<In, float> && std::is_same_v<Out, float>) {
        const __m256 one = _mm256_set1_ps(1.f);
        for (; i + 8 <= n; i += 8) {
            const __m256 gi = _mm256_loadu_ps(g + i);
            const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gi));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gi, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
        }
    }
#endif
    for (; i < n; ++i) {
        const float gi = to_float(g[i]);
        o[i] = Out(round_as<T>(gi / (1.f + std::exp(-gi)) * to_float(u[i])));
    }
}

}  // namespace conveyor
