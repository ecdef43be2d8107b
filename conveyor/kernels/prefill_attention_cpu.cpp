// Prefill attention straight from the paged KV cache on CPU, fp32 or bf16 (bf16 widened to fp32 on
// load; scores, softmax and sums in fp32; bf16 output rounded once). A chunk's queries attend to its
// earlier context (cache slots, read in place) and to its own new K/V (taken from the batch, so the
// kernel runs before the pass writes the cache: a sliding ring may reuse the context's slots for the
// chunk's own tokens), causally, within an optional sliding window; flash-style (online softmax over
// blocks of keys), one task per (chunk, kv head, query tile) so every K/V block is reused by all of
// the tile's query rows. `softcap` > 0 caps the scores as Gemma 2 does: tanh(score / softcap) * softcap.
//
// Prefill is compute-bound, and everything in it is vectorized along the query rows of a tile (the
// queries of one kv head's G query heads): scores are kept transposed, keys x rows, so the softmax's
// running max and sum are plain vector operations and any head dim works. The two products run in
// register blocks of KB keys (or head-dim entries) x CB row vectors, near the FMA units' peak; what
// is left to gain is around them (measured, 1 thread, 512 queries over 1024 keys, bf16: about a
// third of the time went to widening, softmax and rescaling): bf16 rows widened W values per
// instruction, the block's row max taken from the score registers when no mask or cap touches it,
// and the output rescaled only when some row's max moved.
#include "prefill_attention_cpu.h"
#include "vec_math.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace conveyor {
namespace {

inline void store(float* p, float x) { *p = x; }
inline void store(bf16* p, float x) { *p = bf16(x); }  // round to nearest even

// Register blocks: KB keys (or head-dim entries) x CB row vectors of accumulators: 24 of AVX-512's
// 32 registers, 12 of AVX2's 16.
#ifdef __AVX512F__
constexpr int KB = 8;
#else
constexpr int KB = 4;
#endif
constexpr int CB = 3;
constexpr int64_t NB = 64;         // keys per block (a multiple of KB): its scores and V rows stay near
constexpr int64_t kTileRows = 96;  // query rows (queries x heads of one kv head) per task
static_assert(NB % KB == 0, "a block pads its last keys to a multiple of KB, within NB");

// Masked scores: finite, so a row with nothing visible yet has a finite max (its sums are reset by
// the first visible key: e^(kMasked - max) ~ 0) and padding rows stay finite.
constexpr float kMasked = -1e30f;

// st[n][rows] = k[n] . qt[:, rows] for KB keys n and C row vectors (qt is [D][Rp], st [NB][Rp]);
// mx[c] = max(mx[c], the row vector's scores).
template <int C>
inline void qk_tile(const float* const* k, const float* qt, int64_t D, int64_t Rp, float* st, vecw* mx) {
    vecw acc[KB][C] = {};
    for (int64_t d = 0; d < D; ++d) {
        vecw q[C];
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) q[c] = loadw(qt + d * Rp + c * W);
#pragma GCC unroll 8
        for (int i = 0; i < KB; ++i) {
            const float x = k[i][d];
#pragma GCC unroll 8
            for (int c = 0; c < C; ++c) acc[i][c] += x * q[c];
        }
    }
    for (int c = 0; c < C; ++c) {
        vecw m = mx[c];
        for (int i = 0; i < KB; ++i) {
            storew(st + i * Rp + c * W, acc[i][c]);
            m = vmax(m, acc[i][c]);
        }
        mx[c] = m;
    }
}

// ot[d][rows] += sum_n v[n][d] * pt[n][rows] for R head-dim entries d and C row vectors, n < len:
// pt is [NB][Rp], ot [D][Rp].
template <int R, int C>
inline void pv_tile(const float* const* v, int64_t d, const float* pt, int64_t len, int64_t Rp, float* ot) {
    vecw acc[R][C];
    for (int i = 0; i < R; ++i)
        for (int c = 0; c < C; ++c) acc[i][c] = loadw(ot + (d + i) * Rp + c * W);
    for (int64_t n = 0; n < len; ++n) {
        vecw p[C];
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) p[c] = loadw(pt + n * Rp + c * W);
#pragma GCC unroll 8
        for (int i = 0; i < R; ++i) {
            const float x = v[n][d + i];
#pragma GCC unroll 8
            for (int c = 0; c < C; ++c) acc[i][c] += x * p[c];
        }
    }
    for (int i = 0; i < R; ++i)
        for (int c = 0; c < C; ++c) storew(ot + (d + i) * Rp + c * W, acc[i][c]);
}

// Calls f(integral_constant<C>) for the row vectors [c0, nv) in groups of CB, then the remainder.
template <int C = CB, typename F>
inline void row_groups(int64_t c0, int64_t nv, F&& f) {
    if constexpr (C == CB)
        for (; c0 + CB <= nv; c0 += CB) f(std::integral_constant<int, CB>{}, c0);
    if constexpr (C > 0) {
        if (nv - c0 == C) f(std::integral_constant<int, C>{}, c0);
        else row_groups<C - 1>(c0, nv, f);
    }
}

// dst[0:D] = src[0:D] widened, W values at a time.
inline void widen(const bf16* src, int64_t D, float* dst) {
    int64_t d = 0;
    for (; d + W <= D; d += W) storew(dst + d, loadw(src + d));
    for (; d < D; ++d) dst[d] = static_cast<float>(src[d]);
}

struct Task {
    int64_t chunk, kv_head, q0, q1, k0, k1;  // queries [q0, q1) of the chunk, keys [k0, k1) of its sequence
};

// A chunk's key sequence is its n_ctx context slots, then its q_len own tokens; query i of the
// chunk sits at key index n_ctx + i and sees keys j <= n_ctx + i (and j > n_ctx + i - window).
template <typename T>
void prefill(const PrefillArgs<T>& a) {
    constexpr bool fp32 = std::is_same_v<T, float>;
    const int64_t H = a.heads, D = a.head_dim, G = a.heads / a.kv_heads, row = a.kv_heads * D, window = a.window;
    const float cap = a.softcap;
    const int64_t tq = std::max<int64_t>(1, kTileRows / G), Rp = (tq * G + W - 1) / W * W, nv = Rp / W;
    std::vector<Task> tasks;
    for (int64_t c = 0; c < a.num_chunks; ++c) {
        const int64_t q_len = a.chunks[c * 4 + 1], n_ctx = a.chunks[c * 4 + 3];
        for (int64_t q0 = 0; q0 < q_len; q0 += tq) {
            const int64_t q1 = std::min(q_len, q0 + tq);
            const int64_t k0 = window > 0 ? std::max<int64_t>(0, n_ctx + q0 - window + 1) : 0;
            for (int64_t h = 0; h < a.kv_heads; ++h) tasks.push_back({c, h, q0, q1, k0, n_ctx + q1});
        }
    }
    // Taken dynamically, a kv head's tiles one after another (its K/V rows stay in L2 from tile to
    // tile), longest first within it (the causal tiles differ in length).
    std::stable_sort(tasks.begin(), tasks.end(), [](const Task& x, const Task& y) {
        if (x.kv_head != y.kv_head) return x.kv_head < y.kv_head;
        return (x.q1 - x.q0) * (x.k1 - x.k0) > (y.q1 - y.q0) * (y.k1 - y.k0);
    });
    std::atomic<size_t> next{0};
    const std::vector<float> zero(D, 0.f);  // the K and V row of a block's padding keys
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
        std::vector<float> qt(D * Rp), st(NB * Rp), ot(D * Rp), m(Rp), l(Rp);
        std::vector<float> kb(fp32 ? 0 : NB * D), vb(fp32 ? 0 : NB * D);  // a block's K and V rows widened
        std::vector<int32_t> hi(Rp), lo(Rp);
        std::vector<const float*> krow(NB), vrow(NB);
        std::vector<vecw> bmax(nv);
        for (size_t ti; (ti = next.fetch_add(1)) < tasks.size();) {
            const Task& t = tasks[ti];
            const int64_t q_start = a.chunks[t.chunk * 4], n_ctx = a.chunks[t.chunk * 4 + 3];
            const int64_t* slots = a.ctx_slots + a.chunks[t.chunk * 4 + 2];
            const int64_t R = (t.q1 - t.q0) * G;  // row r: query q0 + r / G, head kv_head * G + r % G
            std::fill(qt.begin(), qt.end(), 0.f);
            for (int64_t r = 0; r < Rp; ++r) {
                const int64_t qj = n_ctx + t.q0 + std::min(r, R - 1) / G;  // the row's own key index
                hi[r] = static_cast<int32_t>(r < R ? qj : -1);  // padding rows see nothing
                lo[r] = static_cast<int32_t>(window > 0 ? qj - window : -1);
                if (r >= R) continue;
                const T* src = a.q + (q_start + t.q0 + r / G) * a.q_stride + (t.kv_head * G + r % G) * D;
                for (int64_t d = 0; d < D; ++d) qt[d * Rp + r] = to_float(src[d]) * a.scale;
            }
            std::fill(ot.begin(), ot.end(), 0.f);
            std::fill(m.begin(), m.end(), kMasked);
            std::fill(l.begin(), l.end(), 0.f);
            // Key j's K (or V) row: from the cache for the context, from the batch for the chunk's own.
            const auto key = [&](int64_t j, const T* cache, const T* batch, int64_t stride) {
                return j < n_ctx ? cache + slots[j] * row + t.kv_head * D : batch + (q_start + j - n_ctx) * stride + t.kv_head * D;
            };
            // The next block's rows, a KB keys' share at a time between the products (they come from L2
            // or beyond, and its widening waited on them).
            const int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));
            const auto prefetch_next = [&](int64_t j) {
                for (int64_t i = 0; i < KB && j + i < t.k1; ++i)
                    for (const T* p : {key(j + i, a.cache_k, a.k, a.k_stride), key(j + i, a.cache_v, a.v, a.v_stride)})
                        for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(reinterpret_cast<const char*>(p) + b);
            };
            for (int64_t j0 = t.k0; j0 < t.k1; j0 += NB) {
                const int64_t nb = std::min(NB, t.k1 - j0), nbp = (nb + KB - 1) / KB * KB;
                for (int64_t n = 0; n < nbp; ++n) {
                    if (n >= nb) {
                        krow[n] = vrow[n] = zero.data();
                        continue;
                    }
                    const T* k = key(j0 + n, a.cache_k, a.k, a.k_stride);
                    const T* v = key(j0 + n, a.cache_v, a.v, a.v_stride);
                    if constexpr (fp32) {
                        krow[n] = k;
                        vrow[n] = v;
                    } else {
                        widen(k, D, kb.data() + n * D);
                        widen(v, D, vb.data() + n * D);
                        krow[n] = kb.data() + n * D;
                        vrow[n] = vb.data() + n * D;
                    }
                }
                std::fill(bmax.begin(), bmax.end(), splat(kMasked));  // each row vector's max of raw scores
                for (int64_t n = 0; n < nbp; n += KB) {
                    prefetch_next(j0 + NB + n);
                    row_groups(0, nv, [&](auto cb, int64_t c) {
                        qk_tile<decltype(cb)::value>(krow.data() + n, qt.data() + c * W, D, Rp,
                                                     st.data() + n * Rp + c * W, bmax.data() + c);
                    });
                }
                // Online softmax, a row vector at a time: cap and mask the block's scores (masks only in
                // blocks on the diagonal, the window's edge or the sequence's end; their max taken again),
                // then fold them into the rows' running max m, sum l and output ot.
                const bool edge = j0 + nbp - 1 > n_ctx + t.q0 || (window > 0 && j0 <= n_ctx + t.q1 - 1 - window);
                for (int64_t c = 0; c < nv; ++c) {
                    vecw mx = bmax[c];
                    if (cap > 0.f || edge) {
                        ivecw vhi, vlo;
                        std::memcpy(&vhi, hi.data() + c * W, sizeof vhi);
                        std::memcpy(&vlo, lo.data() + c * W, sizeof vlo);
                        mx = splat(kMasked);
                        for (int64_t n = 0; n < nbp; ++n) {
                            float* p = st.data() + n * Rp + c * W;
                            vecw x = loadw(p);
                            if (cap > 0.f) x = vtanh(x / cap) * cap;
                            if (edge) {
                                const int32_t j = static_cast<int32_t>(n < nb ? j0 + n : INT32_MAX);
                                x = select((j <= vhi) & (j > vlo), x, splat(kMasked));
                            }
                            storew(p, x);
                            mx = vmax(mx, x);
                        }
                    }
                    const vecw m0 = loadw(m.data() + c * W);
                    const ivecw moved = mx > m0;
                    const vecw m1 = select(moved, mx, m0);
                    vecw sum = {};
                    for (int64_t n = 0; n < nbp; ++n) {
                        float* p = st.data() + n * Rp + c * W;
                        const vecw e = vexp(loadw(p) - m1);
                        storew(p, e);
                        sum += e;
                    }
                    if (any(moved)) {  // else alpha = e^0 = 1 in every lane
                        const vecw alpha = vexp(m0 - m1);
                        storew(l.data() + c * W, loadw(l.data() + c * W) * alpha + sum);
                        storew(m.data() + c * W, m1);
                        for (float* o = ot.data() + c * W; o < ot.data() + D * Rp; o += Rp) storew(o, loadw(o) * alpha);
                    } else {
                        storew(l.data() + c * W, loadw(l.data() + c * W) + sum);
                    }
                }
                int64_t d = 0;
                for (; d + KB <= D; d += KB)
                    row_groups(0, nv, [&](auto cb, int64_t c) {
                        pv_tile<KB, decltype(cb)::value>(vrow.data(), d, st.data() + c * W, nbp, Rp, ot.data() + c * W);
                    });
                for (; d < D; ++d)
                    row_groups(0, nv, [&](auto cb, int64_t c) {
                        pv_tile<1, decltype(cb)::value>(vrow.data(), d, st.data() + c * W, nbp, Rp, ot.data() + c * W);
                    });
            }
            for (int64_t r = 0; r < R; ++r) {
                T* dst = a.out + (q_start + t.q0 + r / G) * H * D + (t.kv_head * G + r % G) * D;
                const float inv = 1.f / l[r];
                for (int64_t d = 0; d < D; ++d) store(dst + d, ot[d * Rp + r] * inv);
            }
        }
    });
}

}  // namespace

template <typename T>
void prefill_attention(const PrefillArgs<T>& args) {
    prefill(args);
}
template void prefill_attention<float>(const PrefillArgs<float>&);
template void prefill_attention<bf16>(const PrefillArgs<bf16>&);

int64_t prefill_vector_width() { return W; }

}  // namespace conveyor
