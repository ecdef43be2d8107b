// The GEMM microkernel `tile_rows<T, MR>` for one instruction path (AVX512-VNNI, 16 output rows a vector).
// Included by quant_gemm.cpp inside its namespaces, after the helpers it uses.
#pragma once

constexpr int kPassRows = kPackRows;  // MR: 12 integer + 12 fp32 accumulators + the chunk vectors fit 32 registers

inline __m512 cvt_u8(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))); }
inline __m512 cvt_i8(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))); }
inline __m512 cvt_f16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __mmask64 mask64(const uint8_t* p) {
    uint64_t m;
    std::memcpy(&m, p, 8);
    return _cvtu64_mask64(m);
}

// dot[i] += the products of an 8-bit block (signed, made unsigned) with row i.
template <int MR>
inline void dot8(const uint8_t* blk, const int8_t* x, __m512i* dot) {
    const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
        const __m512i w = _mm512_xor_si512(_mm512_loadu_si512(blk + 64 * j), bias);
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) dot[i] = _mm512_dpbusd_epi32(dot[i], w, _mm512_set1_epi32(word(x + (j * MR + i) * 4)));
    }
}

template <int MR>
inline void scale_into(const __m512i* dot, __m512 wd, const float* xd, __m512* acc) {
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i)
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i]), _mm512_mul_ps(wd, _mm512_set1_ps(xd[i])), acc[i]);
}

// Dense tiles (W = bf16 or float): per input k, the tile's 16 weights (bf16 widened to fp32, a shift)
// and one FMA per activation row, broadcast from the packed fp32 group. Over bf16 activations on CPUs
// where vdpbf16ps keeps the FMA's rate, bf16 tiles take `dense_pairs_pass` instead (two products an
// instruction); on Intel's AVX-512 Xeons without AMX it runs at half that rate (`tools/roofline`'s
// peaks: bf16-avx512 82 GFLOP/s a core, fp32-fma 163), no faster than this.
template <typename W, int MR>
void dense_pass(const uint8_t* tile, const Activations& a, int64_t m0, bool prefetch, __m512* acc) {
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
    const float* x = a.f.data() + m0 * a.K;
    const W* w = reinterpret_cast<const W*>(tile);
    for (int64_t k = 0; k < a.K; ++k, x += MR, w += kTileRows) {
        if (prefetch && (sizeof(W) == 4 || k % 2 == 0))  // a cache line: 2 steps of bf16, 1 of fp32
            _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes, _MM_HINT_T0);
        const __m512 wv = load16(w);
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) acc[i] = _mm512_fmadd_ps(wv, _mm512_set1_ps(x[i]), acc[i]);
    }
}

#if defined(__AVX512BF16__)
// BF16 tiles against bf16 pairs (`Activations::bp`, where `bf16_pair_products`): per two inputs k, k + 1
// the tile's two rows of 16 weights, interleaved into pairs by one permute, and one vdpbf16ps per
// activation row (its pair broadcast): the products are exact, each added as by an FMA.
template <int MR>
void dense_pairs_pass(const uint8_t* tile, const Activations& a, int64_t m0, bool prefetch, __m512* acc) {
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
    const uint32_t* x = a.bp.data() + m0 * a.K / 2;
    const bf16* w = reinterpret_cast<const bf16*>(tile);
    alignas(64) static constexpr uint16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                             8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i order = _mm512_load_si512(kInterleave);
    for (int64_t j = 0; j < a.K / 2; ++j, x += MR, w += 2 * kTileRows) {
        if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes, _MM_HINT_T0);
        const __m512bh wp = (__m512bh)_mm512_permutexvar_epi16(order, _mm512_loadu_si512(w));
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i)
            acc[i] = _mm512_dpbf16_ps(acc[i], wp, (__m512bh)_mm512_set1_epi32(static_cast<int>(x[i])));
    }
}
#endif

template <int64_t T, int MR>
void tile_pass(const uint8_t* tile, const Activations& a, int64_t m0, bool prefetch, __m512* result) {
    const int64_t nb = a.nb;
    __m512 acc[MR];
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
    // The packed group (Activations): MR rows' words interleaved, per block MR * 32 bytes and MR of each sum.
    const int8_t* x = a.q.data() + m0 * a.K;
    const float* xd = a.d.data() + m0 * nb;
    const float* xs = a.s32.data() + m0 * nb;
    const int32_t* xstart = start_values<T>(a) + m0 * nb * (has_half_scales(T) ? 2 : 1);
    __m512 hd = _mm512_setzero_ps(), hm = _mm512_setzero_ps();  // a K-quant super-block's d and dmin
    for (int64_t b = 0; b < nb; ++b, x += MR * QK, xd += MR, xs += MR, xstart += MR * (has_half_scales(T) ? 2 : 1)) {
        const uint8_t* blk = tile_block(T, tile, b);
        if (prefetch) prefetch_group(T, blk);  // the first pass over a tile streams it from memory
        if constexpr (has_superblocks(T)) {
            if (b % group_blocks(T) == 0) {
                const uint8_t* head = tile_header(T, tile, b);
                hd = cvt_f16(head);
                if constexpr (T == Q2_K || T == Q4_K || T == Q5_K) hm = cvt_f16(head + 32);
            }
        }
        __m512i dot[MR];
        if constexpr (is4bit(T)) {
#pragma GCC unroll 16
            for (int i = 0; i < MR; ++i)
                dot[i] = T == Q4_0 || is_iq4(T) ? _mm512_set1_epi32(xstart[i]) : _mm512_setzero_si512();
            const __m512i low4 = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 4
            for (int j = 0; j < 4; ++j) {
                const __m512i raw = _mm512_loadu_si512(blk + 64 * j);
                __m512i lo = _mm512_and_si512(raw, low4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
                if constexpr (T == Q5_K) {  // the fifth bits: 16 added where a chunk byte's mask bit is set
                    const __m512i sixteen = _mm512_set1_epi8(16);
                    lo = _mm512_mask_add_epi8(lo, mask64(blk + 256 + 8 * j), lo, sixteen);
                    hi = _mm512_mask_add_epi8(hi, mask64(blk + 256 + 32 + 8 * j), hi, sixteen);
                }
                if constexpr (is_iq4(T)) {
                    const __m512i table =
                        _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(unsigned_values<T>())));
                    lo = _mm512_shuffle_epi8(table, lo), hi = _mm512_shuffle_epi8(table, hi);
                }
#pragma GCC unroll 16
                for (int i = 0; i < MR; ++i) dot[i] = _mm512_dpbusd_epi32(dot[i], lo, _mm512_set1_epi32(word(x + (j * MR + i) * 4)));
#pragma GCC unroll 16
                for (int i = 0; i < MR; ++i)
                    dot[i] = _mm512_dpbusd_epi32(dot[i], hi, _mm512_set1_epi32(word(x + ((j + 4) * MR + i) * 4)));
            }
            const uint8_t* sc = blk + quant_bytes(T);
            if constexpr (T == Q4_K || T == Q5_K) {  // w = (d sc) q - (dmin m)
                scale_into<MR>(dot, _mm512_mul_ps(hd, cvt_u8(sc)), xd, acc);
                const __m512 wm = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(hm, cvt_u8(sc + 16)));
#pragma GCC unroll 16
                for (int i = 0; i < MR; ++i) acc[i] = _mm512_fmadd_ps(wm, _mm512_set1_ps(xs[i]), acc[i]);
            } else if constexpr (T == IQ4_XS) {  // w = (d sc) kvalues[q]
                scale_into<MR>(dot, _mm512_mul_ps(hd, cvt_i8(sc)), xd, acc);
            } else {
                scale_into<MR>(dot, cvt_f16(sc), xd, acc);
                if constexpr (T == Q4_1) {
                    const __m512 wm = cvt_f16(sc + 32);
#pragma GCC unroll 16
                    for (int i = 0; i < MR; ++i) acc[i] = _mm512_fmadd_ps(wm, _mm512_set1_ps(xs[i]), acc[i]);
                }
            }
        } else if constexpr (is2bit(T)) {  // a scale per half block; chunk j: plane j % 2 shifted by 2 (j / 2)
            const __m512i planes[2] = {_mm512_loadu_si512(blk), _mm512_loadu_si512(blk + 64)};
            const __m512i three = _mm512_set1_epi8(3);
            const uint8_t* sc = blk + quant_bytes(T);
#pragma GCC unroll 2
            for (int h = 0; h < 2; ++h) {
#pragma GCC unroll 16
                for (int i = 0; i < MR; ++i) dot[i] = T == Q3_K ? _mm512_set1_epi32(xstart[h * MR + i] / 32) : _mm512_setzero_si512();
#pragma GCC unroll 4
                for (int j = 4 * h; j < 4 * h + 4; ++j) {
                    __m512i q = _mm512_and_si512(_mm512_srli_epi16(planes[j % 2], 2 * (j / 2)), three);
                    if constexpr (T == Q3_K) q = _mm512_mask_add_epi8(q, mask64(blk + 128 + 8 * j), q, _mm512_set1_epi8(4));
#pragma GCC unroll 16
                    for (int i = 0; i < MR; ++i) dot[i] = _mm512_dpbusd_epi32(dot[i], q, _mm512_set1_epi32(word(x + (j * MR + i) * 4)));
                }
                if constexpr (T == Q3_K) {  // w = (d sc) (q - 4)
                    scale_into<MR>(dot, _mm512_mul_ps(hd, cvt_i8(sc + 16 * h)), xd, acc);
                } else {  // w = (d sc) q - (dmin m), sc and m the nibbles of one byte
                    const __m512i packed = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 16 * h)));
                    const __m512 scl = _mm512_cvtepi32_ps(_mm512_and_si512(packed, _mm512_set1_epi32(0xF)));
                    scale_into<MR>(dot, _mm512_mul_ps(hd, scl), xd, acc);
                    const __m512 wm = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(hm, _mm512_cvtepi32_ps(_mm512_srli_epi32(packed, 4))));
#pragma GCC unroll 16
                    for (int i = 0; i < MR; ++i)  // the half's sum from its -128 x sum, exactly
                        acc[i] = _mm512_fmadd_ps(wm, _mm512_set1_ps(xd[i] * static_cast<float>(xstart[h * MR + i] / -128)), acc[i]);
                }
            }
        } else if constexpr (T == Q6_K) {  // a scale per half block: q = nibble | high bits << 4 (0..63)
            const __m512i planes[2] = {_mm512_loadu_si512(blk + 256), _mm512_loadu_si512(blk + 320)};
            const __m512i low4 = _mm512_set1_epi8(0x0F), bits45 = _mm512_set1_epi8(0x30);
            const uint8_t* sc = blk + 384;
#pragma GCC unroll 2
            for (int h = 0; h < 2; ++h) {
#pragma GCC unroll 16
                for (int i = 0; i < MR; ++i) dot[i] = _mm512_set1_epi32(xstart[h * MR + i] / 4);  // -32 x the half's sum
#pragma GCC unroll 4
                for (int c = 0; c < 4; ++c) {  // word j = 4h + c: chunk c's low (h = 0) or high nibbles
                    const int j = 4 * h + c, shift = 4 - 2 * (j / 2);  // its high bits from bits 2 (j / 2) to 4
                    const __m512i raw = _mm512_loadu_si512(blk + 64 * c);
                    const __m512i nib = _mm512_and_si512(h ? _mm512_srli_epi16(raw, 4) : raw, low4);
                    const __m512i high = _mm512_and_si512(
                        shift >= 0 ? _mm512_slli_epi16(planes[j % 2], shift) : _mm512_srli_epi16(planes[j % 2], -shift), bits45);
                    const __m512i q = _mm512_or_si512(nib, high);
#pragma GCC unroll 16
                    for (int i = 0; i < MR; ++i) dot[i] = _mm512_dpbusd_epi32(dot[i], q, _mm512_set1_epi32(word(x + (j * MR + i) * 4)));
                }
                scale_into<MR>(dot, _mm512_mul_ps(hd, cvt_i8(sc + 16 * h)), xd, acc);
            }
        } else {
#pragma GCC unroll 16
            for (int i = 0; i < MR; ++i) dot[i] = _mm512_set1_epi32(xstart[i]);
            dot8<MR>(blk, x, dot);
            if constexpr (T == I8) {  // per-row scales come after the whole sum
#pragma GCC unroll 16
                for (int i = 0; i < MR; ++i) acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i]), _mm512_set1_ps(xd[i]), acc[i]);
            } else {
                scale_into<MR>(dot, cvt_f16(blk + 512), xd, acc);
            }
        }
    }
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) result[i] = acc[i];
}

template <int64_t T, int MR>
void tile_rows(const uint8_t* tile, const float* scales, const Activations& a, int64_t m0, int64_t n0, int64_t N,
               const TileOut& out) {
    // The next tile's output lines of these rows, fetched while this one computes: at a wide output
    // (the LM head's 49k columns) each row's line is in another page and misses every cache, and
    // the stores stalled on those reads (256 rows: 43-60 ms a call against 35 for the same tiles
    // into a buffer that stays in L2).
    if (!out.stream && n0 + kTileRows < N)
        for (int i = 0; i < MR; ++i) _mm_prefetch(out.address(m0 + i, n0 + kTileRows), _MM_HINT_T0);
    __m512 res[MR];
    if constexpr (T == BF16) {
#if defined(__AVX512BF16__)
        if (a.pairs) dense_pairs_pass<MR>(tile, a, m0, m0 == 0, res);
        else
#endif
            dense_pass<bf16, MR>(tile, a, m0, m0 == 0, res);
    }
    else if constexpr (T == F32) dense_pass<float, MR>(tile, a, m0, m0 == 0, res);
    else tile_pass<T, MR>(tile, a, m0, m0 == 0, res);
    const int64_t valid = std::min<int64_t>(kTileRows, N - n0);
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
    const __m512 sv = scales ? _mm512_maskz_loadu_ps(mask, scales + n0) : _mm512_set1_ps(1.f);
    const __m512 bv = out.bias ? _mm512_maskz_loadu_ps(mask, out.bias + n0) : _mm512_setzero_ps();
    for (int i = 0; i < MR; ++i) {
        const __m512 v = _mm512_fmadd_ps(res[i], sv, bv);
        const int64_t at = out.at(m0 + i, n0);
        if (out.stream && valid == kTileRows) _mm512_stream_ps(static_cast<float*>(out.data) + at, v);
        else if (out.bf16) store16(static_cast<bf16*>(out.data) + at, v, mask);
        else store16(static_cast<float*>(out.data) + at, v, mask);
    }
}
