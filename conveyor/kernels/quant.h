// Shared by the quantized-matmul sources: GGUF block layouts, the 16-row tiled layout, and the
// int8 activation blocks every quantized product takes.
#pragma once

#include "runtime.h"

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace conveyor {

constexpr int64_t QK = 32;     // activation block, and the block of Q4_0/Q4_1/Q8_0/I8
constexpr int64_t QK_K = 256;  // super-block of the K-quants
constexpr int64_t kTileRows = 16;  // output rows interleaved in one tile

// GGUF/ggml type ids (ggml.h) of the block types handled here, our per-channel int8, and dense bf16 and
// fp32 weights in the same tiles (not quantized: multiplied in fp32 with fp32 activations; F32 holds a
// mixture-of-experts model's fp32 experts).
enum WeightType : int64_t {
    Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ4_NL = 20, IQ4_XS = 23,
    MXFP4 = 39, I8 = 1000, BF16 = 1001, F32 = 1002
};

struct BlockQ4_0 { uint16_t d; uint8_t qs[16]; };
struct BlockQ4_1 { uint16_t d, m; uint8_t qs[16]; };
struct BlockQ8_0 { uint16_t d; int8_t qs[32]; };
struct BlockQ2_K { uint8_t scales[16]; uint8_t qs[64]; uint16_t d, dmin; };
struct BlockQ3_K { uint8_t hmask[32]; uint8_t qs[64]; uint8_t scales[12]; uint16_t d; };
struct BlockQ4_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; };
struct BlockQ5_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; };
struct BlockQ6_K { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; };
struct BlockIQ4_NL { uint16_t d; uint8_t qs[16]; };
struct BlockIQ4_XS { uint16_t d, scales_h; uint8_t scales_l[4]; uint8_t qs[128]; };
struct BlockMXFP4 { uint8_t e; uint8_t qs[16]; };  // e8m0 exponent; nibbles as IQ4_NL's (0-15 low, 16-31 high)
static_assert(sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_1) == 20 && sizeof(BlockQ8_0) == 34, "ggml block sizes");
static_assert(sizeof(BlockQ2_K) == 84 && sizeof(BlockQ3_K) == 110 && sizeof(BlockQ4_K) == 144 && sizeof(BlockQ5_K) == 176 &&
                  sizeof(BlockQ6_K) == 210, "ggml K-quant block sizes");
static_assert(sizeof(BlockIQ4_NL) == 18 && sizeof(BlockIQ4_XS) == 136 && sizeof(BlockMXFP4) == 17,
              "ggml IQ4 and MXFP4 block sizes");

// ggml's kvalues_iq4nl: the values IQ4_NL's and IQ4_XS's 4-bit indices stand for.
constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
// ggml's kvalues_mxfp4: twice the e2m1 values MXFP4's indices stand for (the scale is then 2^(e - 128)).
constexpr int8_t kMXFP4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else  // IEEE half: sign, 5-bit exponent (bias 15), 10-bit mantissa; subnormals scaled by 2^-24
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
    float f;
    if (exp == 0) {
        f = std::ldexp(static_cast<float>(mant), -24);
        uint32_t u;
        std::memcpy(&u, &f, sizeof u);
        u |= sign;
        std::memcpy(&f, &u, sizeof f);
    } else {
        const uint32_t u = sign | (exp == 0x1F ? 0x7F800000u | (mant << 13) : ((exp + 112) << 23) | (mant << 13));
        std::memcpy(&f, &u, sizeof f);
    }
    return f;
#endif
}

// 2^k as fp16 bits (k from -24, a subnormal below -14, to 15); 0 for the exponents fp16 cannot hold.
constexpr uint16_t pow2_half(int k) {
    return k >= -14 && k <= 15 ? static_cast<uint16_t>((k + 15) << 10)
                               : k >= -24 && k < -14 ? static_cast<uint16_t>(1 << (k + 24)) : 0;
}

#if defined(__AVX2__)
inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

inline bool is_kernel_type(int64_t type) {
    return type == Q4_0 || type == Q4_1 || type == Q8_0 || type == Q2_K || type == Q3_K || type == Q4_K ||
           type == Q5_K || type == Q6_K || type == IQ4_NL || type == IQ4_XS || type == MXFP4 || type == I8 ||
           type == BF16 || type == F32;
}
// The types stored in super-blocks of 256 weights (the K-quants and IQ4_XS).
constexpr bool has_superblocks(int64_t type) {
    return type == Q2_K || type == Q3_K || type == Q4_K || type == Q5_K || type == Q6_K || type == IQ4_XS;
}
// Dense (not quantized) tiles: one value per weight, their inputs packed as fp32.
inline bool is_dense(int64_t type) { return type == BF16 || type == F32; }
inline int64_t dense_bytes(int64_t type) { return type == F32 ? 4 : 2; }
inline int64_t block_elems(int64_t type) { return has_superblocks(type) ? QK_K : is_dense(type) ? 1 : QK; }
int64_t row_bytes(int64_t type, int64_t K);   // one row in GGUF's layout (I8: K bytes)
int64_t tile_bytes(int64_t type, int64_t K);  // one tile of kTileRows rows in the tiled layout (quant_layout.h)

// Rows per group of the packed activations (below), the rows one pass of the tiled GEMM microkernel
// takes: as many as its integer and fp32 accumulators leave registers for.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
constexpr int64_t kPackRows = 12;
#else
constexpr int64_t kPackRows = 4;
#endif

// Whether BF16 tiles multiply bf16 pairs by vdpbf16ps (two products an instruction), where it runs at
// the FMA's rate: AMD's avx512_bf16 (Zen 4 on). Intel's AVX512-BF16 without AMX runs it at half rate,
// no faster than the fp32 FMAs of the widened weights.
inline bool bf16_pair_products() {
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
    static const bool amd = __builtin_cpu_is("amd");
    return amd;
#else
    return false;
#endif
}

// Activations quantized to int8 blocks of 32 (scale amax / 127), packed for the tiled GEMM: rows in
// groups of kPackRows (the last one smaller), and within a group of r rows, block by block, the
// four-byte words of the rows interleaved (word j of row i at (j * r + i) * 4 of the block's r * 32
// bytes), so the microkernel reads one pointer at constant offsets (twelve row pointers do not fit
// the general registers). Per block and row, in the same group order: the scale `d`, `s32` = d times
// the block's sum, and that integer sum times -8 (`neg8`) and -128 (`neg128`), and per half block
// times -128 (`neg128h`, the group's r first halves then its r second halves): where the
// microkernel starts its integer accumulators to take back Q4_0's offset and the +128 that makes
// signed weights (Q8_0, I8, the IQ4 values) unsigned for vpdpbusd (per half block: for the types with a
// scale per 16 weights, Q2_K, Q3_K and Q6_K, whose offsets of -4 and -32 are that divided by 32 and 4).
//
// For dense (BF16, F32) weights the activations stay fp32, packed the same way value by value (`f`: value k of row
// i of a group of r rows at k * r + i): `shape_floats`, then `set_floats` per row. Where BF16 tiles
// multiply by vdpbf16ps (`bf16_pair_products`) and the rows hold bf16 values (so nothing is rounded),
// they are also packed as bf16 pairs (`bp`: the 32-bit word of values 2j, 2j + 1 of row i at j * r + i).
struct Activations {
    int64_t M = 0, K = 0, nb = 0;
    bool pairs = false;  // `bp` holds the rows as bf16 pairs too
    std::vector<int8_t> q;
    std::vector<float> d, s32, f;
    std::vector<uint32_t> bp;
    std::vector<int32_t> neg8, neg128, neg128h;
    void shape(int64_t rows, int64_t cols) {
        M = rows, K = cols, nb = cols / QK;
        q.resize(M * K), d.resize(M * nb), s32.resize(M * nb), neg8.resize(M * nb), neg128.resize(M * nb);
        neg128h.resize(M * nb * 2);
    }
    // bf16_values: the rows will hold bf16 values (bf16 inputs, or fp32 ones rounded to bf16).
    void shape_floats(int64_t rows, int64_t cols, bool bf16_values = false) {
        M = rows, K = cols, nb = cols / QK;
        f.resize(M * K);
        pairs = bf16_values && cols % 2 == 0 && bf16_pair_products();
        if (pairs) bp.resize(M * K / 2);
    }
    template <typename T>
    void set_floats(int64_t m, const T* x) {
        const int64_t g0 = group_start(m), r = group_rows(g0);
        float* dst = f.data() + g0 * K + (m - g0);
        for (int64_t k = 0; k < K; ++k) dst[k * r] = static_cast<float>(x[k]);
        if (pairs) {
            uint32_t* pd = bp.data() + g0 * K / 2 + (m - g0);
            for (int64_t j = 0; j < K / 2; ++j)
                pd[j * r] = static_cast<uint32_t>(bf16::from_float(static_cast<float>(x[2 * j]))) |
                            static_cast<uint32_t>(bf16::from_float(static_cast<float>(x[2 * j + 1]))) << 16;
        }
    }
    // The group of row m: its first row and its number of rows.
    static int64_t group_start(int64_t m) { return m / kPackRows * kPackRows; }
    int64_t group_rows(int64_t m0) const { return std::min<int64_t>(kPackRows, M - m0); }
    // Index of row m's block b in the per-block arrays.
    int64_t at(int64_t m, int64_t b) const {
        const int64_t g0 = group_start(m);
        return g0 * nb + b * group_rows(g0) + m - g0;
    }
    // Row m's value e (0..31) of block b.
    int8_t value(int64_t m, int64_t b, int e) const {
        const int64_t g0 = group_start(m), r = group_rows(g0);
        return q[g0 * K + b * r * QK + (e / 4 * r + m - g0) * 4 + e % 4];
    }
    // Where row m's blocks go: block b's scale and sums at b * r of each pointer, its words r * 4 bytes
    // apart from b * r * QK of `q` (r: the rows of its group).
    struct RowSlots {
        float *d, *s32;
        int32_t *neg8, *neg128, *neg128h;
        int8_t* q;
        int64_t r;
        // Block b: its 32 values `v` (amax / 127 = `scale`) and their sums, stored.
        void set(int64_t b, const int8_t* v, float scale, int sum_lo, int sum_hi) const {
            const int64_t i = b * r;
            d[i] = scale, s32[i] = scale * (sum_lo + sum_hi);
            neg8[i] = -8 * (sum_lo + sum_hi), neg128[i] = -128 * (sum_lo + sum_hi);
            neg128h[2 * i] = -128 * sum_lo, neg128h[2 * i + r] = -128 * sum_hi;
            int8_t* dst = q + i * QK;
            for (int j = 0; j < QK / 4; ++j) std::memcpy(dst + j * r * 4, v + 4 * j, 4);
        }
    };
    RowSlots row_slots(int64_t m) {
        const int64_t g0 = group_start(m), r = group_rows(g0), row = m - g0, i = g0 * nb + row;
        return {d.data() + i, s32.data() + i, neg8.data() + i, neg128.data() + i,
                neg128h.data() + g0 * nb * 2 + row, q.data() + g0 * K + row * 4, r};
    }
};
// x [M, K] (fp32 or bf16 by `dtype`, rows ldx apart) as the kernels of weight type `type` take it:
// int8 blocks, or packed fp32 for BF16 and F32.
void prepare_activations(const void* x, int dtype, int64_t M, int64_t K, int64_t ldx, int64_t type, Activations& a);
// Rows [m0, m1) of x (fp32, ldx apart) into `a`, already shaped for them (`shape`, or `shape_floats`
// for dense weights); serial (threads may prepare disjoint row ranges of one `a` at once).
void quantize_rows(const float* x, int64_t ldx, int64_t m0, int64_t m1, Activations& a);
void pack_float_rows(const float* x, int64_t ldx, int64_t m0, int64_t m1, Activations& a);

// Where a tiled matmul writes: out [M, N] (columns from `col0` on), rows `ld` elements apart, fp32 or
// bf16, plus an fp32 bias [N].
struct TileOut {
    void* data;
    int64_t ld;
    bool bf16 = false;
    const float* bias = nullptr;
    int64_t col0 = 0;
    // Whole fp32 tiles go out with non-temporal stores: for an output far larger than the caches (the
    // LM head's logits at many rows), which would otherwise read every line before writing it.
    bool stream = false;
    int64_t at(int64_t m, int64_t n) const { return m * ld + n - col0; }
    const char* address(int64_t m, int64_t n) const {
        return static_cast<const char*>(data) + at(m, n) * (bf16 ? 2 : 4);
    }
    void store(int64_t m, int64_t n, float v) const {
        if (bias) v += bias[n];
        if (bf16) static_cast<conveyor::bf16*>(data)[at(m, n)] = conveyor::bf16(v);
        else static_cast<float*>(data)[at(m, n)] = v;
    }
};

// out[m, n] = sum_k x[m, k] W[n, k] for all M rows of `a` and the rows of tiles [t0, t1) of a tiled
// matrix (I8: times `row_scales`, padded to whole tiles), N rows in all (quant_gemm.cpp).
void tiles_matmul(int64_t type, const uint8_t* w, const float* row_scales, const Activations& a, int64_t t0,
                  int64_t t1, int64_t N, const TileOut& out);

// Row `row` of a tiled matrix as fp32.
void dequantize_tiled_row(int64_t type, const uint8_t* tiles, const float* row_scales, int64_t K, int64_t row,
                          float* y);
// Tiles [t0, t1) of a tiled N x K matrix into out [N, K], fp32 or (to_bf16) bf16.
void dequantize_tiles(int64_t type, const uint8_t* tiles, const float* row_scales, int64_t N, int64_t K, int64_t t0,
                      int64_t t1, void* out, bool to_bf16);
// GGUF rows [N, row_bytes] -> tiles [ceil(N/16), tile_bytes] (rows past N are zero).
void repack_tiles(int64_t type, const uint8_t* src, int64_t N, int64_t K, uint8_t* dst);

}  // namespace conveyor
