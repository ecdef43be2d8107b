// Prefill attention straight from the paged KV cache on CPU, fp32 or bf16 (bf16 widened to fp32 on
// load; scores, softmax and sums in fp32; bf16 output rounded once). A chunk's queries attend to its
// earlier context (cache slots, read in place) and to its own new K/V (taken from the batch, so the
// kernel runs before the pass writes the cache: a sliding ring may reuse the context's slots for the
// chunk's own tokens), causally, within an optional sliding window; flash-style (online softmax over
// blocks of keys), one task per (chunk, kv head, query tile) so every K/V block is reused by all of
// the tile's query rows. `softcap` > 0 caps the scores as Gemma 2 does: tanh(score / softcap) * softcap.
#include "prefill_attention_cpu.h"
#include "vec_cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace conveyor {
namespace {

inline void store(float* p, float x) { *p = x; }
inline void store(bf16* p, float x) { *p = bf16(x); }  // round to nearest even

// W floats per register: 16 (one zmm) where the compiler targets AVX-512, else 8 (AVX2, or pairs
// of SSE registers). Prefill is compute-bound, and everything in it is vectorized along the query
// rows of a tile (the queries of one kv head's G query heads): scores are kept transposed, keys x
// rows, so the softmax's running max and sum are plain vector operations and any head dim works.
// Register blocks: KB keys (or head-dim entries) x CB row vectors of accumulators: 24 of AVX-512's
// 32 registers (~5% faster than 12), 12 of AVX2's 16.
#ifdef __AVX512F__
constexpr int KB = 8;
#else
constexpr int KB = 4;
#endif
constexpr int CB = 3;  // 96-row tiles: 6 (AVX-512) or 12 (AVX2) row vectors, in groups of 3
constexpr int64_t NB = 64;         // keys per block (a multiple of KB): its scores and V rows stay in L1
constexpr int64_t kTileRows = 96;  // query rows (queries x heads of one kv head) per task
static_assert(NB % KB == 0, "a block pads its last keys to a multiple of KB, within NB");

// st[n][rows] = k[n] . qt[:, rows] for KB keys n and C row vectors: qt is [D][Rp], st [NB][Rp].
template <int C>
inline void qk_tile(const float* const* k, const float* qt, int64_t D, int64_t Rp, float* st) {
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
    for (int i = 0; i < KB; ++i)
        for (int c = 0; c < C; ++c) storew(st + i * Rp + c * W, acc[i][c]);
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

struct Task {
    int64_t chunk, kv_head, q0, q1, k0, k1;  // queries [q0, q1) of the chunk, keys [k0, k1) of its sequence
};

// A chunk's key sequence is its n_ctx context slots, then its q_len own tokens; query i of the
// chunk sits at key index n_ctx + i and sees keys j <= n_ctx + i (and j > n_ctx + i - window).
template <typename T>
void prefill(const T* qp, int64_t qs, const T* kp, int64_t ks, const T* vp, int64_t vs, const T* ckp,
                    const T* cvp, const int64_t* ctx, const int64_t* chunks, int64_t C, T* op, int64_t H, int64_t Hkv,
                    int64_t D, int64_t window, float scale, float cap) {
    constexpr bool fp32 = std::is_same_v<T, float>;
    const int64_t G = H / Hkv, row = Hkv * D;
    const int64_t tq = std::max<int64_t>(1, kTileRows / G), Rp = (tq * G + W - 1) / W * W, nv = Rp / W;
    std::vector<Task> tasks;
    for (int64_t c = 0; c < C; ++c) {
        const int64_t q_len = chunks[c * 4 + 1], n_ctx = chunks[c * 4 + 3];
        for (int64_t q0 = 0; q0 < q_len; q0 += tq) {
            const int64_t q1 = std::min(q_len, q0 + tq);
            const int64_t k0 = window > 0 ? std::max<int64_t>(0, n_ctx + q0 - window + 1) : 0;
            for (int64_t h = 0; h < Hkv; ++h) tasks.push_back({c, h, q0, q1, k0, n_ctx + q1});
        }
    }
    // Longest first, taken dynamically: the causal tiles differ in length.
    std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) {
        return (a.q1 - a.q0) * (a.k1 - a.k0) > (b.q1 - b.q0) * (b.k1 - b.k0);
    });
    std::atomic<size_t> next{0};
    // Masked scores: finite, so a row with nothing visible yet has a finite max (its sums are reset by
    // the first visible key: e^(kMasked - max) = 0) and padding rows stay finite.
    constexpr float kMasked = -1e30f;
    const std::vector<float> zero(D, 0.f);  // the K and V row of the padding keys of a block
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
        std::vector<float> qt(D * Rp), st(NB * Rp), ot(D * Rp), m(Rp), l(Rp);
        std::vector<float> kb(fp32 ? 0 : NB * D), vb(fp32 ? 0 : NB * D);  // a block's K and V rows widened
        std::vector<int32_t> hi(Rp), lo(Rp);
        std::vector<const float*> krow(NB), vrow(NB);
        for (size_t ti; (ti = next.fetch_add(1)) < tasks.size();) {
            const Task& t = tasks[ti];
            const int64_t q_start = chunks[t.chunk * 4], n_ctx = chunks[t.chunk * 4 + 3];
            const int64_t* slots = ctx + chunks[t.chunk * 4 + 2];
            const int64_t R = (t.q1 - t.q0) * G;  // row r: query q0 + r / G, head kv_head * G + r % G
            std::fill(qt.begin(), qt.end(), 0.f);
            for (int64_t r = 0; r < Rp; ++r) {
                const int64_t qj = n_ctx + t.q0 + std::min(r, R - 1) / G;  // the row's own key index
                hi[r] = static_cast<int32_t>(r < R ? qj : -1);  // padding rows see nothing
                lo[r] = static_cast<int32_t>(window > 0 ? qj - window : -1);
                if (r >= R) continue;
                const T* src = qp + (q_start + t.q0 + r / G) * qs + (t.kv_head * G + r % G) * D;
                for (int64_t d = 0; d < D; ++d) qt[d * Rp + r] = to_float(src[d]) * scale;
            }
            std::fill(ot.begin(), ot.end(), 0.f);
            std::fill(m.begin(), m.end(), kMasked);
            std::fill(l.begin(), l.end(), 0.f);
            for (int64_t j0 = t.k0; j0 < t.k1; j0 += NB) {
                const int64_t nb = std::min(NB, t.k1 - j0), nbp = (nb + KB - 1) / KB * KB;
                for (int64_t n = 0; n < nbp; ++n) {
                    const int64_t j = j0 + n;
                    if (n >= nb) {
                        krow[n] = vrow[n] = zero.data();
                        continue;
                    }
                    const int64_t h = t.kv_head * D, b = q_start + j - n_ctx;  // b: the key's batch row
                    const T* k = j < n_ctx ? ckp + slots[j] * row + h : kp + b * ks + h;
                    const T* v = j < n_ctx ? cvp + slots[j] * row + h : vp + b * vs + h;
                    if constexpr (fp32) {
                        krow[n] = k;
                        vrow[n] = v;
                    } else {
                        for (int64_t d = 0; d < D; ++d) {
                            kb[n * D + d] = to_float(k[d]);
                            vb[n * D + d] = to_float(v[d]);
                        }
                        krow[n] = kb.data() + n * D;
                        vrow[n] = vb.data() + n * D;
                    }
                }
                for (int64_t n = 0; n < nbp; n += KB)
                    row_groups(0, nv, [&](auto cb, int64_t c) {
                        qk_tile<decltype(cb)::value>(krow.data() + n, qt.data() + c * W, D, Rp,
                                                     st.data() + n * Rp + c * W);
                    });
                // Online softmax, a row vector at a time: cap and mask the block's scores (masks only in
                // blocks on the diagonal, the window's edge or the sequence's end), then fold them into the
                // rows' running max m, sum l and output ot.
                const bool edge = j0 + nbp - 1 > n_ctx + t.q0 || (window > 0 && j0 <= n_ctx + t.q1 - 1 - window);
                for (int64_t c = 0; c < nv; ++c) {
                    ivecw vhi, vlo;
                    std::memcpy(&vhi, hi.data() + c * W, sizeof vhi);
                    std::memcpy(&vlo, lo.data() + c * W, sizeof vlo);
                    vecw mx = splat(kMasked);
                    for (int64_t n = 0; n < nbp; ++n) {
                        float* p = st.data() + n * Rp + c * W;
                        vecw x = loadw(p);
                        if (cap > 0.f) x = vtanh(x / cap) * cap;
                        if (edge) {
                            const int32_t j = static_cast<int32_t>(n < nb ? j0 + n : INT32_MAX);
                            x = select((j <= vhi) & (j > vlo), x, splat(kMasked));
                        }
                        if (cap > 0.f || edge) storew(p, x);
                        mx = select(x > mx, x, mx);
                    }
                    const vecw m0 = loadw(m.data() + c * W), m1 = select(mx > m0, mx, m0);
                    vecw sum = {};
                    for (int64_t n = 0; n < nbp; ++n) {
                        float* p = st.data() + n * Rp + c * W;
                        const vecw e = vexp(loadw(p) - m1);
                        storew(p, e);
                        sum += e;
                    }
                    const vecw alpha = vexp(m0 - m1);
                    storew(l.data() + c * W, loadw(l.data() + c * W) * alpha + sum);
                    storew(m.data() + c * W, m1);
                    for (float* o = ot.data() + c * W; o < ot.data() + D * Rp; o += Rp) storew(o, loadw(o) * alpha);
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
                T* dst = op + (q_start + t.q0 + r / G) * H * D + (t.kv_head * G + r % G) * D;
                const float inv = 1.f / l[r];
                for (int64_t d = 0; d < D; ++d) store(dst + d, ot[d * Rp + r] * inv);
            }
        }
    });
}

}  // namespace

template <typename T>
void prefill_attention(const PrefillArgs<T>& a) {
    prefill(a.q, a.q_stride, a.k, a.k_stride, a.v, a.v_stride, a.cache_k, a.cache_v, a.ctx_slots, a.chunks,
            a.num_chunks, a.out, a.heads, a.kv_heads, a.head_dim, a.window, a.scale, a.softcap);
}
template void prefill_attention<float>(const PrefillArgs<float>&);
template void prefill_attention<bf16>(const PrefillArgs<bf16>&);

int64_t prefill_vector_width() { return W; }

}  // namespace conveyor
