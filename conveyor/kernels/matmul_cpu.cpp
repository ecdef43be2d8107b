// The matmul ops on CPU: out[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]) for weights in the kernels'
// tiles (quant_layout.h): GGUF's Q4_0, Q4_1, Q8_0, Q4_K, Q6_K, our per-channel int8 (I8) and dense bf16 and fp32.
//
// Quantized weights: the activations are quantized once per call to int8 blocks of 32 (one fp32
// scale per block, as ggml's Q8_0) and the weights are dotted in integer arithmetic (VNNI where the
// CPU has it); bf16 weights are widened and multiplied with fp32 activations (quant_gemm.cpp). Threads
// split the output tiles, so each streams its own contiguous slice of the weights: the decode-sized
// products are bound by memory bandwidth. The instruction set is chosen at compile time (the
// extension is built with -march=native on the machine that runs it); `isa()` says which.
#include "quant.h"
#include "vec_math.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <limits>
#include <vector>

namespace conveyor {
namespace {

#if defined(__AVX2__)
inline int hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {  // bf16 -> fp32 is a 16-bit shift, exact
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

template <typename T>
void quantize_range(const T* x, int64_t ldx, int64_t m0, int64_t m1, Activations& a) {
    alignas(32) int8_t q[QK];
    for (int64_t m = m0; m < m1; ++m) {
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
            a.set_block(m, b, q, d, sum_lo, sum_hi);
        }
    }
}

template <typename T>
void quantize_typed(const T* x, int64_t ldx, int64_t M, int64_t K, Activations& a) {
    a.shape(M, K);
    at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) { quantize_range(x, ldx, begin, end, a); });
}

void check_out(const torch::Tensor& out, int64_t M, int64_t N) {
    TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.size(1) == N && out.stride(1) == 1,
                "out must be [", M, ", ", N, "] with contiguous rows");
    TORCH_CHECK(out.scalar_type() == torch::kFloat32 || out.scalar_type() == torch::kBFloat16,
                "out must be fp32 or bf16");
}

}  // namespace

void prepare_activations(const torch::Tensor& x, int64_t type, Activations& a) {
    const int64_t M = x.size(0), K = x.size(1), ldx = x.stride(0);
    if (is_dense(type)) {
        a.shape_floats(M, K);
        at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
            for (int64_t m = m0; m < m1; ++m) {
                if (x.scalar_type() == torch::kFloat32) a.set_floats(m, x.data_ptr<float>() + m * ldx);
                else a.set_floats(m, x.data_ptr<c10::BFloat16>() + m * ldx);
            }
        });
    } else if (x.scalar_type() == torch::kFloat32) {
        quantize_typed(x.data_ptr<float>(), ldx, M, K, a);
    } else {
        quantize_typed(x.data_ptr<c10::BFloat16>(), ldx, M, K, a);
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

void register_decode_stack(py::module_& m);
void register_grouped_experts(py::module_& m);

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

}  // namespace

// out [M, N] (fp32 or bf16, contiguous rows: a column slice of a wider output is fine) = x [M, K] (fp32
// or bf16) times a tiled quantized weight [ceil(N/16), tile_bytes] (I8 with row scales padded to whole
// tiles), plus bias [N]; written in place.
void quant_matmul(torch::Tensor x, torch::Tensor weight, int64_t type, torch::Tensor row_scales,
                  c10::optional<torch::Tensor> bias, torch::Tensor out) {
    TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K] with contiguous rows");
    TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16, "x must be fp32 or bf16");
    const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
    TORCH_CHECK(K % block_elems(type) == 0, "K = ", K, " is not a multiple of the block size ", block_elems(type));
    check_out(out, M, N);
    TORCH_CHECK(is_kernel_type(type), "no kernel takes weight type ", type);
    const int64_t tiles = (N + kTileRows - 1) / kTileRows;
    TORCH_CHECK(weight.scalar_type() == torch::kUInt8 && weight.is_contiguous() && weight.dim() == 2 &&
                weight.size(0) == tiles && weight.size(1) == tile_bytes(type, K),
                "weight must be tiled contiguous uint8 [", tiles, ", ", tile_bytes(type, K), "]");
    const float* scales = nullptr;
    if (type == I8) {
        TORCH_CHECK(row_scales.scalar_type() == torch::kFloat32 && row_scales.numel() >= tiles * kTileRows,
                    "I8 needs fp32 row scales for whole tiles");
        scales = row_scales.data_ptr<float>();
    }
    thread_local Activations act;
    prepare_activations(x, type, act);
    const Activations& a = act;
    const uint8_t* wp = weight.data_ptr<uint8_t>();
    torch::Tensor b32;
    if (bias.has_value() && bias->defined()) b32 = bias->to(torch::kFloat32).contiguous();
    const bool stream = out.scalar_type() == torch::kFloat32 && M * N * 4 >= kStreamOutputBytes &&
                        reinterpret_cast<uintptr_t>(out.data_ptr()) % 64 == 0 && out.stride(0) % kTileRows == 0;
    const TileOut to{out.data_ptr(), out.stride(0), out.scalar_type() == torch::kBFloat16,
                     b32.defined() ? b32.data_ptr<float>() : nullptr, 0, stream};
    at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) { tiles_matmul(type, wp, scales, a, t0, t1, N, to); });
}

// argmax_n (x @ W.T)[m, n] for every row m of x, for a tiled W [N, K]: the LM head fused with greedy
// sampling, so a step's [M, vocab] logits are never written and read back (64 rows of a 49k vocabulary:
// 12.6 MB twice). Threads take contiguous ranges of tiles and keep each row's best value and index;
// logits are computed a few tiles at a time into a buffer that stays in cache (256 KB), and each row's
// part is scanned with vector maxima (a scalar compare per logit cost as much as the matmul at 256
// rows). Ties go to the lowest index, as torch.argmax.
torch::Tensor quant_argmax(torch::Tensor x, torch::Tensor weight, int64_t type, torch::Tensor row_scales, int64_t N) {
    TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K] with contiguous rows");
    TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16, "x must be fp32 or bf16");
    TORCH_CHECK(is_kernel_type(type), "no kernel takes weight type ", type);
    const int64_t M = x.size(0), K = x.size(1), tiles = (N + kTileRows - 1) / kTileRows;
    TORCH_CHECK(K % block_elems(type) == 0 && N > 0, "K must be a multiple of ", block_elems(type), " and N positive");
    TORCH_CHECK(weight.scalar_type() == torch::kUInt8 && weight.is_contiguous() && weight.size(0) == tiles &&
                weight.size(1) == tile_bytes(type, K), "weight must be tiled uint8 [", tiles, ", ", tile_bytes(type, K), "]");
    const float* scales = type == I8 ? row_scales.data_ptr<float>() : nullptr;
    thread_local Activations act;
    prepare_activations(x, type, act);
    const Activations& a = act;
    const uint8_t* wp = weight.data_ptr<uint8_t>();
    const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tiles));
    std::vector<float> best(parts * M, -std::numeric_limits<float>::infinity());
    std::vector<int64_t> where(parts * M, 0);
    const int64_t chunk_tiles = std::clamp<int64_t>(kArgmaxChunkFloats / (M * kTileRows), 1, 64);
    at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
        std::vector<float> buf(M * chunk_tiles * kTileRows);
        for (int64_t p = p0; p < p1; ++p) {
            float* bv = best.data() + p * M;
            int64_t* bi = where.data() + p * M;
            for (int64_t t0 = tiles * p / parts, t_end = tiles * (p + 1) / parts; t0 < t_end; t0 += chunk_tiles) {
                const int64_t t1 = std::min(t0 + chunk_tiles, t_end), n0 = t0 * kTileRows, n1 = std::min(t1 * kTileRows, N);
                const int64_t ld = (t1 - t0) * kTileRows;
                tiles_matmul(type, wp, scales, a, t0, t1, N, TileOut{buf.data(), ld, false, nullptr, n0});
                for (int64_t m = 0; m < M; ++m) improve_max(buf.data() + m * ld, n1 - n0, n0, bv[m], bi[m]);
            }
        }
    });
    auto out = torch::empty({M}, torch::kInt64);
    int64_t* op = out.data_ptr<int64_t>();
    for (int64_t m = 0; m < M; ++m) {  // parts in column order: a later part wins only when strictly larger
        float v = best[m];
        int64_t at = where[m];
        for (int64_t p = 1; p < parts; ++p)
            if (best[p * M + m] > v) v = best[p * M + m], at = where[p * M + m];
        op[m] = at;
    }
    return out;
}

// GGUF rows [N, row_bytes] (I8: int8 rows) -> the tiled layout [ceil(N/16), tile_bytes].
torch::Tensor repack(torch::Tensor rows, int64_t type, int64_t K) {
    TORCH_CHECK(is_kernel_type(type), "no kernel takes weight type ", type);
    TORCH_CHECK(K % block_elems(type) == 0, "K = ", K, " is not a multiple of the block size ", block_elems(type));
    TORCH_CHECK(rows.scalar_type() == torch::kUInt8 && rows.is_contiguous() && rows.size(1) == row_bytes(type, K),
                "rows must be contiguous uint8 [N, ", row_bytes(type, K), "]");
    const int64_t N = rows.size(0), tiles = (N + kTileRows - 1) / kTileRows;
    auto out = torch::empty({tiles, tile_bytes(type, K)}, rows.options());
    conveyor::repack_tiles(type, rows.data_ptr<uint8_t>(), N, K, out.data_ptr<uint8_t>());
    return out;
}

// Rows `ids` of a tiled quantized matrix, dequantized into out [len(ids), K] (fp32 or bf16): embedding
// lookups, and whole matrices for the fallback path.
void dequantize_rows(torch::Tensor weight, int64_t type, torch::Tensor row_scales, torch::Tensor ids,
                     int64_t num_rows, torch::Tensor out) {
    TORCH_CHECK(weight.scalar_type() == torch::kUInt8 && weight.is_contiguous(), "weight must be contiguous uint8");
    TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == ids.numel(), "out must be [len(ids), K]");
    const bool f32 = out.scalar_type() == torch::kFloat32;
    TORCH_CHECK(f32 || out.scalar_type() == torch::kBFloat16, "out must be fp32 or bf16");
    TORCH_CHECK(is_kernel_type(type), "no kernel takes weight type ", type);
    const int64_t K = out.size(1);
    TORCH_CHECK(K % block_elems(type) == 0 && weight.size(1) == tile_bytes(type, K), "weight tiles do not hold ", K,
                " elements of type ", type);
    auto idx = ids.to(torch::kInt64).contiguous();
    const int64_t* ip = idx.data_ptr<int64_t>();
    for (int64_t r = 0; r < idx.numel(); ++r)
        TORCH_CHECK(ip[r] >= 0 && ip[r] < num_rows, "row index ", ip[r], " out of range [0, ", num_rows, ")");
    const float* scales = type == I8 ? row_scales.data_ptr<float>() : nullptr;
    const uint8_t* wp = weight.data_ptr<uint8_t>();
    at::parallel_for(0, idx.numel(), 8, [&](int64_t begin, int64_t end) {
        std::vector<float> buf(f32 ? 0 : K);
        for (int64_t r = begin; r < end; ++r) {
            float* dst = f32 ? out.data_ptr<float>() + r * K : buf.data();
            dequantize_tiled_row(type, wp, scales, K, ip[r], dst);
            if (!f32) {
                c10::BFloat16* o = out.data_ptr<c10::BFloat16>() + r * K;
                for (int64_t k = 0; k < K; ++k) o[k] = static_cast<c10::BFloat16>(buf[k]);
            }
        }
    });
}

// A whole tiled matrix dequantized into out [N, K] (fp32 or bf16): the prefill path's weight.
void dequantize_matrix(torch::Tensor weight, int64_t type, torch::Tensor row_scales, torch::Tensor out) {
    TORCH_CHECK(is_kernel_type(type), "no kernel takes weight type ", type);
    TORCH_CHECK(out.dim() == 2 && out.is_contiguous(), "out must be a contiguous [N, K]");
    const bool bf16 = out.scalar_type() == torch::kBFloat16;
    TORCH_CHECK(bf16 || out.scalar_type() == torch::kFloat32, "out must be fp32 or bf16");
    const int64_t N = out.size(0), K = out.size(1), tiles = (N + kTileRows - 1) / kTileRows;
    TORCH_CHECK(weight.scalar_type() == torch::kUInt8 && weight.is_contiguous() && weight.size(0) == tiles &&
                weight.size(1) == tile_bytes(type, K), "weight must be tiled uint8 [", tiles, ", ", tile_bytes(type, K), "]");
    const float* scales = type == I8 ? row_scales.data_ptr<float>() : nullptr;
    const uint8_t* wp = weight.data_ptr<uint8_t>();
    void* op = out.data_ptr();
    at::parallel_for(0, tiles, 4, [&](int64_t t0, int64_t t1) { dequantize_tiles(type, wp, scales, N, K, t0, t1, op, bf16); });
}

std::string isa() {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
    std::string s = "avx512-vnni";
#elif defined(__AVXVNNI__)
    std::string s = "avx2+avx-vnni";
#elif defined(__AVX2__)
    std::string s = "avx2";
#else
    std::string s = "scalar";
#endif
#if defined(__AVX512BF16__)
    s += "+avx512-bf16";
#endif
    return s;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("quant_matmul", &quant_matmul, "x @ W.T for a quantized weight (CPU)", py::call_guard<py::gil_scoped_release>());
    m.def("quant_argmax", &quant_argmax, "argmax over n of x @ W.T for a tiled weight (the LM head fused with greedy sampling)",
          py::call_guard<py::gil_scoped_release>());
    m.def("repack_tiles", &repack, "GGUF rows (or I8 rows) -> the 16-row tiled layout");
    m.def("dequantize_rows", &dequantize_rows, "rows of a quantized matrix as fp32/bf16 (CPU)");
    m.def("dequantize_matrix", &dequantize_matrix, "a whole tiled matrix as fp32/bf16 (CPU)");
    m.def("row_bytes", &row_bytes, "bytes per GGUF-layout row of K elements");
    m.def("tile_bytes", &tile_bytes, "bytes per 16-row tile of K elements");
    m.def("isa", &isa, "the instruction set the kernels were compiled for");
    register_decode_stack(m);
    register_grouped_experts(m);
}
