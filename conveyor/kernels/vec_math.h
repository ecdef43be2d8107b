// Vectorized math shared by the CPU kernels, in two forms. Fixed width, for code written per
// instruction set: fp32 loads and stores of fp32 or bf16 data (`load16`, `store16`, `to_bf16`,
// `round_bf16`) and e^x (`exp16`, `exp8`). Any width, for code written once for every target:
// `vecw` is W floats, one zmm register where the compiler targets AVX-512 (W = 16), else W = 8 (one
// ymm on AVX2, a pair of xmm on plain x86-64), as GCC/Clang vector extensions, with the fixed-width
// forms underneath where the target has them (the reductions' shuffles are picked by the compiler).
#pragma once

#include "runtime.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

namespace conveyor {

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {  // bf16 -> fp32 is a 16-bit shift, exact
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const bf16* p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// fp32 -> bf16, rounded to nearest even as `bf16` rounds (NaN stays NaN).
inline __m256i to_bf16(__m512 v) {
#if defined(__AVX512BF16__)
    return (__m256i)_mm512_cvtneps_pbh(v);
#else
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(rounded);
#endif
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(bf16* p, __m512 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(v)); }
inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16(bf16* p, __m512 v, __mmask16 m) { _mm256_mask_storeu_epi16(p, m, to_bf16(v)); }

// v rounded to bf16 and widened back: what a PyTorch bf16 op's result holds.
inline __m512 round_bf16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(v)), 16));
}

// e^x to ~1 ulp (Cephes expf: n = round(x / ln 2), a degree-5 polynomial on the remainder).
inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
    const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(y, n);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// The same e^x, 8 lanes: 2^n built in the exponent bits (x clamped to where it is a normal float).
inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

#ifdef __AVX512F__
constexpr int W = 16;
#else
constexpr int W = 8;
#endif
typedef float vecw __attribute__((vector_size(W * 4)));
typedef int32_t ivecw __attribute__((vector_size(W * 4)));
typedef uint32_t uvecw __attribute__((vector_size(W * 4)));
typedef uint16_t hvecw __attribute__((vector_size(W * 2)));
typedef int8_t bvecw __attribute__((vector_size(W)));

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) { return static_cast<float>(x); }  // a 16-bit shift
inline float to_float(int8_t x) { return static_cast<float>(x); }  // an int8 KV value (exact)

constexpr int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

inline vecw loadw(const float* p) {
    vecw v;
    std::memcpy(&v, p, sizeof v);
    return v;
}
inline vecw loadw(const bf16* p) {  // W bf16 widened: zero-extend to 32 bits, shift into the high half
#ifdef __AVX512F__  // one vpmovzxwd (the generic form below becomes two halves and an insert)
    return vecw(load16(p));
#else
    hvecw h;
    std::memcpy(&h, p, sizeof h);
    const uvecw w = __builtin_convertvector(h, uvecw) << 16;
    vecw v;
    std::memcpy(&v, &w, sizeof v);
    return v;
#endif
}
inline vecw loadw(const int8_t* p) {  // W int8 values as floats (exact): sign-extend, convert
#if defined(__AVX512F__)
    return vecw(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(__AVX2__)
    return vecw(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
    bvecw b;
    std::memcpy(&b, p, sizeof b);
    return __builtin_convertvector(__builtin_convertvector(b, ivecw), vecw);
#endif
}
inline void storew(float* p, vecw v) { std::memcpy(p, &v, sizeof v); }
inline vecw splat(float x) {  // a broadcast (`vecw{} + x` would add 0 first: signed zeros)
#if defined(__AVX512F__)
    return vecw(_mm512_set1_ps(x));
#elif defined(__AVX__)
    return vecw(_mm256_set1_ps(x));
#else
    return vecw{x, x, x, x, x, x, x, x};
#endif
}
inline vecw select(ivecw mask, vecw a, vecw b) { return mask ? a : b; }

// a * b + c, rounded once where the target has fused multiply-adds, else rounded twice: the same in
// both forms, so code that must round alike everywhere (attention's per-row arithmetic) says which
// it takes instead of leaving it to the compiler's contraction.
inline vecw fmadd(vecw a, vecw b, vecw c) {
#if defined(__AVX512F__)
    return vecw(_mm512_fmadd_ps(__m512(a), __m512(b), __m512(c)));
#elif defined(__FMA__)
    return vecw(_mm256_fmadd_ps(__m256(a), __m256(b), __m256(c)));
#else
    const vecw p = a * b;
    return p + c;
#endif
}
inline float fmadd(float a, float b, float c) {
#if defined(__FMA__)
    return __builtin_fmaf(a, b, c);
#else
    const float p = a * b;
    return p + c;
#endif
}
inline vecw vmax(vecw a, vecw b) { return select(a > b, a, b); }
inline bool any(ivecw mask) {  // some lane set (a comparison's result: all bits or none)
    ivecw zero = {};
    return std::memcmp(&mask, &zero, sizeof mask) != 0;
}

// acc + each lane's four byte products, unsigned bytes of a times signed bytes of b: VNNI's
// vpdpbusd where the target has it (one instruction for 4W multiply-adds), else the same sums in
// plain integer lanes. Exact either way (no saturation), so every target gets the same integers.
inline ivecw dot_quads(ivecw acc, ivecw a, ivecw b) {
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
    return ivecw(_mm512_dpbusd_epi32(__m512i(acc), __m512i(a), __m512i(b)));
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return ivecw(_mm256_dpbusd_epi32(__m256i(acc), __m256i(a), __m256i(b)));
#elif defined(__AVXVNNI__)
    return ivecw(_mm256_dpbusd_avx_epi32(__m256i(acc), __m256i(a), __m256i(b)));
#else
    for (int k = 0; k < 4; ++k) acc += ((a >> (8 * k)) & 0xff) * ((b << (24 - 8 * k)) >> 24);
    return acc;
#endif
}

// acc + each lane's two 16-bit products, signed halves of a times signed halves of b: VNNI's vpdpwssd
// where the target has it, else vpmaddwd and an add (the same sums where no product is -32768
// squared, vpmaddwd's one overflow), else plain integer lanes.
inline ivecw dot_pairs(ivecw acc, ivecw a, ivecw b) {
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
    return ivecw(_mm512_dpwssd_epi32(__m512i(acc), __m512i(a), __m512i(b)));
#elif defined(__AVX512BW__) && defined(__AVX512F__)
    return acc + ivecw(_mm512_madd_epi16(__m512i(a), __m512i(b)));
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return ivecw(_mm256_dpwssd_epi32(__m256i(acc), __m256i(a), __m256i(b)));
#elif defined(__AVXVNNI__)
    return ivecw(_mm256_dpwssd_avx_epi32(__m256i(acc), __m256i(a), __m256i(b)));
#elif defined(__AVX2__)
    return acc + ivecw(_mm256_madd_epi16(__m256i(a), __m256i(b)));
#else
    return acc + ((a << 16) >> 16) * ((b << 16) >> 16) + (a >> 16) * (b >> 16);
#endif
}
// Whether the CPU multiplies bf16 pairs (AVX512-BF16's vdpbf16ps): the attention kernels then take bf16
// keys as pairs (`kBf16Pairs`, attention_blocks.h); elsewhere they widen them to fp32.
#if defined(__AVX512BF16__) && defined(__AVX512F__)
constexpr bool kBf16Dot = true;
// acc + each lane's bf16 pair of a times the bf16 pair b (the same for every lane): the high halves'
// product, then the low halves', each a fused multiply-add (a product of two bf16 values is exact in
// fp32; vdpbf16ps also flushes subnormals, which bf16 attention inputs are not).
inline vecw dot_bf16_pairs(vecw acc, uvecw a, uint32_t b) {
    return vecw(_mm512_dpbf16_ps(__m512(acc), (__m512bh)__m512i(a), (__m512bh)_mm512_set1_epi32(static_cast<int>(b))));
}
#else
constexpr bool kBf16Dot = false;
vecw dot_bf16_pairs(vecw acc, uvecw a, uint32_t b);  // declared for the kernels' discarded branches only
#endif
inline ivecw splat_i(int32_t x) { return ivecw{} + x; }  // a broadcast (integers: adding 0 is exact)

// e^x for x <= 0 (`exp16`/`exp8` where the target has them: the same Cephes expf, x = n ln2 + r,
// |r| <= ln2 / 2, a degree-5 polynomial in r), x clamped at -87 (e^-87 ~ 1.6e-38: nothing next to
// the row max's 1).
inline vecw vexp(vecw x) {
#if defined(__AVX512F__)
    return vecw(exp16(__m512(x)));
#elif defined(__AVX2__) && defined(__FMA__)
    return vecw(exp8(__m256(x)));
#else
    x = vmax(x, splat(-87.f));
    const vecw nv = (x * 1.44269504f + 12582912.f) - 12582912.f;  // round to nearest
    const vecw r = (x - nv * 0.693359375f) - nv * -2.12194440e-4f;
    vecw p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const vecw y = p * r * r + r + 1.f;
    const ivecw bits = (__builtin_convertvector(nv, ivecw) + 127) << 23;
    vecw scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return y * scale;
#endif
}

// tanh to a few ulp (Cephes tanhf): an odd polynomial below 0.625, (1 - e^-2|x|) / (1 + e^-2|x|) above.
inline vecw vtanh(vecw x) {
    const vecw ax = select(x < 0.f, -x, x), z = x * x;
    const vecw e = vexp(-2.f * ax);
    const vecw big = (1.f - e) / (1.f + e);
    const vecw small = ((((-5.70498872745e-3f * z + 2.06390887954e-2f) * z - 5.37397155531e-2f) * z +
                         1.33314422036e-1f) * z - 3.33332819422e-1f) * z * x + x;
    return select(ax < 0.625f, small, select(x < 0.f, -big, big));
}

inline float lane_max(vecw v) {  // exact in any order
#if defined(__AVX512F__)
    return _mm512_reduce_max_ps(__m512(v));
#else
    float m = v[0];
    for (int i = 1; i < W; ++i) m = m > v[i] ? m : v[i];
    return m;
#endif
}

// The largest of x[0:n) (-inf for none); a NaN never wins, as in std::max(mx, x[i]).
inline float row_max(const float* x, int64_t n) {
    vecw acc = splat(-INFINITY);
    int64_t i = 0;
    for (; i + W <= n; i += W) acc = vmax(loadw(x + i), acc);  // acc where x is NaN
    float mx = lane_max(acc);
    for (; i < n; ++i) mx = std::max(mx, x[i]);
    return mx;
}

namespace detail {
// One step of `transpose`: swaps bit S of the row index with bit S of the lane index between rows a
// and b = a's row + S (lanes j with bit S set of a trade places with lanes j - S of b).
template <int S, int... L>
inline void swap_blocks(vecw& a, vecw& b, std::integer_sequence<int, L...>) {
    const vecw x = __builtin_shufflevector(a, b, ((L & S) ? W + L - S : L)...);
    const vecw y = __builtin_shufflevector(a, b, ((L & S) ? W + L : L + S)...);
    a = x;
    b = y;
}
template <int S>
inline void transpose_steps(vecw* r) {
    for (int i = 0; i < W; ++i)
        if (!(i & S)) swap_blocks<S>(r[i], r[i + S], std::make_integer_sequence<int, W>{});
    if constexpr (S > 1) transpose_steps<S / 2>(r);
}
}  // namespace detail

// r[i][j] <- r[j][i] for a W x W block held as W vectors (W log2 W two-vector shuffles). With AVX-512,
// in-lane unpacks and shuffles first, then 128-bit lane shuffles (what GCC makes of the generic steps
// is two-source permutes, slower on AMD's Zen 4).
inline void transpose(vecw* r) {
#if defined(__AVX512F__)
    __m512 t[16], u[16];
    // t[2k], t[2k + 1]: rows 2k, 2k + 1 interleaved, entries 0-1 and 2-3 of each lane
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(__m512(r[i]), __m512(r[i + 1]));
        t[i + 1] = _mm512_unpackhi_ps(__m512(r[i]), __m512(r[i + 1]));
    }
    for (int i = 0; i < 16; i += 4) {  // u[4g + e]: 128-bit lane c holds entry 4c + e of rows 4g .. 4g + 3
        u[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
        u[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int e = 0; e < 4; ++e) {
        const __m512 a = _mm512_shuffle_f32x4(u[e], u[4 + e], 0x88);
        const __m512 b = _mm512_shuffle_f32x4(u[e], u[4 + e], 0xDD);
        const __m512 c = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0x88);
        const __m512 d = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0xDD);
        r[e] = vecw(_mm512_shuffle_f32x4(a, c, 0x88));
        r[4 + e] = vecw(_mm512_shuffle_f32x4(b, d, 0x88));
        r[8 + e] = vecw(_mm512_shuffle_f32x4(a, c, 0xDD));
        r[12 + e] = vecw(_mm512_shuffle_f32x4(b, d, 0xDD));
    }
#else
    detail::transpose_steps<W / 2>(r);
#endif
}

}  // namespace conveyor
