// Per-row kernels for the K-quants (Q4_K, Q6_K), which keep GGUF's own super-block layout, and
// dequantization of GGUF-layout rows (ggml's dequantize_row_* semantics).
//
// Each output row is dotted with up to 8 activation rows at a time: the weight block is unpacked
// once, then one integer dot product per activation row (VNNI where the CPU has it, else AVX2's
// vpmaddubsw + vpmaddwd, else plain C++). The 6-bit and 4-bit values are unsigned (Q6_K's -32 is
// taken back with the activations' half-block sums), so the AVX2 pair sums cannot saturate.
#include "quant.h"

#include <cmath>
#include <cstring>

namespace conveyor {
namespace {

constexpr int kTile = 8;  // activation rows per pass over a weight row

// ---- 4-bit scale/min unpacking of Q4_K (ggml's get_scale_min_k4) --------------------------------
inline void scale_min_k4(int j, const uint8_t* q, uint8_t* sc, uint8_t* m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// ---- integer dot products of 32 bytes: 8 int32 lanes, lane i = bytes 4i..4i+3 --------------------
#if defined(__AVX2__)
#define CONVEYOR_SIMD 1
using vec = __m256i;

// u (unsigned, <= 63 so the AVX2 pair sums cannot saturate) times s (signed).
inline __m256i dot_us(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

inline __m256i load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

#endif

// Accumulators of one (weight row, activation tile) pass: a vector part and a scalar part per row.
template <int MB>
struct Acc {
#if defined(CONVEYOR_SIMD)
    __m256 v[MB];
#endif
    float s[MB];
    Acc() {
        for (int i = 0; i < MB; ++i) {
#if defined(CONVEYOR_SIMD)
            v[i] = _mm256_setzero_ps();
#endif
            s[i] = 0.f;
        }
    }
    float total(int i) const {
#if defined(CONVEYOR_SIMD)
        return hsum(v[i]) + s[i];
#else
        return s[i];
#endif
    }
};


// Scalar reference dot of 32 weights (as small ints) with activation block b of row m.
inline int idot32(const int* w, const int8_t* a) {
    int s = 0;
    for (int j = 0; j < QK; ++j) s += w[j] * a[j];
    return s;
}

template <int MB>
void row_q4_k(const uint8_t* row, const Activations& a, int64_t m0, float* out) {
    Acc<MB> acc;
    const int64_t nb = a.nb;
    auto* blocks = reinterpret_cast<const BlockQ4_K*>(row);
    for (int64_t sb = 0; sb < a.K / QK_K; ++sb) {
        const BlockQ4_K& blk = blocks[sb];
        const float d = half_to_float(blk.d), dmin = half_to_float(blk.dmin);
        float dsc[8], mmin[8];
        for (int j = 0; j < 8; ++j) {
            uint8_t sc, m;
            scale_min_k4(j, blk.scales, &sc, &m);
            dsc[j] = d * sc, mmin[j] = dmin * m;
        }
        for (int c = 0; c < 4; ++c) {
            const int64_t b = sb * 8 + 2 * c;  // activation block of the low nibbles; b + 1 the high ones
            const uint8_t* q = blk.qs + 32 * c;
#if defined(CONVEYOR_SIMD)
            const __m256i raw = load32(q), mask = _mm256_set1_epi8(0x0F);
            const __m256i lo = _mm256_and_si256(raw, mask), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
            for (int i = 0; i < MB; ++i) {
                const int64_t m = m0 + i;
                const float* ad = a.d.data() + m * nb + b;
                const __m256 d0 = _mm256_cvtepi32_ps(dot_us(lo, load32(a.qrow(m, b))));
                const __m256 d1 = _mm256_cvtepi32_ps(dot_us(hi, load32(a.qrow(m, b + 1))));
                acc.v[i] = _mm256_fmadd_ps(d0, _mm256_set1_ps(dsc[2 * c] * ad[0]), acc.v[i]);
                acc.v[i] = _mm256_fmadd_ps(d1, _mm256_set1_ps(dsc[2 * c + 1] * ad[1]), acc.v[i]);
                const float* s = a.s32.data() + m * nb + b;
                acc.s[i] -= mmin[2 * c] * s[0] + mmin[2 * c + 1] * s[1];
            }
#else
            int lo[QK], hi[QK];
            for (int l = 0; l < 32; ++l) lo[l] = q[l] & 0xF, hi[l] = q[l] >> 4;
            for (int i = 0; i < MB; ++i) {
                const int64_t m = m0 + i;
                const float* ad = a.d.data() + m * nb + b;
                const float* s = a.s32.data() + m * nb + b;
                acc.s[i] += dsc[2 * c] * ad[0] * idot32(lo, a.qrow(m, b)) +
                            dsc[2 * c + 1] * ad[1] * idot32(hi, a.qrow(m, b + 1)) -
                            (mmin[2 * c] * s[0] + mmin[2 * c + 1] * s[1]);
            }
#endif
        }
    }
    for (int i = 0; i < MB; ++i) out[i] = acc.total(i);
}

template <int MB>
void row_q6_k(const uint8_t* row, const Activations& a, int64_t m0, float* out) {
    Acc<MB> acc;
    const int64_t nb = a.nb;
    auto* blocks = reinterpret_cast<const BlockQ6_K*>(row);
    for (int64_t sb = 0; sb < a.K / QK_K; ++sb) {
        const BlockQ6_K& blk = blocks[sb];
        const float d = half_to_float(blk.d);
        for (int n = 0; n < 2; ++n) {
            const uint8_t* ql = blk.ql + 64 * n;
            const uint8_t* qh = blk.qh + 32 * n;
            const int8_t* sc = blk.scales + 8 * n;
#if defined(CONVEYOR_SIMD)
            const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03);
            const __m256i l0 = load32(ql), l1 = load32(ql + 32), h = load32(qh);
            __m256i q[4];  // elements 0-31, 32-63, 64-95, 96-127 of this half, as unsigned 6-bit values
            q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(h, m2), 4));
            q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), m2), 4));
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), m2), 4));
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), m2), 4));
            __m256 scv[4];  // lanes 0-3 cover the first 16 elements (scale sc[2k]), lanes 4-7 the next 16
            for (int k = 0; k < 4; ++k)
                scv[k] = _mm256_set_m128(_mm_set1_ps(d * sc[2 * k + 1]), _mm_set1_ps(d * sc[2 * k]));
            for (int i = 0; i < MB; ++i) {
                const int64_t m = m0 + i;
                float corr = 0.f;
                for (int k = 0; k < 4; ++k) {
                    const int64_t b = sb * 8 + 4 * n + k;
                    const __m256 dot = _mm256_cvtepi32_ps(dot_us(q[k], load32(a.qrow(m, b))));
                    acc.v[i] = _mm256_fmadd_ps(dot, _mm256_mul_ps(scv[k], _mm256_set1_ps(a.d[m * nb + b])), acc.v[i]);
                    const float* s = a.s16.data() + (m * nb + b) * 2;
                    corr += d * (sc[2 * k] * s[0] + sc[2 * k + 1] * s[1]);
                }
                acc.s[i] -= 32.f * corr;
            }
#else
            int q[4][QK];
            for (int l = 0; l < 32; ++l) {
                q[0][l] = (ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4);
                q[1][l] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
                q[2][l] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                q[3][l] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
            }
            for (int i = 0; i < MB; ++i) {
                const int64_t m = m0 + i;
                for (int k = 0; k < 4; ++k) {
                    const int64_t b = sb * 8 + 4 * n + k;
                    const int8_t* x = a.qrow(m, b);
                    int lo = 0, hi = 0;
                    for (int l = 0; l < 16; ++l) lo += q[k][l] * x[l], hi += q[k][l + 16] * x[l + 16];
                    const float* s = a.s16.data() + (m * nb + b) * 2;
                    acc.s[i] += d * a.d[m * nb + b] * (sc[2 * k] * lo + sc[2 * k + 1] * hi) -
                                32.f * d * (sc[2 * k] * s[0] + sc[2 * k + 1] * s[1]);
                }
            }
#endif
        }
    }
    for (int i = 0; i < MB; ++i) out[i] = acc.total(i);
}

template <int MB>
void kquant_row(int64_t type, const uint8_t* row, const Activations& a, int64_t m0, float* out) {
    if (type == Q4_K) row_q4_k<MB>(row, a, m0, out);
    else row_q6_k<MB>(row, a, m0, out);
}

using RowFn = void (*)(int64_t, const uint8_t*, const Activations&, int64_t, float*);
constexpr RowFn kRowFns[kTile] = {kquant_row<1>, kquant_row<2>, kquant_row<3>, kquant_row<4>,
                                  kquant_row<5>, kquant_row<6>, kquant_row<7>, kquant_row<8>};

}  // namespace

// Bytes of one weight row of K elements.
int64_t row_bytes(int64_t type, int64_t K) {
    switch (type) {
        case Q4_0: return K / QK * sizeof(BlockQ4_0);
        case Q4_1: return K / QK * sizeof(BlockQ4_1);
        case Q8_0: return K / QK * sizeof(BlockQ8_0);
        case Q4_K: return K / QK_K * sizeof(BlockQ4_K);
        case Q6_K: return K / QK_K * sizeof(BlockQ6_K);
        case I8: return K;
    }
    TORCH_CHECK(false, "unsupported weight type ", type);
}

// ---- dequantization (reference semantics: ggml's dequantize_row_*) -----------------------------
void dequantize_row(int64_t type, const uint8_t* src, float row_scale, int64_t K, float* y) {
    switch (type) {
        case Q4_0: {
            auto* b = reinterpret_cast<const BlockQ4_0*>(src);
            for (int64_t i = 0; i < K / QK; ++i, y += QK) {
                const float d = half_to_float(b[i].d);
                for (int j = 0; j < 16; ++j) {
                    y[j] = ((b[i].qs[j] & 0xF) - 8) * d;
                    y[j + 16] = ((b[i].qs[j] >> 4) - 8) * d;
                }
            }
            return;
        }
        case Q4_1: {
            auto* b = reinterpret_cast<const BlockQ4_1*>(src);
            for (int64_t i = 0; i < K / QK; ++i, y += QK) {
                const float d = half_to_float(b[i].d), m = half_to_float(b[i].m);
                for (int j = 0; j < 16; ++j) {
                    y[j] = (b[i].qs[j] & 0xF) * d + m;
                    y[j + 16] = (b[i].qs[j] >> 4) * d + m;
                }
            }
            return;
        }
        case Q8_0: {
            auto* b = reinterpret_cast<const BlockQ8_0*>(src);
            for (int64_t i = 0; i < K / QK; ++i, y += QK) {
                const float d = half_to_float(b[i].d);
                for (int j = 0; j < 32; ++j) y[j] = b[i].qs[j] * d;
            }
            return;
        }
        case Q4_K: {
            auto* b = reinterpret_cast<const BlockQ4_K*>(src);
            for (int64_t i = 0; i < K / QK_K; ++i) {
                const float d = half_to_float(b[i].d), dmin = half_to_float(b[i].dmin);
                const uint8_t* q = b[i].qs;
                for (int j = 0; j < 8; j += 2, q += 32) {
                    uint8_t sc, m;
                    scale_min_k4(j, b[i].scales, &sc, &m);
                    const float d1 = d * sc, m1 = dmin * m;
                    scale_min_k4(j + 1, b[i].scales, &sc, &m);
                    const float d2 = d * sc, m2 = dmin * m;
                    for (int l = 0; l < 32; ++l) *y++ = d1 * (q[l] & 0xF) - m1;
                    for (int l = 0; l < 32; ++l) *y++ = d2 * (q[l] >> 4) - m2;
                }
            }
            return;
        }
        case Q6_K: {
            auto* b = reinterpret_cast<const BlockQ6_K*>(src);
            for (int64_t i = 0; i < K / QK_K; ++i) {
                const float d = half_to_float(b[i].d);
                const uint8_t* ql = b[i].ql;
                const uint8_t* qh = b[i].qh;
                const int8_t* sc = b[i].scales;
                for (int n = 0; n < 2; ++n, y += 128, ql += 64, qh += 32, sc += 8) {
                    for (int l = 0; l < 32; ++l) {
                        const int is = l / 16;
                        const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                        const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                        const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                        const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                        y[l] = d * sc[is] * q1;
                        y[l + 32] = d * sc[is + 2] * q2;
                        y[l + 64] = d * sc[is + 4] * q3;
                        y[l + 96] = d * sc[is + 6] * q4;
                    }
                }
            }
            return;
        }
        case I8: {
            auto* q = reinterpret_cast<const int8_t*>(src);
            for (int64_t k = 0; k < K; ++k) y[k] = q[k] * row_scale;
            return;
        }
    }
    TORCH_CHECK(false, "unsupported weight type ", type);
}

void rows_matmul(int64_t type, const uint8_t* w, int64_t row_stride, const Activations& a, int64_t n0, int64_t n1,
                 float* out, int64_t ldo) {
    TORCH_CHECK(type == Q4_K || type == Q6_K, "per-row kernels take Q4_K and Q6_K, not type ", type);
    float vals[kTile];
    for (int64_t n = n0; n < n1; ++n) {
        for (int64_t m0 = 0; m0 < a.M; m0 += kTile) {
            const int mb = static_cast<int>(std::min<int64_t>(kTile, a.M - m0));
            kRowFns[mb - 1](type, w + n * row_stride, a, m0, vals);
            for (int i = 0; i < mb; ++i) out[(m0 + i) * ldo + n] = vals[i];
        }
    }
}

}  // namespace conveyor
