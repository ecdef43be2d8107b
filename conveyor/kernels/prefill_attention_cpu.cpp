// Prefill attention straight from the paged KV cache on CPU, fp32 or bf16, over fp32, bf16 or int8 K/V
// rows (bf16 values widened to fp32 on load; over int8 rows, integer dot products of the quantized
// query with the keys and of the weights, rounded to integers, with the values, the scales applied
// per key and per block: attention_blocks.h; scores, softmax and sums in fp32; bf16 output rounded
// once). A chunk's queries attend to its
// earlier context (cache slots, read in place) and to its own new K/V (taken from the batch, so the
// kernel runs before the pass writes the cache: a sliding ring may reuse the context's slots for the
// chunk's own tokens), causally, within an optional sliding window; flash-style (online softmax over
// blocks of keys), one task per (chunk, kv head, query tile), so every K/V block is loaded once for
// all of the tile's query rows (its queries times the kv head's G query heads). `softcap` > 0 caps
// the scores as Gemma 2 does: tanh(score / softcap) * softcap.
//
// Key blocks sit at absolute positions and every row's arithmetic is attention_blocks.h's, the
// decode kernel's (attention_cpu.h): a query gets the same bits here as in decode, and in any chunk.
//
// Prefill is compute-bound, and everything in it is vectorized along the query rows of a tile:
// scores are kept transposed, keys x rows, so the softmax's running max and sum are plain vector
// operations and any head dim works. The two products run in register blocks of KB keys (or head-dim
// entries) x CB row vectors. Before the tiles, each chunk's key blocks are laid out by head-dim entry
// (`key_columns`: the score loop walks one pointer and broadcasts KB neighbours; int8 ones as quads)
// and bf16 V rows widened (int8 ones turned into pairs, `value_pairs`), once per kv head for all of
// its tiles (per tile, that took ~10% of the time). The block's row max is taken from the score
// registers when no mask or cap touches it, and the output's rescale rides on the weighted sum's
// loads.
#include "attention_blocks.h"
#include "int8_values.h"
#include "prefill_amx.h"
#include "prefill_attention_cpu.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstring>
#include <optional>
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
constexpr int64_t NB = kKeyBlock;
constexpr int64_t kTileRows = 48;  // query rows (queries x heads of one kv head) per task
static_assert(NB % KB == 0 && NB % W == 0 && (W == KB || W == 2 * KB), "a block pads its keys to a multiple of KB, within NB");

// W bf16 K rows (rows[0:W]) as `key_pairs` turns them, stored in a block's pair layout [np][NB] from
// column out (a chunk's shared blocks and a one-tile chunk's block alike).
template <typename T>
inline void store_key_pairs(const T* const* rows, int64_t D, uint32_t* out) {
    key_pairs(rows, 0, D, [&](int64_t j, uvecw col) { std::memcpy(out + j * NB, &col, sizeof col); });
}

// st[i][rows] = the scores of KB keys i (key i's d-th entry: K(i, d)) with C row vectors of qt
// ([D][Rp]), st [NB][Rp]; mx[c] = max(mx[c], the row vector's scores).
template <int C, typename Keys>
inline void qk_tile(Keys K, const float* qt, int64_t D, int64_t Rp, float* st, vecw* mx) {
    vecw acc[KB][C] = {};
    for (int64_t d = 0; d < D; ++d) {
        vecw q[C];
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) q[c] = loadw(qt + d * Rp + c * W);
#pragma GCC unroll 8
        for (int i = 0; i < KB; ++i) {
            const vecw x = splat(K(i, d));
#pragma GCC unroll 8
            for (int c = 0; c < C; ++c) acc[i][c] = fmadd(x, q[c], acc[i][c]);
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

// The same over bf16 keys (attention_blocks.h): st[i][rows] = scale * the `dot_bf16_pairs` chain of KB
// keys' pairs K(i, j) with C row vectors of the queries' pairs qp ([np][Rp]).
template <int C, typename Keys>
inline void qk_tile_pairs(Keys K, const uint32_t* qp, int64_t np, int64_t Rp, float scale, float* st, vecw* mx) {
    vecw acc[KB][C] = {};
    for (int64_t j = 0; j < np; ++j) {
        uvecw q[C];
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) std::memcpy(&q[c], qp + j * Rp + c * W, sizeof q[c]);
#pragma GCC unroll 8
        for (int i = 0; i < KB; ++i) {
            const uint32_t x = K(i, j);
#pragma GCC unroll 8
            for (int c = 0; c < C; ++c) acc[i][c] = dot_bf16_pairs(acc[i][c], q[c], x);
        }
    }
    for (int c = 0; c < C; ++c) {
        vecw m = mx[c];
        for (int i = 0; i < KB; ++i) {
            const vecw x = acc[i][c] * splat(scale);
            storew(st + i * Rp + c * W, x);
            m = vmax(m, x);
        }
        mx[c] = m;
    }
}

// The same over int8 keys (attention_blocks.h): st[i][rows] = `int8_scores` of the `dot_quads` sums of
// KB keys' quads K(i, j) (`key_quad`) with C row vectors of the quantized queries qt ([nq][Rp]: their
// sums qsum and scales qs [Rp]), each key's scale ks[i].
template <int C, typename Keys>
inline void qk_tile_i8(Keys K, const int32_t* qt, int64_t nq, int64_t Rp, const int32_t* qsum, const float* qs,
                       const float* ks, float* st, vecw* mx) {
    ivecw acc[KB][C] = {};
    integer_tile<KB, C>(acc, K, qt, nq, Rp, [](ivecw a, ivecw x, ivecw q) { return dot_quads(a, x, q); });
    for (int c = 0; c < C; ++c) {
        ivecw sums;
        std::memcpy(&sums, qsum + c * W, sizeof sums);
        const vecw scales = loadw(qs + c * W);
        vecw m = mx[c];
        for (int i = 0; i < KB; ++i) {
            const vecw x = int8_scores(acc[i][c], sums, scales * splat(ks[i]));
            storew(st + i * Rp + c * W, x);
            m = vmax(m, x);
        }
        mx[c] = m;
    }
}

// ot[d][rows] = ot[d][rows] * alpha[rows], then fmadd(pt[n][rows], v[n][d], ot[d][rows]) for n =
// 0..len-1 in order, R head-dim entries d and C row vectors: pt is [NB][Rp], ot [D][Rp].
template <int R, int C>
inline void pv_tile(const float* const* v, int64_t d, const float* pt, int64_t len, int64_t Rp, const vecw* alpha,
                    float* ot) {
    vecw acc[R][C];
    for (int i = 0; i < R; ++i)
        for (int c = 0; c < C; ++c) acc[i][c] = loadw(ot + (d + i) * Rp + c * W) * alpha[c];
    for (int64_t n = 0; n < len; ++n) {
        vecw p[C];
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) p[c] = loadw(pt + n * Rp + c * W);
#pragma GCC unroll 8
        for (int i = 0; i < R; ++i) {
            const vecw x = splat(v[n][d + i]);
#pragma GCC unroll 8
            for (int c = 0; c < C; ++c) acc[i][c] = fmadd(x, p[c], acc[i][c]);
        }
    }
    for (int i = 0; i < R; ++i)
        for (int c = 0; c < C; ++c) storew(ot + (d + i) * Rp + c * W, acc[i][c]);
}

// A tile's bf16 queries of even D as `query_pairs` lays them out (their pairs are their 32-bit words): pair j
// of row r (rows[r], r < R) at qp[j * Rp + r], zero past D / 2 and in rows R .. Rp, W rows x W pairs at a time
// turned by `transpose` (a row at a time, each of its pairs was a store of its own down a column).
inline void tile_query_pairs(const bf16* const* rows, int64_t R, int64_t D, int64_t np, int64_t Rp, uint32_t* qp) {
    for (int64_t r0 = 0; r0 < Rp; r0 += W)
        for (int64_t j0 = 0; j0 < np; j0 += W) {
            const int64_t n = std::clamp<int64_t>(D / 2 - j0, 0, W);
            vecw x[W];
            for (int64_t i = 0; i < W; ++i) {
                x[i] = vecw{};
                // a whole vector's copy apart: one variable-size copy would compile to `rep movs` for all
                if (r0 + i < R && n == W) std::memcpy(&x[i], rows[r0 + i] + 2 * j0, sizeof x[i]);
                else if (r0 + i < R && n > 0) std::memcpy(&x[i], rows[r0 + i] + 2 * j0, n * sizeof(uint32_t));
            }
            transpose(x);
            for (int64_t j = 0; j < std::min<int64_t>(W, np - j0); ++j)
                std::memcpy(qp + (j0 + j) * Rp + r0, &x[j], sizeof x[j]);
        }
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

// dst[0:D] = src[0:D] widened, W values at a time (bf16, or int8 values).
template <typename T>
inline void widen(const T* src, int64_t D, float* dst) {
    int64_t d = 0;
    for (; d + W <= D; d += W) storew(dst + d, loadw(src + d));
    for (; d < D; ++d) dst[d] = static_cast<float>(src[d]);
}

struct Task {
    int64_t chunk, kv_head, q0, q1, k0, k1;  // queries [q0, q1) of the chunk, keys [k0, k1) of its sequence
};

// A chunk's key blocks: absolute blocks [first, first + count) of each kv head; where it has several
// query tiles (`shared`), laid out once in the shared buffers, kv head h's block b at index base +
// h * count + b - first, else by its one tile (a pass through memory for nothing).
struct ChunkBlocks {
    int64_t k_min, first, count, base;  // k_min: its first key any query sees
    bool shared;
};

// The shared buffers, the calling thread's (reused across calls: fresh large allocations fault their
// pages in every time).
struct BlockBuffers {
    std::vector<float> kt, v;  // per block: fp32 K laid out [D][NB]; bf16 V rows widened, [NB][D]
    std::vector<uint32_t> kp;  // per block: bf16 K rows' pairs laid out [np][NB] (`key_pairs`)
    std::vector<int32_t> kq;   // per block: int8 K rows' quads laid out [nq][NB] (`key_quad`)
    std::vector<int32_t> vp;   // and int8 V rows' pairs (`block_value_pairs`), [NB / 2][Dq]
    std::vector<float> ks, vs;  // per block: int8 K and V rows' scales, [NB]
    std::vector<bf16> kr, vt;   // per block, on the AMX tiles: K rows [NB][Dp] and V transposed [Dp][NB]
};
thread_local BlockBuffers caller_buffers;

// A chunk's key sequence is its n_ctx context slots, then its q_len own tokens: key j sits at position
// j + start - n_ctx, query i at start + i, and it sees keys at positions <= its own (and > its own -
// window).
template <typename Q, typename T>
void prefill(const PrefillArgs<Q, T>& a) {
    constexpr bool fp32 = std::is_same_v<T, float>;  // K/V rows usable as they are
    constexpr bool scaled = kScaled<T>;
    constexpr bool paired = kBf16Pairs<T>;  // bf16 keys: scores over pairs (attention_blocks.h)
    constexpr bool amx_kind = paired && kAmx;  // and, where asked for, on the AMX tiles (prefill_amx.h)
    const bool amx = amx_kind && a.amx && amx_usable();
    const int64_t H = a.heads, D = a.head_dim, G = a.heads / a.kv_heads, Hkv = a.kv_heads, Dr = head_row<T>(D);
    const int64_t Dp = amx ? amx_head(D) : D;  // the head dim as the tiles take it
    const int64_t np = paired ? (amx ? Dp / 2 : bf16_pairs(D)) : 0, nq = scaled ? quads(D) : 0;
    const int64_t Dq = scaled ? pair_groups(D) * 4 * W : 0;
    const int64_t row = Hkv * Dr;
    const bool word_pairs = paired && std::is_same_v<Q, bf16> && D % 2 == 0;  // `tile_query_pairs`
    const int64_t window = a.window;
    const float cap = a.softcap;
    const int64_t tq = std::max<int64_t>(1, kTileRows / G), Rmax = round_up(tq * G, W);  // a task's rows, at most
    std::vector<Task> tasks;
    std::vector<ChunkBlocks> blocks(a.num_chunks);
    int64_t num_blocks = 0;
    for (int64_t c = 0; c < a.num_chunks; ++c) {
        const int64_t q_len = a.chunks[c * 5 + 1], n_ctx = a.chunks[c * 5 + 3], off = a.chunks[c * 5 + 4] - n_ctx;
        if (q_len == 0) continue;
        const int64_t k_min = window > 0 ? std::max<int64_t>(0, n_ctx - window + 1) : 0;
        const int64_t first = (k_min + off) / NB, last = (n_ctx + q_len - 1 + off) / NB;
        const bool shared = q_len > tq;
        blocks[c] = {k_min, first, last - first + 1, num_blocks, shared};
        if (shared) num_blocks += (last - first + 1) * Hkv;
        for (int64_t q0 = 0; q0 < q_len; q0 += tq) {
            const int64_t q1 = std::min(q_len, q0 + tq);
            const int64_t k0 = window > 0 ? std::max<int64_t>(0, n_ctx + q0 - window + 1) : 0;
            for (int64_t h = 0; h < Hkv; ++h) tasks.push_back({c, h, q0, q1, k0, n_ctx + q1});
        }
    }
    // Key j's K (or V) row: from the cache for the context, from the batch for the chunk's own.
    const auto key = [&](const int64_t* chunk, int64_t h, int64_t j, const T* cache, const T* batch, int64_t stride) {
        const int64_t n_ctx = chunk[3];
        return j < n_ctx ? cache + a.ctx_slots[chunk[2] + j] * row + h * Dr : batch + (chunk[0] + j - n_ctx) * stride + h * Dr;
    };
    const std::vector<T> zero_t(Dr);  // the K row of a block's missing keys (zero values and scale)
    const std::vector<float> zero(D, 0.f);   // and its V row
    // Chunk c's block at position p0 of kv head h: its K and V rows (lane n: position p0 + n; the zero
    // rows where the chunk has no such key: before its first, past its last): K rows as they are
    // (krow), or as fp32 rows (kf: bf16 ones widened into kb, [NB][D]), V rows as they are (vraw), bf16
    // ones widened into vb (vf); int8 rows' scales into ks and vs ([NB]: 0 past the block's last key).
    // Pointers not wanted are nullptr.
    const auto block_rows = [&](int64_t c, int64_t h, int64_t p0, const T** krow, const float** kf, const float** vf,
                                float* kb, float* vb, float* ks, float* vs, const T** vraw) {
        const int64_t* chunk = a.chunks + c * 5;
        const int64_t off = chunk[4] - chunk[3], n1 = std::min(NB, chunk[3] + chunk[1] + off - p0);
        for (int64_t n = 0; n < n1; ++n) {
            const int64_t j = p0 + n - off;
            const bool present = j >= blocks[c].k_min;
            const T* k = present ? key(chunk, h, j, a.cache_k, a.k, a.k_stride) : zero_t.data();
            const T* v = present ? key(chunk, h, j, a.cache_v, a.v, a.v_stride) : zero_t.data();
            if (krow) krow[n] = k;
            if (vraw) vraw[n] = v;
            if constexpr (scaled) {
                ks[n] = row_scale(k, D), vs[n] = row_scale(v, D);
            } else if constexpr (fp32) {
                if (kf) kf[n] = k;
                vf[n] = v;
            } else {
                if (kf) {
                    widen(k, D, kb + n * D);
                    kf[n] = kb + n * D;
                }
                if (vf) {
                    widen(v, D, vb + n * D);
                    vf[n] = vb + n * D;
                }
            }
        }
        if constexpr (scaled)
            for (int64_t n = n1; n < NB; ++n) ks[n] = vs[n] = 0.f, vraw[n] = zero_t.data();
        return n1;
    };
    // Chunk c's block at position p0 of kv head h as the AMX tiles take it: K rows into kr, V rows
    // transposed into vt (`amx_block`; zero rows where the chunk has no such key).
    const auto amx_rows = [&](int64_t c, int64_t h, int64_t p0, bf16* kr, bf16* vt) {
        if constexpr (amx_kind) {
            const T *krows[NB], *vrows[NB];
            const int64_t n1 = block_rows(c, h, p0, krows, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, vrows);
            for (int64_t n = n1; n < NB; ++n) krows[n] = vrows[n] = zero_t.data();
            amx_block(krows, vrows, D, NB, kr, vt);
        }
    };
    // The blocks of chunks with several tiles, laid out once for all of them (per tile, the layout took
    // ~10% of the time).
    BlockBuffers& buffers = caller_buffers;  // the workers below use this thread's
    if (amx) {
        buffers.kr.resize(num_blocks * NB * Dp);
        buffers.vt.resize(num_blocks * Dp * NB);
    } else {
        if (scaled) buffers.kq.resize(num_blocks * nq * NB);
        else if (paired) buffers.kp.resize(num_blocks * np * NB);
        else buffers.kt.resize(num_blocks * D * NB);
        if (scaled) buffers.vp.resize(num_blocks * NB / 2 * Dq);
        else if (!fp32) buffers.v.resize(num_blocks * NB * D);
    }
    if (scaled) buffers.ks.resize(num_blocks * NB), buffers.vs.resize(num_blocks * NB);
    parallel_for(0, num_blocks, 1, [&](int64_t begin, int64_t end) {
        std::vector<const T*> krow(NB), vraw(NB);
        std::vector<const float*> vf(NB);
        for (int64_t i = begin; i < end; ++i) {
            int64_t c = 0;
            while (!blocks[c].shared || blocks[c].base + blocks[c].count * Hkv <= i) ++c;
            const ChunkBlocks& cb = blocks[c];
            const int64_t h = (i - cb.base) / cb.count, p0 = (cb.first + (i - cb.base) % cb.count) * NB;
            if (amx) {
                amx_rows(c, h, p0, buffers.kr.data() + i * NB * Dp, buffers.vt.data() + i * Dp * NB);
                continue;
            }
            const int64_t n1 = block_rows(c, h, p0, krow.data(), nullptr, vf.data(), nullptr,
                                          fp32 || scaled ? nullptr : buffers.v.data() + i * NB * D,
                                          scaled ? buffers.ks.data() + i * NB : nullptr,
                                          scaled ? buffers.vs.data() + i * NB : nullptr, vraw.data());
            if constexpr (scaled) block_value_pairs(vraw.data(), D, buffers.vp.data() + i * NB / 2 * Dq);
            for (int64_t n = n1; n < round_up(n1, W); ++n) krow[n] = zero_t.data();
            for (int64_t n0 = 0; n0 < n1; n0 += W) {
                if constexpr (scaled) {
                    int32_t* kq = buffers.kq.data() + i * nq * NB;
                    key_quads(krow.data() + n0, 0, nq, [&](int64_t j, ivecw col) {
                        std::memcpy(kq + j * NB + n0, &col, sizeof col);
                    });
                } else if constexpr (paired) {
                    store_key_pairs(krow.data() + n0, D, buffers.kp.data() + i * np * NB + n0);
                } else {
                    float* kt = buffers.kt.data() + i * D * NB;
                    key_columns(krow.data() + n0, 0, D, [&](int64_t d, vecw col) { storew(kt + d * NB + n0, col); });
                }
            }
        }
    });

    // Taken dynamically, a kv head's tiles one after another (its K/V blocks stay in L2 from tile to
    // tile), longest first within it (the causal tiles differ in length).
    std::stable_sort(tasks.begin(), tasks.end(), [](const Task& x, const Task& y) {
        if (x.kv_head != y.kv_head) return x.kv_head < y.kv_head;
        return (x.q1 - x.q0) * (x.k1 - x.k0) > (y.q1 - y.q0) * (y.k1 - y.k0);
    });
    std::atomic<size_t> next{0};
    parallel_for(0, call_threads(), 1, [&](int64_t, int64_t) {
        std::vector<float> qt(scaled || paired ? 0 : D * Rmax), st(NB * Rmax), ot(Dp * Rmax), m(Rmax), l(Rmax);
        std::vector<int32_t> qq(nq * Rmax), qsum(Rmax), words(nq);  // int8 keys: the rows' queries quantized, sums
        std::vector<float> qs(Rmax), qrow(D);                       // and scales; a row's scaled query
        std::vector<const T*> trow(NB), vraw(NB);  // int8 K and V rows of a block of a chunk with one tile
        std::vector<int32_t> vp(scaled ? NB / 2 * Dq : 0), pq(scaled ? NB / 2 * Rmax : 0);  // its value pairs; weights
        std::vector<float> sw(scaled ? Rmax : 0);                   // and the sums' scales
        std::vector<int32_t> hi(Rmax), lo(Rmax);
        std::vector<const float*> krow(NB), vrow(NB);
        std::vector<uint32_t> qp(np * Rmax), kp(np * NB);  // bf16 keys: the rows' query pairs; a block's key pairs
        std::vector<const Q*> qrows(word_pairs ? Rmax : 0);  // and the rows' queries where those are their words
        // A block of a chunk with one tile: its bf16 K rows widened (where not paired) and V rows widened.
        std::vector<float> kb(fp32 || scaled || paired ? 0 : NB * D), vb(fp32 || scaled ? 0 : NB * D);
        std::vector<float> kscale(scaled ? NB : 0), vscale(scaled ? NB : 0);  // and its int8 rows' scales
        std::vector<vecw> bmax(Rmax / W), alpha(Rmax / W);
        std::vector<bf16> akr(amx ? NB * Dp : 0), avt(amx ? Dp * NB : 0);  // AMX: a one-tile chunk's block
        std::vector<uint32_t> pp(amx ? NB * Rmax : 0);                   // and the weights' pairs (two parts)
        std::optional<AmxScope> tiles;
        if (amx) tiles.emplace();
        for (size_t ti; (ti = next.fetch_add(1)) < tasks.size();) {
            const Task& t = tasks[ti];
            const int64_t* chunk = a.chunks + t.chunk * 5;
            const ChunkBlocks& cb = blocks[t.chunk];
            const int64_t q_start = chunk[0], n_ctx = chunk[3], start = chunk[4], off = start - n_ctx;
            const int64_t R = (t.q1 - t.q0) * G;  // row r: query q0 + r / G, head kv_head * G + r % G
            const int64_t Rp = round_up(R, W), nv = Rp / W;  // the rows padded (a chunk's last tile: few)
            if constexpr (scaled) {  // padding rows: zero queries
                std::fill_n(qq.begin(), nq * Rp, 0);
                std::fill_n(qsum.begin(), Rp, 0);
                std::fill_n(qs.begin(), Rp, 0.f);
            } else if constexpr (paired) {
                if (!word_pairs) std::fill_n(qp.begin(), np * Rp, 0u);
            } else {
                std::fill_n(qt.begin(), D * Rp, 0.f);
            }
            for (int64_t r = 0; r < Rp; ++r) {
                const int64_t pos = start + t.q0 + std::min(r, R - 1) / G;  // the row's position
                hi[r] = static_cast<int32_t>(r < R ? pos : -1);  // padding rows see nothing
                lo[r] = static_cast<int32_t>(window > 0 ? pos - window : -1);
                if (r >= R) continue;
                const Q* src = a.q + (q_start + t.q0 + r / G) * a.q_stride + (t.kv_head * G + r % G) * D;
                if constexpr (scaled) {  // int8 keys: the query quantized (attention_blocks.h)
                    for (int64_t d = 0; d < D; ++d) qrow[d] = to_float(src[d]) * a.scale;
                    qsum[r] = quantize_query(qrow.data(), D, words.data(), qs[r]);
                    for (int64_t j = 0; j < nq; ++j) qq[j * Rp + r] = words[j];
                } else if constexpr (paired) {  // bf16 keys: the query as bf16 pairs, unscaled
                    if (word_pairs) qrows[r] = src;
                    else query_pairs(src, D, qp.data() + r, Rp);
                } else {
                    for (int64_t d = 0; d < D; ++d) qt[d * Rp + r] = to_float(src[d]) * a.scale;
                }
            }
            if constexpr (std::is_same_v<Q, bf16>)
                if (word_pairs) tile_query_pairs(qrows.data(), R, D, np, Rp, qp.data());
            std::fill_n(ot.begin(), Dp * Rp, 0.f);
            for (int64_t r = 0; r < Rp; ++r)  // padding rows: no sink
                start_row(a.sinks && r < R ? a.sinks + t.kv_head * G + r % G : nullptr, m[r], l[r]);
            const int64_t first_pos = start + t.q0, last_pos = start + t.q1 - 1;
            for (int64_t p0 = block_start(t.k0 + off); p0 < t.k1 + off; p0 += NB) {
                // Lanes [0, nb) of the block at position p0: those up to the tile's last key; the K
                // rows laid out by head-dim entry (a chunk with several tiles) or read as rows.
                const int64_t nb = std::min(NB, t.k1 + off - p0), nbp = (nb + KB - 1) / KB * KB;
                const int64_t i = cb.base + t.kv_head * cb.count + p0 / NB - cb.first;
                const float* kt = scaled || paired ? nullptr : buffers.kt.data() + i * D * NB;
                const float* ks = scaled ? (cb.shared ? buffers.ks.data() + i * NB : kscale.data()) : nullptr;
                const float* vs = scaled ? (cb.shared ? buffers.vs.data() + i * NB : vscale.data()) : nullptr;
                const int32_t* vpb = scaled && cb.shared ? buffers.vp.data() + i * NB / 2 * Dq : vp.data();
                if (amx) {
                    if (!cb.shared) amx_rows(t.chunk, t.kv_head, p0, akr.data(), avt.data());
                } else if (cb.shared) {
                    for (int64_t n = 0; n < nb && !scaled; ++n) {
                        const int64_t j = p0 + n - off;
                        if (j < cb.k_min) vrow[n] = zero.data();
                        else if constexpr (fp32) vrow[n] = key(chunk, t.kv_head, j, a.cache_v, a.v, a.v_stride);
                        else vrow[n] = buffers.v.data() + (i * NB + n) * D;
                    }
                } else {
                    block_rows(t.chunk, t.kv_head, p0, scaled || paired ? trow.data() : nullptr,
                               scaled || paired ? nullptr : krow.data(), vrow.data(), kb.data(), vb.data(),
                               kscale.data(), vscale.data(), vraw.data());
                    if constexpr (scaled) block_value_pairs(vraw.data(), D, vp.data());
                    if constexpr (paired) {
                        for (int64_t n = nb; n < round_up(nb, W); ++n) trow[n] = zero_t.data();
                        for (int64_t n0 = 0; n0 < nb; n0 += W) store_key_pairs(trow.data() + n0, D, kp.data() + n0);
                    }
                }
                for (int64_t n = nb; n < nbp; ++n) krow[n] = vrow[n] = zero.data(), trow[n] = zero_t.data();
                std::fill(bmax.begin(), bmax.end(), splat(kMasked));  // each row vector's max of raw scores
                if (amx) {
                    if constexpr (amx_kind)
                        amx_scores(cb.shared ? buffers.kr.data() + i * NB * Dp : akr.data(), Dp, qp.data(), Rp, nbp,
                                   a.scale, st.data(), bmax.data());
                }
                for (int64_t n = 0; n < (amx ? 0 : nbp); n += KB)  // the vector path
                    row_groups(0, nv, [&](auto count, int64_t c) {
                        constexpr int C = decltype(count)::value;
                        float* s = st.data() + n * Rp + c * W;
                        if constexpr (scaled) {
                            const int32_t* kq = buffers.kq.data() + i * nq * NB;
                            if (cb.shared)
                                qk_tile_i8<C>([&](int k, int64_t j) { return kq[j * NB + n + k]; }, qq.data() + c * W, nq,
                                              Rp, qsum.data() + c * W, qs.data() + c * W, ks + n, s, bmax.data() + c);
                            else
                                qk_tile_i8<C>([&](int k, int64_t j) { return key_quad(trow[n + k], j); }, qq.data() + c * W,
                                              nq, Rp, qsum.data() + c * W, qs.data() + c * W, ks + n, s, bmax.data() + c);
                        } else if constexpr (paired) {
                            const uint32_t* k = cb.shared ? buffers.kp.data() + i * np * NB : kp.data();
                            qk_tile_pairs<C>([&](int x, int64_t j) { return k[j * NB + n + x]; }, qp.data() + c * W, np,
                                             Rp, a.scale, s, bmax.data() + c);
                        } else if (cb.shared)
                            qk_tile<C>([&](int i, int64_t d) { return kt[d * NB + n + i]; }, qt.data() + c * W, D, Rp, s,
                                       bmax.data() + c);
                        else
                            qk_tile<C>([&](int i, int64_t d) { return krow[n + i][d]; }, qt.data() + c * W, D, Rp, s,
                                       bmax.data() + c);
                    });
                // Online softmax, a row vector at a time: cap and mask the block's scores (masks only in
                // blocks on the diagonal, at the window's edge, or with lanes past the tile's keys or
                // before the chunk's first; their max taken again), then fold them into the rows' running
                // max m and sum l; the output's rescale by alpha comes with the weighted sum below.
                const bool edge = nbp > nb || p0 + nb - 1 > first_pos || p0 < cb.k_min + off ||
                                  (window > 0 && p0 <= last_pos - window);
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
                                const bool key = n < nb && p0 + n - off >= cb.k_min;
                                const int32_t pos = static_cast<int32_t>(key ? p0 + n : INT32_MAX);
                                x = select((pos <= vhi) & (pos > vlo), x, splat(kMasked));
                            }
                            storew(p, x);
                            mx = vmax(mx, x);
                        }
                    }
                    const vecw m0 = loadw(m.data() + c * W);
                    const ivecw moved = mx > m0;
                    const vecw m1 = select(moved, mx, m0);
                    for (int64_t n = 0; n < nbp; ++n) {
                        float* p = st.data() + n * Rp + c * W;
                        const vecw x = loadw(p);
                        vecw e = vexp(x - m1);
                        if (edge) e = select(x > kMasked, e, vecw{});  // masked: exactly 0
                        storew(p, e);
                    }
                    vecw chains[W];  // chain i: keys i, W + i, 2W + i, ...: the sum's order (`block_sum`)
#pragma GCC unroll 16
                    for (int i = 0; i < W; ++i) {
                        chains[i] = i < nbp ? loadw(st.data() + i * Rp + c * W) : vecw{};
                        for (int64_t n = W + i; n < nbp; n += W) chains[i] = chains[i] + loadw(st.data() + n * Rp + c * W);
                    }
                    const vecw sum = fold_chains(chains);
                    if (any(moved)) {  // else alpha = e^0 = 1 in every lane
                        alpha[c] = vexp(m0 - m1);
                        storew(l.data() + c * W, fmadd(loadw(l.data() + c * W), alpha[c], sum));
                        storew(m.data() + c * W, m1);
                    } else {
                        alpha[c] = splat(1.f);
                        storew(l.data() + c * W, loadw(l.data() + c * W) + sum);
                    }
                }
                if (amx) {  // the tiles' sums: the output rescaled first, then the weights' two bf16 parts
                    if constexpr (amx_kind) {
                        for (int64_t c = 0; c < nv; ++c)
                            if (any(alpha[c] != splat(1.f)))
                                for (int64_t d = 0; d < D; ++d) {
                                    float* o = ot.data() + d * Rp + c * W;
                                    storew(o, loadw(o) * alpha[c]);
                                }
                        weight_pairs(st.data(), Rp, nbp, pp.data());
                        const bf16* vt = cb.shared ? buffers.vt.data() + i * Dp * NB : avt.data();
                        amx_values(vt, Dp, NB, pp.data(), Rp, nbp, ot.data());
                    }
                    continue;
                }
                int64_t d = 0;
                if constexpr (scaled) {  // the weights p * s_v as integers, each row's (attention_blocks.h)
                    for (int64_t c = 0; c < nv; ++c) {
                        vecw wmax = {};
                        for (int64_t n = 0; n < nbp; ++n) wmax = vmax(wmax, loadw(st.data() + n * Rp + c * W) * splat(vs[n]));
                        const vecw inv = weight_inverse(wmax);
                        storew(sw.data() + c * W, weight_scale(wmax));
                        for (int64_t j = 0; j < nbp / 2; ++j) {
                            const vecw w0 = loadw(st.data() + 2 * j * Rp + c * W) * splat(vs[2 * j]);
                            const vecw w1 = loadw(st.data() + (2 * j + 1) * Rp + c * W) * splat(vs[2 * j + 1]);
                            const ivecw word = weight_levels(w0, inv) | weight_levels(w1, inv) << 16;
                            std::memcpy(pq.data() + j * Rp + c * W, &word, sizeof word);
                        }
                    }
                    int64_t at[KB];
                    for (; d < D; d += KB) {
                        const int64_t r = std::min<int64_t>(KB, D - d);
                        for (int64_t k = 0; k < KB; ++k) at[k] = pair_entry(d + std::min(k, r - 1));
                        row_groups(0, nv, [&](auto cb, int64_t c) {
                            constexpr int C = decltype(cb)::value;
                            if (r == KB) pv_tile_i8<KB, C>(vpb, Dq, at, d, pq.data() + c * W, nbp / 2, Rp, alpha.data() + c,
                                                           sw.data() + c * W, ot.data() + c * W);
                            else
                                for (int64_t k = 0; k < r; ++k)
                                    pv_tile_i8<1, C>(vpb, Dq, at + k, d + k, pq.data() + c * W, nbp / 2, Rp,
                                                     alpha.data() + c, sw.data() + c * W, ot.data() + c * W);
                        });
                    }
                } else {
                    for (; d + KB <= D; d += KB)
                        row_groups(0, nv, [&](auto cb, int64_t c) {
                            pv_tile<KB, decltype(cb)::value>(vrow.data(), d, st.data() + c * W, nbp, Rp,
                                                             alpha.data() + c, ot.data() + c * W);
                        });
                    for (; d < D; ++d)
                        row_groups(0, nv, [&](auto cb, int64_t c) {
                            pv_tile<1, decltype(cb)::value>(vrow.data(), d, st.data() + c * W, nbp, Rp,
                                                            alpha.data() + c, ot.data() + c * W);
                        });
                }
            }
            // out = o * (1 / l), W rows x W entries at a time turned into rows (`transpose`): the loads
            // of ot's columns one entry at a time cost as much as a short chunk's products.
            for (int64_t c = 0; c < nv && c * W < R; ++c) {
                const vecw inv = splat(1.f) / loadw(l.data() + c * W);
                for (int64_t d0 = 0; d0 < D; d0 += W) {
                    vecw x[W];
                    for (int64_t i = 0; i < W; ++i)
                        x[i] = d0 + i < D ? loadw(ot.data() + (d0 + i) * Rp + c * W) * inv : vecw{};
                    transpose(x);
                    for (int64_t j = 0, r = c * W; j < W && r < R; ++j, ++r) {
                        Q* dst = a.out + (q_start + t.q0 + r / G) * H * D + (t.kv_head * G + r % G) * D + d0;
                        float row[W];
                        storew(row, x[j]);
                        for (int64_t d = 0; d < std::min<int64_t>(W, D - d0); ++d) store(dst + d, row[d]);
                    }
                }
            }
        }
    });
}

}  // namespace

template <typename Q, typename T>
void prefill_attention(const PrefillArgs<Q, T>& args) {
    prefill(args);
}
template void prefill_attention<float, float>(const PrefillArgs<float, float>&);
template void prefill_attention<bf16, bf16>(const PrefillArgs<bf16, bf16>&);
template void prefill_attention<float, int8_t>(const PrefillArgs<float, int8_t>&);
template void prefill_attention<bf16, int8_t>(const PrefillArgs<bf16, int8_t>&);

int64_t prefill_vector_width() { return W; }

}  // namespace conveyor
