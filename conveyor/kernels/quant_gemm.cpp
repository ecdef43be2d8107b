// The batched GEMM over tiled quantized weights (quant_layout.h) and int8-quantized activations
// (`Activations`, packed in groups of kPackRows rows): out [M, N] = x [M, K] W^T.
//
// The microkernel takes one tile (16 output rows) against MR activation rows. Per block of 32, each
// chunk of the tile (four weights of every row) is loaded and unpacked once and multiplied with the
// four activation bytes of each of the MR rows, broadcast from the packed group (one pointer,
// constant offsets); the MR integer accumulators are independent chains kept in registers. At the
// block's end each row's integer sum is scaled into its fp32 accumulator: cvt + (d_w x d_x) + FMA,
// one FMA more for a minimum (Q4_1, Q4_K: m_w times the activation block's sum). Offsets that make
// the weights unsigned for vpdpbusd (Q4_0's -8, the +128 of signed bytes) are taken back in the
// integer domain: the accumulators start at -8 or -128 times the activation block's integer sum (a
// broadcast load, no arithmetic). The two scales per block of Q2_K, Q3_K and Q6_K take two integer
// sums, one per half; Q3_K's -4 and Q6_K's -32 are taken back from the half's sum, Q2_K's minimums
// need its value. Q6_K's 6-bit values are put together from their nibbles and 2-bit planes.
// Q5_K's fifth bits are added to its nibbles from their masks, and the IQ4 types' nibbles become
// their values plus 128 by a byte shuffle (the +128 taken back as for signed bytes).
// Everything the loops branch on is a template parameter, so they unroll fully.
//
// Measured (AVX512-VNNI Xeon, 1 thread, Q4_1, 3072 x 576): ~400 GFLOP/s from 16 rows on, 85% of
// vpdpbusd's measured peak (`bench/peaks.py`); the row-by-row kernel it replaced ran at ~300, and the
// K-quants' per-row kernels at 20-45. At 256 rows the output, not the arithmetic, was the limit: a
// tile's 16 columns of 256 rows are 256 lines in as many pages, each a cache miss that its store
// waited on (45-52% of that peak). The next tile's output lines are now fetched while a tile computes
// (68-77%), and an fp32 output of 8 MiB or more (the LM head's logits) is written around the caches
// (`TileOut::stream`).
#include "quant_layout.h"
#include "vec_math.h"


#include <array>
#include <type_traits>
#include <utility>

namespace conveyor {
namespace {

inline int32_t word(const int8_t* p) {
    int32_t w;
    std::memcpy(&w, p, 4);
    return w;
}

// An IQ4-style table plus 128: its values as unsigned bytes for vpdpbusd.
struct IQ4Unsigned {
    uint8_t v[16];
    constexpr explicit IQ4Unsigned(const int8_t* values) : v{} {
        for (int i = 0; i < 16; ++i) v[i] = static_cast<uint8_t>(values[i] + 128);
    }
};
alignas(16) constexpr IQ4Unsigned kIQ4Unsigned{kIQ4Values};
alignas(16) constexpr IQ4Unsigned kMXFP4Unsigned{kMXFP4Values};
template <int64_t T>
constexpr const uint8_t* unsigned_values() { return T == MXFP4 ? kMXFP4Unsigned.v : kIQ4Unsigned.v; }

#if defined(__AVX2__)
// How far ahead of the block being read the weight stream is prefetched.
constexpr int64_t kPrefetchBytes = 2048;

inline void prefetch_group(int64_t T, const uint8_t* blk) {
    for (int64_t line = 0; line < block_bytes(T); line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetchBytes + line), _MM_HINT_T0);
}
#endif

// Where each row's integer accumulator starts: the activation block's -8 x sum (Q4_0) or -128 x sum
// (signed 8-bit weights and the IQ4 values made unsigned), per half block for the types with a scale
// per half (Q3_K: that / 32, its -4; Q6_K: / 4, its -32); Q2_K, Q4_1, Q4_K and Q5_K start at 0.
template <int64_t T>
const int32_t* start_values(const Activations& a) {
    if constexpr (T == Q4_0) return a.neg8.data();
    else if constexpr (has_half_scales(T)) return a.neg128h.data();
    else return a.neg128.data();
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include "quant_gemm_avx512.h"
#elif defined(__AVX2__)
#include "quant_gemm_avx2.h"
#else
#include "quant_gemm_plain.h"
#endif

using TileFn = void (*)(const uint8_t*, const float*, const Activations&, int64_t, int64_t, int64_t, const TileOut&);

// kTileFns<T>[MR - 1]: the microkernel of type T for MR activation rows.
template <int64_t T, int... I>
constexpr std::array<TileFn, sizeof...(I)> make_table(std::integer_sequence<int, I...>) {
    return {tile_rows<T, I + 1>...};
}
template <int64_t T>
constexpr auto kTileFns = make_table<T>(std::make_integer_sequence<int, kPassRows>{});

template <int64_t T>
void typed_tiles_matmul(const uint8_t* w, const float* row_scales, const Activations& a, int64_t t0, int64_t t1,
                        int64_t N, const TileOut& out) {
    const int64_t tb = tile_bytes(T, a.K);
    for (int64_t t = t0; t < t1; ++t) {
        for (int64_t m0 = 0; m0 < a.M; m0 += kPassRows) {
            const int mb = static_cast<int>(std::min<int64_t>(kPassRows, a.M - m0));
            kTileFns<T>[mb - 1](w + t * tb, row_scales, a, m0, t * kTileRows, N, out);
        }
    }
#if defined(__SSE2__)
    if (out.stream) _mm_sfence();  // the streamed lines are visible before the caller's threads join
#endif
}

}  // namespace

void tiles_matmul(int64_t type, const uint8_t* w, const float* row_scales, const Activations& a, int64_t t0,
                  int64_t t1, int64_t N, const TileOut& out) {
    switch (type) {
        case Q4_0: return typed_tiles_matmul<Q4_0>(w, row_scales, a, t0, t1, N, out);
        case Q4_1: return typed_tiles_matmul<Q4_1>(w, row_scales, a, t0, t1, N, out);
        case Q8_0: return typed_tiles_matmul<Q8_0>(w, row_scales, a, t0, t1, N, out);
        case Q2_K: return typed_tiles_matmul<Q2_K>(w, row_scales, a, t0, t1, N, out);
        case Q3_K: return typed_tiles_matmul<Q3_K>(w, row_scales, a, t0, t1, N, out);
        case Q4_K: return typed_tiles_matmul<Q4_K>(w, row_scales, a, t0, t1, N, out);
        case Q5_K: return typed_tiles_matmul<Q5_K>(w, row_scales, a, t0, t1, N, out);
        case Q6_K: return typed_tiles_matmul<Q6_K>(w, row_scales, a, t0, t1, N, out);
        case IQ4_NL: return typed_tiles_matmul<IQ4_NL>(w, row_scales, a, t0, t1, N, out);
        case IQ4_XS: return typed_tiles_matmul<IQ4_XS>(w, row_scales, a, t0, t1, N, out);
        case MXFP4: return typed_tiles_matmul<MXFP4>(w, row_scales, a, t0, t1, N, out);
        case I8: return typed_tiles_matmul<I8>(w, row_scales, a, t0, t1, N, out);
        case BF16: return typed_tiles_matmul<BF16>(w, row_scales, a, t0, t1, N, out);
        case F32: return typed_tiles_matmul<F32>(w, row_scales, a, t0, t1, N, out);
        default: fail("type ", type, " has no tiled layout");
    }
}

}  // namespace conveyor
