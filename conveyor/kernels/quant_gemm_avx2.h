// The GEMM microkernel `tile_rows<T, MR>` for one instruction path (AVX2, with or without AVX-VNNI, 8 output rows a vector).
// Included by quant_gemm.cpp inside its namespaces, after the helpers it uses.
#pragma once

// 8 output rows per vector: a tile is two halves, each swept over the blocks on its own (16 ymm
// registers do not hold both halves' weights and accumulators), MR = 4 activation rows a pass from the
// packed groups, as in quant_gemm_avx512.h. With AVX-VNNI the same scheme as AVX-512's; without it, 4-bit weights
// (0..15) times int8 activations go through vpmaddubsw, whose pair sums fit int16 for a whole block
// (8 x 2 x 15 x 127 < 32767): summed there and widened once a block by one vpmaddwd (the multiplier
// port is the limit); 8-bit weights take |w| times the activations carrying w's sign (no saturation)
// and widen every product pair, with no offset to take back.
constexpr int kPassRows = kPackRows;

// Opaque to the compiler's reassociation of integer adds: without it GCC computes a whole block's products
// before summing any (the sums reordered into one chain each), which spills most of them at four rows.
// Blocks summed in int16 whole only (4-bit): Q5_K's, Q6_K's, Q2_K's and Q3_K's ran slower with it.
inline void in_order(__m256i& v) { __asm__("" : "+x"(v)); }
inline __m256i bcast4(const int8_t* p) { return _mm256_set1_epi32(word(p)); }
inline __m128i load16b(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline __m256 cvt_u8x8(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))); }
inline __m256 cvt_i8x8(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))); }
inline __m256 cvt_f16x8(const uint8_t* p) { return _mm256_cvtph_ps(load16b(p)); }
// 32 mask bits (Q3_K, Q5_K) as 32 bytes of `value` (bit set) or 0: byte i takes mask byte i / 8, tests bit i % 8.
inline __m256i high_bytes(const uint8_t* p, char value) {
    uint32_t bits;
    std::memcpy(&bits, p, 4);
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3,
                                            3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ull));
    const __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), spread), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(v, bit), _mm256_set1_epi8(value));
}
// A chunk half's nibbles as the weights the dot product takes: Q5_K's fifth bits added, the IQ4 values
// looked up (plus 128 for vpdpbusd, or signed for the vpmaddubsw path).
template <int64_t T>
inline void expand_nibbles(const uint8_t* blk, int j, int half, __m256i& lo, __m256i& hi, bool unsigned_iq4) {
    if constexpr (T == Q5_K) {
        lo = _mm256_or_si256(lo, high_bytes(blk + 256 + 8 * j + 4 * half, 16));
        hi = _mm256_or_si256(hi, high_bytes(blk + 256 + 32 + 8 * j + 4 * half, 16));
    }
    if constexpr (is_iq4(T)) {
        const __m128i t = unsigned_iq4 ? _mm_load_si128(reinterpret_cast<const __m128i*>(unsigned_values<T>()))
                                       : _mm_loadu_si128(reinterpret_cast<const __m128i*>(iq4_values(T)));
        const __m256i table = _mm256_broadcastsi128_si256(t);
        lo = _mm256_shuffle_epi8(table, lo), hi = _mm256_shuffle_epi8(table, hi);
    }
}

// dot[i] (+)= the products of an 8-bit block's half `half` with row i.
template <int MR>
inline void dot8(const uint8_t* blk, int half, const int8_t* x, __m256i* dot) {
#if defined(__AVXVNNI__)
    const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
        const __m256i w = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * j + 32 * half)), bias);
        for (int i = 0; i < MR; ++i) dot[i] = _mm256_dpbusd_avx_epi32(dot[i], w, bcast4(x + (j * MR + i) * 4));
    }
#else
    const __m256i ones = _mm256_set1_epi16(1);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * j + 32 * half));
        const __m256i u = _mm256_sign_epi8(w, w);
        for (int i = 0; i < MR; ++i)
            dot[i] = _mm256_add_epi32(dot[i], _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_sign_epi8(bcast4(x + (j * MR + i) * 4), w)), ones));
    }
#endif
}

// The integer accumulators' start for 8-bit weights: the offset of the unsigned form, or none.
template <int MR>
inline void start8(const int32_t* xstart, __m256i* dot) {
#if defined(__AVXVNNI__)
    for (int i = 0; i < MR; ++i) dot[i] = _mm256_set1_epi32(xstart[i]);
#else
    (void)xstart;
    for (int i = 0; i < MR; ++i) dot[i] = _mm256_setzero_si256();
#endif
}

template <int MR>
inline void scale_into(const __m256i* dot, __m256 wd, const float* xd, __m256* acc) {
    for (int i = 0; i < MR; ++i)
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i]), _mm256_mul_ps(wd, _mm256_set1_ps(xd[i])), acc[i]);
}

// The next tile, fetched into L2 while this one computes: each of the two halves' `steps` iterations
// takes its share of the lines, so the memory stays busy while the second half reads the tile from cache
// (a prefetch ahead within the tile leaves it idle then). The last tile, and tiles that several passes
// read (more rows than a pass), prefetch themselves ahead instead.
class NextTile {
  public:
    NextTile(const uint8_t* tile, int64_t bytes, int64_t steps)
        : tile_(tile), bytes_(bytes), share_(tile ? (bytes + steps - 1) / steps : 0) {}
    bool active() const { return tile_ != nullptr; }
    void fetch() {
        if (!tile_) return;
        end_ = std::min(end_ + share_, bytes_);
        for (; off_ < end_; off_ += 64) _mm_prefetch(reinterpret_cast<const char*>(tile_ + off_), _MM_HINT_T1);
    }

  private:
    const uint8_t* tile_;
    int64_t bytes_, share_, off_ = 0, end_ = 0;
};

template <typename W, int MR>
void dense_half_pass(const uint8_t* tile, int half, const Activations& a, int64_t m0, bool prefetch, __m256* acc,
                     NextTile& next) {
    for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
    const float* x = a.f.data() + m0 * a.K;
    const uint8_t* w = tile + 8 * sizeof(W) * half;
    for (int64_t k = 0; k < a.K; ++k, x += MR, w += sizeof(W) * kTileRows) {
        if (prefetch && (sizeof(W) == 4 || k % 2 == 0)) _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes, _MM_HINT_T0);
        next.fetch();
        const __m256 wv = sizeof(W) == 4 ? _mm256_loadu_ps(reinterpret_cast<const float*>(w))
                                         : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(load16b(w)), 16));
        for (int i = 0; i < MR; ++i) acc[i] = _mm256_fmadd_ps(wv, _mm256_set1_ps(x[i]), acc[i]);
    }
}

template <int64_t T, int MR>
void half_pass(const uint8_t* tile, int half, const Activations& a, int64_t m0, bool prefetch, __m256* result,
               NextTile& next) {
    const int64_t nb = a.nb;
    __m256 acc[MR];
    for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
    const int8_t* x = a.q.data() + m0 * a.K;
    const float* xd = a.d.data() + m0 * nb;
    const float* xs = a.s32.data() + m0 * nb;
    const int32_t* xstart = start_values<T>(a) + m0 * nb * (has_half_scales(T) ? 2 : 1);
    __m256 hd = _mm256_setzero_ps(), hm = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b, x += MR * QK, xd += MR, xs += MR, xstart += MR * (has_half_scales(T) ? 2 : 1)) {
        const uint8_t* blk = tile_block(T, tile, b);
        if (prefetch) prefetch_group(T, blk);
        next.fetch();
        if constexpr (has_superblocks(T)) {
            if (b % group_blocks(T) == 0) {
                const uint8_t* head = tile_header(T, tile, b);
                hd = cvt_f16x8(head + 16 * half);
                if constexpr (T == Q2_K || T == Q4_K || T == Q5_K) hm = cvt_f16x8(head + 32 + 16 * half);
            }
        }
        __m256i dot[MR];
        if constexpr (is4bit(T)) {
            const __m256i low4 = _mm256_set1_epi8(0x0F);
#if defined(__AVXVNNI__)
            for (int i = 0; i < MR; ++i) dot[i] = T == Q4_0 || is_iq4(T) ? _mm256_set1_epi32(xstart[i]) : _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int j = 0; j < 4; ++j) {
                const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * j + 32 * half));
                __m256i lo = _mm256_and_si256(raw, low4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
                expand_nibbles<T>(blk, j, half, lo, hi, true);
                for (int i = 0; i < MR; ++i) dot[i] = _mm256_dpbusd_avx_epi32(dot[i], lo, bcast4(x + (j * MR + i) * 4));
                for (int i = 0; i < MR; ++i) dot[i] = _mm256_dpbusd_avx_epi32(dot[i], hi, bcast4(x + ((j + 4) * MR + i) * 4));
            }
#else
            const __m256i ones = _mm256_set1_epi16(1);
            for (int i = 0; i < MR; ++i) dot[i] = T == Q4_0 ? _mm256_set1_epi32(xstart[i]) : _mm256_setzero_si256();
            if constexpr (is_iq4(T)) {  // signed values: |w| times x carrying w's sign (a pair sum up to
                // 2 x 127 x 127: each product pair widened on its own, as two would overflow int16)
#pragma GCC unroll 8
                for (int j = 0; j < 4; ++j) {
                    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * j + 32 * half));
                    __m256i lo = _mm256_and_si256(raw, low4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
                    expand_nibbles<T>(blk, j, half, lo, hi, false);
                    const __m256i ulo = _mm256_sign_epi8(lo, lo), uhi = _mm256_sign_epi8(hi, hi);
                    for (int i = 0; i < MR; ++i) {
                        const __m256i plo = _mm256_maddubs_epi16(ulo, _mm256_sign_epi8(bcast4(x + (j * MR + i) * 4), lo));
                        const __m256i phi = _mm256_maddubs_epi16(uhi, _mm256_sign_epi8(bcast4(x + ((j + 4) * MR + i) * 4), hi));
                        dot[i] = _mm256_add_epi32(dot[i], _mm256_add_epi32(_mm256_madd_epi16(plo, ones), _mm256_madd_epi16(phi, ones)));
                    }
                }
            } else {
                // Pair sums stay in int16 for as many chunks as cannot overflow it: 4 x 2 x 2 x 15 x 127
                // for nibbles, 2 x 2 x 2 x 31 x 127 for Q5_K's 5-bit values.
                constexpr int kWiden = T == Q5_K ? 2 : 4;
                __m256i s16[MR];
#pragma GCC unroll 8
                for (int j = 0; j < 4; ++j) {
                    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * j + 32 * half));
                    __m256i lo = _mm256_and_si256(raw, low4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
                    expand_nibbles<T>(blk, j, half, lo, hi, false);
                    for (int i = 0; i < MR; ++i) {
                        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(x + (j * MR + i) * 4)),
                                                           _mm256_maddubs_epi16(hi, bcast4(x + ((j + 4) * MR + i) * 4)));
                        s16[i] = j % kWiden == 0 ? p : _mm256_add_epi16(s16[i], p);
                        if constexpr (kWiden == 4) in_order(s16[i]);
                    }
                    if (j % kWiden == kWiden - 1)
                        for (int i = 0; i < MR; ++i) dot[i] = _mm256_add_epi32(dot[i], _mm256_madd_epi16(s16[i], ones));
                }
            }
#endif
            const uint8_t* sc = blk + quant_bytes(T);
            if constexpr (T == Q4_K || T == Q5_K) {
                scale_into<MR>(dot, _mm256_mul_ps(hd, cvt_u8x8(sc + 8 * half)), xd, acc);
                const __m256 wm = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(hm, cvt_u8x8(sc + 16 + 8 * half)));
                for (int i = 0; i < MR; ++i) acc[i] = _mm256_fmadd_ps(wm, _mm256_set1_ps(xs[i]), acc[i]);
            } else if constexpr (T == IQ4_XS) {
                scale_into<MR>(dot, _mm256_mul_ps(hd, cvt_i8x8(sc + 8 * half)), xd, acc);
            } else {
                scale_into<MR>(dot, cvt_f16x8(sc + 16 * half), xd, acc);
                if constexpr (T == Q4_1) {
                    const __m256 wm = cvt_f16x8(sc + 32 + 16 * half);
                    for (int i = 0; i < MR; ++i) acc[i] = _mm256_fmadd_ps(wm, _mm256_set1_ps(xs[i]), acc[i]);
                }
            }
        } else if constexpr (is2bit(T)) {
            const __m256i planes[2] = {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 * half)),
                                       _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 + 32 * half))};
            const __m256i three = _mm256_set1_epi8(3);
            const uint8_t* sc = blk + quant_bytes(T);
#pragma GCC unroll 8
            for (int h = 0; h < 2; ++h) {
                for (int i = 0; i < MR; ++i) dot[i] = T == Q3_K ? _mm256_set1_epi32(xstart[h * MR + i] / 32) : _mm256_setzero_si256();
#if !defined(__AVXVNNI__)
                __m256i s16[MR];  // pair sums of at most 2 x 7 x 127, four chunks: int16 holds them
#endif
#pragma GCC unroll 8
                for (int j = 4 * h; j < 4 * h + 4; ++j) {
                    __m256i q = _mm256_and_si256(_mm256_srli_epi16(planes[j % 2], 2 * (j / 2)), three);
                    if constexpr (T == Q3_K) q = _mm256_or_si256(q, high_bytes(blk + 128 + 8 * j + 4 * half, 4));
#if defined(__AVXVNNI__)
                    for (int i = 0; i < MR; ++i) dot[i] = _mm256_dpbusd_avx_epi32(dot[i], q, bcast4(x + (j * MR + i) * 4));
#else
                    for (int i = 0; i < MR; ++i) {
                        const __m256i p = _mm256_maddubs_epi16(q, bcast4(x + (j * MR + i) * 4));
                        s16[i] = j == 4 * h ? p : _mm256_add_epi16(s16[i], p);
                    }
#endif
                }
#if !defined(__AVXVNNI__)
                for (int i = 0; i < MR; ++i) dot[i] = _mm256_add_epi32(dot[i], _mm256_madd_epi16(s16[i], _mm256_set1_epi16(1)));
#endif
                if constexpr (T == Q3_K) {
                    scale_into<MR>(dot, _mm256_mul_ps(hd, cvt_i8x8(sc + 16 * h + 8 * half)), xd, acc);
                } else {
                    const __m256i packed = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 16 * h + 8 * half)));
                    const __m256 scl = _mm256_cvtepi32_ps(_mm256_and_si256(packed, _mm256_set1_epi32(0xF)));
                    scale_into<MR>(dot, _mm256_mul_ps(hd, scl), xd, acc);
                    const __m256 wm = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(hm, _mm256_cvtepi32_ps(_mm256_srli_epi32(packed, 4))));
                    for (int i = 0; i < MR; ++i)
                        acc[i] = _mm256_fmadd_ps(wm, _mm256_set1_ps(xd[i] * static_cast<float>(xstart[h * MR + i] / -128)), acc[i]);
                }
            }
        } else if constexpr (T == Q6_K) {  // as the AVX-512 kernel: q = nibble | high bits << 4 (0..63)
            const __m256i planes[2] = {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 256 + 32 * half)),
                                       _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 320 + 32 * half))};
            const __m256i low4 = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30);
            const uint8_t* sc = blk + 384;
#pragma GCC unroll 8
            for (int h = 0; h < 2; ++h) {
                for (int i = 0; i < MR; ++i) dot[i] = _mm256_set1_epi32(xstart[h * MR + i] / 4);
#if !defined(__AVXVNNI__)
                __m256i s16[MR];  // pair sums of at most 2 x 63 x 127, two chunks: int16 holds them
#endif
#pragma GCC unroll 8
                for (int c = 0; c < 4; ++c) {
                    const int j = 4 * h + c, shift = 4 - 2 * (j / 2);
                    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * c + 32 * half));
                    const __m256i nib = _mm256_and_si256(h ? _mm256_srli_epi16(raw, 4) : raw, low4);
                    const __m256i high = _mm256_and_si256(
                        shift >= 0 ? _mm256_slli_epi16(planes[j % 2], shift) : _mm256_srli_epi16(planes[j % 2], -shift), bits45);
                    const __m256i q = _mm256_or_si256(nib, high);
#if defined(__AVXVNNI__)
                    for (int i = 0; i < MR; ++i) dot[i] = _mm256_dpbusd_avx_epi32(dot[i], q, bcast4(x + (j * MR + i) * 4));
#else
                    for (int i = 0; i < MR; ++i) {
                        const __m256i p = _mm256_maddubs_epi16(q, bcast4(x + (j * MR + i) * 4));
                        s16[i] = c % 2 == 0 ? p : _mm256_add_epi16(s16[i], p);
                    }
                    if (c % 2 == 1)
                        for (int i = 0; i < MR; ++i) dot[i] = _mm256_add_epi32(dot[i], _mm256_madd_epi16(s16[i], _mm256_set1_epi16(1)));
#endif
                }
                scale_into<MR>(dot, _mm256_mul_ps(hd, cvt_i8x8(sc + 16 * h + 8 * half)), xd, acc);
            }
        } else {
            start8<MR>(xstart, dot);
            dot8<MR>(blk, half, x, dot);
            if constexpr (T == I8) {
                for (int i = 0; i < MR; ++i) acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i]), _mm256_set1_ps(xd[i]), acc[i]);
            } else {
                scale_into<MR>(dot, cvt_f16x8(blk + 512 + 16 * half), xd, acc);
            }
        }
    }
    for (int i = 0; i < MR; ++i) result[i] = acc[i];
}

template <int64_t T, int MR>
void tile_rows(const uint8_t* tile, const float* scales, const Activations& a, int64_t m0, int64_t n0, int64_t N,
               const TileOut& out) {
    if (n0 + kTileRows < N)  // as in the AVX-512 kernel: the next tile's output lines
        for (int i = 0; i < MR; ++i) _mm_prefetch(out.address(m0 + i, n0 + kTileRows), _MM_HINT_T0);
    // The first pass over the tile (m0 = 0) streams it from memory; where it is the only one (decode-sized
    // products, bound by the memory), the next tile with it.
    const int64_t tb = a.M <= kPassRows ? tile_bytes(T, a.K) : 0;
    NextTile next(tb && n0 + kTileRows < N ? tile + tb : nullptr, tb, 2 * (T == BF16 || T == F32 ? a.K : a.nb));
    const bool ahead = m0 == 0 && !next.active();
    for (int half = 0; half < 2; ++half) {
        __m256 res[MR];
        if constexpr (T == BF16) dense_half_pass<bf16, MR>(tile, half, a, m0, ahead && half == 0, res, next);
        else if constexpr (T == F32) dense_half_pass<float, MR>(tile, half, a, m0, ahead && half == 0, res, next);
        else half_pass<T, MR>(tile, half, a, m0, ahead && half == 0, res, next);
        const int64_t base = n0 + 8 * half, valid = std::min<int64_t>(8, N - base);
        if (valid <= 0) break;
        for (int i = 0; i < MR; ++i) {
            float vals[8];
            _mm256_storeu_ps(vals, res[i]);
            for (int r = 0; r < valid; ++r) out.store(m0 + i, base + r, scales ? vals[r] * scales[base + r] : vals[r]);
        }
    }
}
