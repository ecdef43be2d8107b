// The machine's compute peak per instruction path: each loop issues only the dot-product instruction
// (and the adds that keep its results) a kernel path is built on, on independent registers, on `threads`
// OpenMP threads at once; the roofline diagnostics (tools/) set each linear's GFLOP/s against the peak
// of the path it took. Only the paths this build's target has are compiled (`conveyor_peak_kinds()`
// lists them). A library of its own, built at its first use: nothing the engine runs needs it.
//   fp32-fma        vfmadd231ps (8 or 16 lanes): the fp32 dense path (oneDNN/MKL sgemm)
//   int8-i16        vpmaddubsw + vpaddw: AVX2 4-bit weights, whose block sums fit int16
//   int8-i32        vpmaddubsw + vpmaddwd + vpaddd: AVX2 8-bit weights (widened every product)
//   int8-vnni       vpdpbusd (AVX-VNNI ymm, or AVX512-VNNI zmm): every quantized format
//   bf16-avx512     vdpbf16ps: AVX512-BF16
//   amx-bf16, amx-int8  tdpbf16ps / tdpbssd on four accumulator tiles
// Rates are in GOP/s (a multiply-add counts 2), the unit of the kernels' GFLOP/s.
#include "runtime.h"

#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace {

// Runs `body(iterations)` once to warm up, then times it on `threads` threads; GOP/s given the ops
// one iteration does on one thread.
template <typename Body>
double rate(int threads, double ops_per_iter, int64_t iters, Body body) {
    double sink = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    sink += body(iters / 8);
    const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    sink += body(iters);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    volatile double keep = sink;  // the loops' results are used
    (void)keep;
    return ops_per_iter * static_cast<double>(iters) * threads / s / 1e9;
}

#define CONVEYOR_R8(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)

#if defined(__AVX2__) && defined(__FMA__)
double fma_loop(int64_t iters) {
#if defined(__AVX512F__)
#define DECL(i) __m512 a##i = _mm512_set1_ps(0.001f * (i + omp_get_thread_num()));
    CONVEYOR_R8(DECL)
#undef DECL
    __m512 x = _mm512_set1_ps(0.5f), y = _mm512_set1_ps(0.25f);
    for (int64_t it = 0; it < iters; ++it) {
#define STEP(i) a##i = _mm512_fmadd_ps(a##i, x, y);
        CONVEYOR_R8(STEP) CONVEYOR_R8(STEP)
#undef STEP
    }
    __m512 s = _mm512_setzero_ps();
#define SUM(i) s = _mm512_add_ps(s, a##i);
    CONVEYOR_R8(SUM)
#undef SUM
    return _mm512_reduce_add_ps(s);
#else
#define DECL(i) __m256 a##i = _mm256_set1_ps(0.001f * (i + omp_get_thread_num()));
    CONVEYOR_R8(DECL)
#undef DECL
    __m256 x = _mm256_set1_ps(0.5f), y = _mm256_set1_ps(0.25f);
    for (int64_t it = 0; it < iters; ++it) {
#define STEP(i) a##i = _mm256_fmadd_ps(a##i, x, y);
        CONVEYOR_R8(STEP) CONVEYOR_R8(STEP)
#undef STEP
    }
    __m256 s = _mm256_setzero_ps();
#define SUM(i) s = _mm256_add_ps(s, a##i);
    CONVEYOR_R8(SUM)
#undef SUM
    float out[8];
    _mm256_storeu_ps(out, s);
    return out[0];
#endif
}
constexpr double kFmaLanes =
#if defined(__AVX512F__)
    16;
#else
    8;
#endif

// The AVX2 kernel's own shape: two weight vectors against four rows' broadcast activations, each row's
// two products summed into its accumulator (ten registers; with six accumulators of six weights GCC
// kept half of them on the stack and the loop timed store forwarding, not the multiplier).
#define CONVEYOR_BARRIER __asm__ volatile("" : "+x"(w0), "+x"(w1), "+x"(x0), "+x"(x1), "+x"(x2), "+x"(x3))
#define CONVEYOR_ROWS(X) X(0, x0, x1) X(1, x1, x2) X(2, x2, x3) X(3, x3, x0)

double i16_loop(int64_t iters) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    __m256i w0 = _mm256_set1_epi8(1), w1 = _mm256_set1_epi8(2);
    const char t = static_cast<char>(omp_get_thread_num());
    __m256i x0 = _mm256_set1_epi8(t + 3), x1 = _mm256_set1_epi8(t + 4), x2 = _mm256_set1_epi8(t + 5), x3 = _mm256_set1_epi8(t + 6);
    for (int64_t it = 0; it < iters; ++it) {
#define STEP(i, p, q) a##i = _mm256_add_epi16(a##i, _mm256_add_epi16(_mm256_maddubs_epi16(w0, p), _mm256_maddubs_epi16(w1, q)));
        CONVEYOR_ROWS(STEP)
#undef STEP
        CONVEYOR_BARRIER;
    }
    return _mm256_extract_epi16(_mm256_add_epi16(_mm256_add_epi16(a0, a1), _mm256_add_epi16(a2, a3)), 0);
}

double i32_loop(int64_t iters) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    __m256i w0 = _mm256_set1_epi8(1), w1 = _mm256_set1_epi8(2);
    const char t = static_cast<char>(omp_get_thread_num());
    __m256i x0 = _mm256_set1_epi8(t + 3), x1 = _mm256_set1_epi8(t + 4), x2 = _mm256_set1_epi8(t + 5), x3 = _mm256_set1_epi8(t + 6);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t it = 0; it < iters; ++it) {
#define STEP(i, p, q)                                                                  \
    a##i = _mm256_add_epi32(a##i, _mm256_madd_epi16(_mm256_maddubs_epi16(w0, p), ones)); \
    a##i = _mm256_add_epi32(a##i, _mm256_madd_epi16(_mm256_maddubs_epi16(w1, q), ones));
        CONVEYOR_ROWS(STEP)
#undef STEP
        CONVEYOR_BARRIER;
    }
    return _mm256_extract_epi32(_mm256_add_epi32(_mm256_add_epi32(a0, a1), _mm256_add_epi32(a2, a3)), 0);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
double vnni_loop(int64_t iters) {
#define DECL(i) __m512i a##i = _mm512_set1_epi32(i);  // distinct, or the compiler merges the chains
    CONVEYOR_R8(DECL)
#undef DECL
    __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(static_cast<char>(omp_get_thread_num() + 2));
    for (int64_t it = 0; it < iters; ++it) {
#define STEP(i) a##i = _mm512_dpbusd_epi32(a##i, w, x);
        CONVEYOR_R8(STEP)
#undef STEP
    }
    __m512i s = _mm512_setzero_si512();
#define SUM(i) s = _mm512_add_epi32(s, a##i);
    CONVEYOR_R8(SUM)
#undef SUM
    return _mm512_reduce_add_epi32(s);
}
constexpr double kVnniOps = 8 * 64 * 2;
#elif defined(__AVXVNNI__)
double vnni_loop(int64_t iters) {
#define DECL(i) __m256i a##i = _mm256_set1_epi32(i);
    CONVEYOR_R8(DECL)
#undef DECL
    __m256i w = _mm256_set1_epi8(3), x = _mm256_set1_epi8(static_cast<char>(omp_get_thread_num() + 2));
    for (int64_t it = 0; it < iters; ++it) {
#define STEP(i) a##i = _mm256_dpbusd_avx_epi32(a##i, w, x);
        CONVEYOR_R8(STEP)
#undef STEP
    }
    __m256i s = _mm256_setzero_si256();
#define SUM(i) s = _mm256_add_epi32(s, a##i);
    CONVEYOR_R8(SUM)
#undef SUM
    return _mm256_extract_epi32(s, 0);
}
constexpr double kVnniOps = 8 * 32 * 2;
#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__)
double bf16_loop(int64_t iters) {
#define DECL(i) __m512 a##i = _mm512_set1_ps(i);
    CONVEYOR_R8(DECL)
#undef DECL
    const __m512bh w = (__m512bh)_mm512_set1_epi16(0x3F80), x = (__m512bh)_mm512_set1_epi16(0x3F00);
    for (int64_t it = 0; it < iters; ++it) {
#define STEP(i) a##i = _mm512_dpbf16_ps(a##i, w, x);
        CONVEYOR_R8(STEP)
#undef STEP
    }
    __m512 s = _mm512_setzero_ps();
#define SUM(i) s = _mm512_add_ps(s, a##i);
    CONVEYOR_R8(SUM)
#undef SUM
    return _mm512_reduce_add_ps(s);
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
// Linux hands out the AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA).
bool request_amx() { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }

struct TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

template <bool Int8>
double amx_loop(int64_t iters) {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    _tile_loadconfig(&cfg);
    alignas(64) static thread_local uint8_t buf[16 * 64] = {};
    _tile_zero(0);  // macros: tile numbers must be literals
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, buf, 64);
    _tile_loadd(5, buf, 64);
    _tile_loadd(6, buf, 64);
    _tile_loadd(7, buf, 64);
    for (int64_t it = 0; it < iters; ++it) {
        if constexpr (Int8) {
            _tile_dpbssd(0, 4, 6);
            _tile_dpbssd(1, 4, 7);
            _tile_dpbssd(2, 5, 6);
            _tile_dpbssd(3, 5, 7);
        } else {
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    alignas(64) int32_t out[16 * 16];
    _tile_stored(0, out, 64);
    _tile_release();
    return out[0];
}
#endif

}  // namespace

// The paths this build can measure, in the order `peak_gops` knows them.
static std::vector<std::string> peak_kinds() {
    std::vector<std::string> kinds;
#if defined(__AVX2__) && defined(__FMA__)
    kinds.insert(kinds.end(), {"fp32-fma", "int8-i16", "int8-i32"});
#endif
#if (defined(__AVX512F__) && defined(__AVX512VNNI__)) || defined(__AVXVNNI__)
    kinds.push_back("int8-vnni");
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    kinds.push_back("bf16-avx512");
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
    if (request_amx()) kinds.insert(kinds.end(), {"amx-bf16", "amx-int8"});
#endif
    return kinds;
}

// GOP/s of path `kind` on `threads` threads (about 0.1-0.3 s of work on this CPU).
static double peak_gops(const std::string& kind, int64_t threads) {
    CONVEYOR_CHECK(threads >= 1, "threads must be >= 1");
    const int t = static_cast<int>(threads);
#if defined(__AVX2__) && defined(__FMA__)
    if (kind == "fp32-fma") return rate(t, 16 * kFmaLanes * 2, 4000000, fma_loop);
    if (kind == "int8-i16") return rate(t, 8 * 32 * 2, 8000000, i16_loop);
    if (kind == "int8-i32") return rate(t, 8 * 32 * 2, 4000000, i32_loop);
#endif
#if (defined(__AVX512F__) && defined(__AVX512VNNI__)) || defined(__AVXVNNI__)
    if (kind == "int8-vnni") return rate(t, kVnniOps, 8000000, vnni_loop);
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    if (kind == "bf16-avx512") return rate(t, 8 * 32 * 2, 8000000, bf16_loop);
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
    if (kind == "amx-bf16" && request_amx()) return rate(t, 4 * 16 * 16 * 32 * 2, 2000000, amx_loop<false>);
    if (kind == "amx-int8" && request_amx()) return rate(t, 4 * 16 * 16 * 64 * 2, 2000000, amx_loop<true>);
#endif
    std::string have;
    for (const std::string& k : peak_kinds()) have += (have.empty() ? "" : ", ") + k;
    conveyor::fail("no peak loop for path '", kind, "' in this build (it has: ", have, ")");
}

// The instruction paths this build measures, comma-separated.
CONVEYOR_API const char* conveyor_peak_kinds() {
    static const std::string kinds = [] {
        std::string joined;
        for (const std::string& k : peak_kinds()) joined += (joined.empty() ? "" : ",") + k;
        return joined;
    }();
    return kinds.c_str();
}

// GOP/s of one instruction path on `threads` threads, into *gops.
CONVEYOR_API int conveyor_peak_gops(const char* kind, int64_t threads, double* gops) {
    return conveyor::guarded(1, [&] { *gops = peak_gops(kind, threads); });
}
