// The matmul ops on CPU: out[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]) for weights in the kernels'
// tiles (quant_layout.h): GGUF's Q4_0, Q4_1, Q8_0, the K-quants Q2_K to Q6_K, IQ4_NL and IQ4_XS,
// our per-channel int8 (I8) and dense bf16 and fp32.
//
// Quantized weights: the activations are quantized once per call to int8 blocks of 32 (one fp32
// scale per block, as ggml's Q8_0) and the weights are dotted in integer arithmetic (VNNI where the
// CPU has it); bf16 weights are widened and multiplied with fp32 activations (quant_gemm.cpp). Threads
// split the output tiles, so each streams its own contiguous slice of the weights: the decode-sized
// products are bound by memory bandwidth. The instruction set is chosen at compile time (the
// library is built with -march=native on the machine that runs it); `conveyor_isa()` says which.
// kernels/matmul_ops.py checks the tensors and calls these entry points.
#include "quant.h"
#include "vec_math.h"

#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include <unistd.h>

namespace conveyor {
namespace {

#if defined(__AVX2__)
inline int hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {  // bf16 -> fp32 is a 16-bit shift, exact
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// One block of 32 values, vectorized; the same results as the scalar loop below (the same products,
// rounded to nearest even by vcvtps2dq as nearbyint does in the default rounding mode).
template <typename T>
inline void quantize_block(const T* src, int8_t* q, float& d, int& sum_lo, int& sum_hi) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 v[4];
    __m256 mx = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
        v[i] = load8(src + 8 * i);
        mx = _mm256_max_ps(mx, _mm256_and_ps(v[i], absmask));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    d = _mm_cvtss_f32(m4) / 127.f;
    const __m256 inv = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
    __m256i c[4];
    for (int i = 0; i < 4; ++i) c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
    sum_lo = hsum_epi32(_mm256_add_epi32(c[0], c[1]));
    sum_hi = hsum_epi32(_mm256_add_epi32(c[2], c[3]));
    // packs interleave the 128-bit lanes: put the 8 dwords of the packed bytes back in order
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                        _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// A row's blocks with 16-lane vectors, the same results as `quantize_block` block by block: each
// block's amax first, then the scales of 16 blocks at a time (vdivps rounds as the scalar divisions
// do), then the values; the sums from the packed bytes (vpsadbw: the bytes made unsigned, 8 at a time).
template <typename T>
void quantize_row(const T* src, const Activations::RowSlots& out, int64_t nb, std::vector<float>& scratch) {
    scratch.resize(2 * (nb + 16));
    float *d = scratch.data(), *inv = d + nb + 16;
    const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    for (int64_t b = 0; b < nb; ++b) {
        const __m512 v0 = load16(src + b * QK), v1 = load16(src + b * QK + 16);
        d[b] = lane_max(vecw(_mm512_max_ps(_mm512_and_ps(v0, absmask), _mm512_and_ps(v1, absmask))));
    }
    for (int64_t b = 0; b < nb; b += 16) {
        const __m512 db = _mm512_div_ps(_mm512_loadu_ps(d + b), _mm512_set1_ps(127.f));
        const __mmask16 positive = _mm512_cmp_ps_mask(db, _mm512_setzero_ps(), _CMP_GT_OQ);
        _mm512_storeu_ps(d + b, db);
        _mm512_storeu_ps(inv + b, _mm512_maskz_div_ps(positive, _mm512_set1_ps(1.f), db));
    }
    const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
    alignas(32) int8_t q[QK];
    for (int64_t b = 0; b < nb; ++b) {
        const __m512 s = _mm512_set1_ps(inv[b]);
        const __m512i c0 = _mm512_cvtps_epi32(_mm512_mul_ps(load16(src + b * QK), s));
        const __m512i c1 = _mm512_cvtps_epi32(_mm512_mul_ps(load16(src + b * QK + 16), s));
        const __m256i packed = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm512_cvtsepi32_epi8(c0)),
                                                       _mm512_cvtsepi32_epi8(c1), 1);
        _mm256_store_si256(reinterpret_cast<__m256i*>(q), packed);
        const __m256i sad = _mm256_sad_epu8(_mm256_xor_si256(packed, bias), _mm256_setzero_si256());
        const __m128i lo = _mm256_castsi256_si128(sad), hi = _mm256_extracti128_si256(sad, 1);
        const auto half_sum = [](__m128i s) {  // two 8-byte sums of values plus 128
            return static_cast<int>(_mm_cvtsi128_si64(_mm_add_epi64(s, _mm_unpackhi_epi64(s, s)))) - 16 * 128;
        };
        const int sum_lo = half_sum(lo), sum_hi = half_sum(hi);
        out.set(b, q, d[b], sum_lo, sum_hi);
    }
}
#endif

template <typename T>
void quantize_range(const T* x, int64_t ldx, int64_t m0, int64_t m1, Activations& a) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    thread_local std::vector<float> scratch;
    for (int64_t m = m0; m < m1; ++m) quantize_row(x + m * ldx, a.row_slots(m), a.nb, scratch);
#else
    alignas(32) int8_t q[QK];
    for (int64_t m = m0; m < m1; ++m) {
        const Activations::RowSlots out = a.row_slots(m);
        for (int64_t b = 0; b < a.nb; ++b) {
            const T* src = x + m * ldx + b * QK;
            float d;
            int sum_lo = 0, sum_hi = 0;
#if defined(__AVX2__)
            quantize_block(src, q, d, sum_lo, sum_hi);
#else
            float buf[QK];
            float amax = 0.f;
            for (int j = 0; j < QK; ++j) {
                buf[j] = static_cast<float>(src[j]);
                amax = std::max(amax, std::fabs(buf[j]));
            }
            d = amax / 127.f;
            const float inv = d > 0.f ? 1.f / d : 0.f;
            for (int j = 0; j < QK; ++j) {
                q[j] = static_cast<int8_t>(std::nearbyint(buf[j] * inv));
                (j < 16 ? sum_lo : sum_hi) += q[j];
            }
#endif
            out.set(b, q, d, sum_lo, sum_hi);
        }
    }
#endif
}

template <typename T>
void quantize_typed(const T* x, int64_t ldx, int64_t M, int64_t K, Activations& a) {
    a.shape(M, K);
    parallel_for(0, M, 16, [&](int64_t begin, int64_t end) { quantize_range(x, ldx, begin, end, a); });
}

}  // namespace

void prepare_activations(const void* x, int dtype, int64_t M, int64_t K, int64_t ldx, int64_t type, Activations& a) {
    if (is_dense(type)) {
        a.shape_floats(M, K, dtype == kBF16);
        parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
            for (int64_t m = m0; m < m1; ++m) {
                if (dtype == kF32) a.set_floats(m, static_cast<const float*>(x) + m * ldx);
                else a.set_floats(m, static_cast<const bf16*>(x) + m * ldx);
            }
        });
    } else if (dtype == kF32) {
        quantize_typed(static_cast<const float*>(x), ldx, M, K, a);
    } else {
        quantize_typed(static_cast<const bf16*>(x), ldx, M, K, a);
    }
}

void quantize_rows(const float* x, int64_t ldx, int64_t m0, int64_t m1, Activations& a) {
    quantize_range(x, ldx, m0, m1, a);
}

void pack_float_rows(const float* x, int64_t ldx, int64_t m0, int64_t m1, Activations& a) {
    for (int64_t m = m0; m < m1; ++m) a.set_floats(m, x + m * ldx);
}

}  // namespace conveyor

using namespace conveyor;

namespace {

// Outputs from this size on are written around the caches (`TileOut::stream`): 8 MiB, a few times L2,
// past what the next op could find in cache anyway.
constexpr int64_t kStreamOutputBytes = 8 << 20;

// Logits per thread computed before they are scanned: a chunk that stays in L2 beside the activations.
constexpr int64_t kArgmaxChunkFloats = 64 * 1024;

// Where row[0:len) (columns n0...) holds a value above `best`: best and at become its largest value and
// that value's first column. NaNs never win, as in a scan with `row[n] > best`.
void improve_max(const float* row, int64_t len, int64_t n0, float& best, int64_t& at) {
    const float mx = row_max(row, len);
    if (!(mx > best)) return;
    int64_t i = 0;
    while (row[i] != mx) ++i;
    best = mx, at = n0 + i;
}

// The checks every product over a tiled weight makes: a type the kernels take, K whole blocks.
void check_weight(int64_t type, int64_t K) {
    CONVEYOR_CHECK(is_kernel_type(type), "no kernel takes weight type ", type);
    CONVEYOR_CHECK(K % block_elems(type) == 0, "K = ", K, " is not a multiple of the block size ", block_elems(type));
}

}  // namespace

// out [M, N] (fp32 or bf16 by out_dtype, rows ldo apart: a column slice of a wider output is fine) =
// x [M, K] (fp32 or bf16, rows ldx apart) times a tiled weight [ceil(N/16), tile_bytes] (I8 with row
// scales padded to whole tiles), plus bias [N] (fp32 or nullptr); written in place.
CONVEYOR_API int conveyor_quant_matmul(int x_dtype, const void* x, int64_t M, int64_t K, int64_t ldx, const uint8_t* weight,
                                       int64_t type, const float* row_scales, const float* bias, int out_dtype, void* out,
                                       int64_t N, int64_t ldo, int threads) {
    return guarded(threads, [&] {
        check_weight(type, K);
        CONVEYOR_CHECK(type != I8 || row_scales, "I8 needs fp32 row scales for whole tiles");
        const int64_t tiles = (N + kTileRows - 1) / kTileRows;
        thread_local Activations act;
        prepare_activations(x, x_dtype, M, K, ldx, type, act);
        const Activations& a = act;
        const float* scales = type == I8 ? row_scales : nullptr;
        const bool stream = out_dtype == kF32 && M * N * 4 >= kStreamOutputBytes &&
                            reinterpret_cast<uintptr_t>(out) % 64 == 0 && ldo % kTileRows == 0;
        const TileOut to{out, ldo, out_dtype == kBF16, bias, 0, stream};
        parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) { tiles_matmul(type, weight, scales, a, t0, t1, N, to); });
    });
}

// out [M] = argmax_n (x @ W.T)[m, n] for every row m of x (as above), for a tiled W [N, K]: the LM head
// fused with greedy sampling, so a step's [M, vocab] logits are never written and read back (64 rows
// of a 49k vocabulary: 12.6 MB twice). Threads take contiguous ranges of tiles and keep each row's best
// value and index; logits are computed a few tiles at a time into a buffer that stays in cache (256
// KB), and each row's part is scanned with vector maxima (a scalar compare per logit cost as much as
// the matmul at 256 rows). Ties go to the lowest index, as torch.argmax.
CONVEYOR_API int conveyor_quant_argmax(int x_dtype, const void* x, int64_t M, int64_t K, int64_t ldx, const uint8_t* weight,
                                       int64_t type, const float* row_scales, int64_t N, int64_t* out, int threads) {
    return guarded(threads, [&] {
        check_weight(type, K);
        CONVEYOR_CHECK(N > 0, "N must be positive");
        const int64_t tiles = (N + kTileRows - 1) / kTileRows;
        const float* scales = type == I8 ? row_scales : nullptr;
        thread_local Activations act;
        prepare_activations(x, x_dtype, M, K, ldx, type, act);
        const Activations& a = act;
        const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(call_threads(), tiles));
        std::vector<float> best(parts * M, -std::numeric_limits<float>::infinity());
        std::vector<int64_t> where(parts * M, 0);
        const int64_t chunk_tiles = std::clamp<int64_t>(kArgmaxChunkFloats / (M * kTileRows), 1, 64);
        parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
            std::vector<float> buf(M * chunk_tiles * kTileRows);
            for (int64_t p = p0; p < p1; ++p) {
                float* bv = best.data() + p * M;
                int64_t* bi = where.data() + p * M;
                for (int64_t t0 = tiles * p / parts, t_end = tiles * (p + 1) / parts; t0 < t_end; t0 += chunk_tiles) {
                    const int64_t t1 = std::min(t0 + chunk_tiles, t_end), n0 = t0 * kTileRows;
                    const int64_t n1 = std::min(t1 * kTileRows, N), ld = (t1 - t0) * kTileRows;
                    tiles_matmul(type, weight, scales, a, t0, t1, N, TileOut{buf.data(), ld, false, nullptr, n0});
                    for (int64_t m = 0; m < M; ++m) improve_max(buf.data() + m * ld, n1 - n0, n0, bv[m], bi[m]);
                }
            }
        });
        for (int64_t m = 0; m < M; ++m) {  // parts in column order: a later part wins only when strictly larger
            float v = best[m];
            int64_t at = where[m];
            for (int64_t p = 1; p < parts; ++p)
                if (best[p * M + m] > v) v = best[p * M + m], at = where[p * M + m];
            out[m] = at;
        }
    });
}

// GGUF rows [N, row_bytes] (I8: int8 rows) -> the tiled layout dst [ceil(N/16), tile_bytes].
CONVEYOR_API int conveyor_repack_tiles(const uint8_t* rows, int64_t type, int64_t N, int64_t K, uint8_t* dst,
                                       int threads) {
    return guarded(threads, [&] {
        check_weight(type, K);
        repack_tiles(type, rows, N, K, dst);
    });
}

// Rows `ids` (n_ids of them, each in [0, num_rows)) of a tiled matrix, dequantized into out [n_ids, K]
// (fp32 or bf16, contiguous): embedding lookups.
CONVEYOR_API int conveyor_dequantize_rows(const uint8_t* weight, int64_t type, const float* row_scales, const int64_t* ids,
                                          int64_t n_ids, int64_t num_rows, int64_t K, int out_dtype, void* out,
                                          int threads) {
    return guarded(threads, [&] {
        check_weight(type, K);
        for (int64_t r = 0; r < n_ids; ++r)
            CONVEYOR_CHECK(ids[r] >= 0 && ids[r] < num_rows, "row index ", ids[r], " out of range [0, ", num_rows, ")");
        const float* scales = type == I8 ? row_scales : nullptr;
        const bool f32 = out_dtype == kF32;
        parallel_for(0, n_ids, 8, [&](int64_t begin, int64_t end) {
            std::vector<float> buf(f32 ? 0 : K);
            for (int64_t r = begin; r < end; ++r) {
                float* dst = f32 ? static_cast<float*>(out) + r * K : buf.data();
                dequantize_tiled_row(type, weight, scales, K, ids[r], dst);
                if (!f32) {
                    bf16* o = static_cast<bf16*>(out) + r * K;
                    for (int64_t k = 0; k < K; ++k) o[k] = bf16(buf[k]);
                }
            }
        });
    });
}

// Rows `ids` (n_ids of them, each in [0, num_rows)) of a table of `row_bytes`-byte rows that starts at byte
// `offset` of the open file `fd`, read into out [n_ids, row_bytes]: embedding lookups from a file's table,
// which then never becomes part of the process' resident memory (page cache reads, not a mapping).
CONVEYOR_API int conveyor_read_rows(int fd, int64_t offset, int64_t row_bytes, const int64_t* ids, int64_t n_ids,
                                    int64_t num_rows, uint8_t* out) {
    return guarded(1, [&] {
        for (int64_t r = 0; r < n_ids; ++r) {
            CONVEYOR_CHECK(ids[r] >= 0 && ids[r] < num_rows, "row index ", ids[r], " out of range [0, ", num_rows, ")");
            uint8_t* dst = out + r * row_bytes;
            int64_t done = 0;
            while (done < row_bytes) {
                const ssize_t got = pread(fd, dst + done, row_bytes - done, offset + ids[r] * row_bytes + done);
                if (got < 0 && errno == EINTR) continue;
                CONVEYOR_CHECK(got > 0, "reading row ", ids[r], " of the table at byte ", offset, " of the file: ",
                               got < 0 ? std::strerror(errno) : "the file ends first");
                done += got;
            }
        }
    });
}

// A whole tiled matrix dequantized into out [N, K] (fp32 or bf16, contiguous): the prefill path's weight.
CONVEYOR_API int conveyor_dequantize_matrix(const uint8_t* weight, int64_t type, const float* row_scales, int64_t N,
                                            int64_t K, int out_dtype, void* out, int threads) {
    return guarded(threads, [&] {
        check_weight(type, K);
        const int64_t tiles = (N + kTileRows - 1) / kTileRows;
        const float* scales = type == I8 ? row_scales : nullptr;
        const bool bf = out_dtype == kBF16;
        parallel_for(0, tiles, 4, [&](int64_t t0, int64_t t1) { dequantize_tiles(type, weight, scales, N, K, t0, t1, out, bf); });
    });
}

// Bytes of one row in GGUF's layout (I8: K) and of one 16-row tile in the kernels' layout; -1 for a
// type the kernels do not take.
CONVEYOR_API int64_t conveyor_row_bytes(int64_t type, int64_t K) { return is_kernel_type(type) ? row_bytes(type, K) : -1; }
CONVEYOR_API int64_t conveyor_tile_bytes(int64_t type, int64_t K) { return is_kernel_type(type) ? tile_bytes(type, K) : -1; }

// Whether dense bf16 tiles multiply bf16 pairs by vdpbf16ps on this CPU (`bf16_pair_products`, quant.h).
CONVEYOR_API int conveyor_bf16_pair_products() { return bf16_pair_products() ? 1 : 0; }

// The instruction set the kernels were compiled for.
CONVEYOR_API const char* conveyor_isa() {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define CONVEYOR_ISA "avx512-vnni"
#elif defined(__AVXVNNI__)
#define CONVEYOR_ISA "avx2+avx-vnni"
#elif defined(__AVX2__)
#define CONVEYOR_ISA "avx2"
#else
#define CONVEYOR_ISA "scalar"
#endif
#if defined(__AVX512BF16__)
    return CONVEYOR_ISA "+avx512-bf16";
#else
    return CONVEYOR_ISA;
#endif
}
