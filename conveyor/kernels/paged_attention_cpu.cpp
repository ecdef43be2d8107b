// Attention straight from the paged KV cache on CPU, fp32 or bf16 (bf16 widened to fp32 on load;
// scores, softmax and sums in fp32; bf16 output rounded once): the entry points (kernels/attention_ops.py
// checks the tensors and calls them).
//
// Decode: one query token per request, the threads splitting the (request, kv head) pairs
// (`attend_request`, attention_cpu.h);
// K/V read from the pages in place, after the pass wrote the new K/V.
// Prefill: prefill_attention_cpu.cpp, before the pass writes the chunks' own K/V.
// `softcap` > 0 caps the scores as Gemma 2 does: tanh(score / softcap) * softcap; 0 leaves them.
// `sinks` (None: none): gpt-oss's attention sinks, one logit per query head (attention_blocks.h).
#include "attention_cpu.h"
#include "prefill_attention_cpu.h"

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

using namespace conveyor;

namespace {

// f(Q*, T*) with null pointers of the query type `dtype` names and the cache's row type: Q's own, or
// int8 (`kv_dtype` kI8).
template <typename F>
void with_dtypes(int dtype, int kv_dtype, F&& f) {
    if (kv_dtype == kI8) {
        if (dtype == kF32) f(static_cast<float*>(nullptr), static_cast<int8_t*>(nullptr));
        else f(static_cast<bf16*>(nullptr), static_cast<int8_t*>(nullptr));
    } else {
        CONVEYOR_CHECK(kv_dtype == dtype, "the KV cache must be int8 or of the queries' dtype");
        if (dtype == kF32) f(static_cast<float*>(nullptr), static_cast<float*>(nullptr));
        else f(static_cast<bf16*>(nullptr), static_cast<bf16*>(nullptr));
    }
}

// Queries and outputs of type Q (fp32 or bf16) over a cache of rows of type T (Q's, or int8). The
// threads split the (row, kv head) pairs, each a run of whole rows and kv heads: one long request
// still uses every thread, and a head's arithmetic does not depend on which thread runs it (so a
// split is bit-identical to none).
template <typename Q, typename T>
void decode(const Q* qp, const T* kp, const T* vp, const int64_t* bt, const int64_t* lens, const int64_t* positions,
            int64_t window, Q* op, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t max_blocks, int64_t page_size,
            float scale, float cap, const float* sinks) {
    constexpr bool fp32 = std::is_same_v<Q, float>;
    const int64_t G = H / Hkv;
    parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
        DecodeScratch scratch;
        std::vector<float> qf(fp32 ? 0 : H * D), of(fp32 ? 0 : H * D);
        for (int64_t p = begin; p < end;) {  // kv heads [h0, h1) of row b
            const int64_t b = p / Hkv, h0 = p % Hkv, h1 = std::min(end - b * Hkv, Hkv), n = (h1 - h0) * G * D;
            const int64_t at = b * H * D + h0 * G * D;  // the run's first query head
            const float* qb;
            float* ob;
            if constexpr (fp32) {
                qb = qp + at;
                ob = op + at;
            } else {
                for (int64_t i = 0; i < n; ++i) qf[i] = static_cast<float>(qp[at + i]);
                qb = qf.data();
                ob = of.data();
            }
            // A sliding window's ring holds positions [position - len + 1, position], p at slot p % window.
            const auto first = [&](int64_t r) { return window > 0 ? positions[r] - lens[r] + 1 : 0; };
            const int64_t nb = b + 1;  // the next run: row nb's kv heads from 0, if this thread has it
            scratch.next = nb * Hkv < end ? DecodeRun{bt + nb * max_blocks, lens[nb], first(nb), window, 0} : DecodeRun{};
            attend_request<T>(qb, kp, vp, bt + b * max_blocks, lens[b], first(b), window, page_size, Hkv, D, G, h0, h1,
                              scale, cap, sinks, scratch, ob);
            if constexpr (!fp32)
                for (int64_t i = 0; i < n; ++i) op[at + i] = bf16(of[i]);
            p = b * Hkv + h1;
        }
    });
}

}  // namespace

// out [B, H, D] = each row's query q [B, H, D] (fp32 or bf16: `dtype`) attending over its cached
// positions: the KV cache [2, slots, Hkv, D] (of `kv_dtype`: q's, or int8 rows [.., D + 4] with their
// scales), per row its block table (max_blocks wide), context length and (for a sliding window: the
// tables are rings of `window` slots) its position; all contiguous.
CONVEYOR_API int conveyor_paged_decode_attention(int dtype, int kv_dtype, const void* q, const void* kv, int64_t slots,
                                                 const int64_t* tables, int64_t max_blocks, const int64_t* lens,
                                                 const int64_t* positions, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                                                 int64_t window, int64_t page_size, float scale, float softcap,
                                                 const float* sinks, void* out, int threads) {
    return guarded(threads, [&] {
        CONVEYOR_CHECK(D <= kMaxDecodeHeadDim, "head dim ", D, " is above the CPU kernel's limit of ", kMaxDecodeHeadDim);
        CONVEYOR_CHECK(Hkv > 0 && H % Hkv == 0, "query heads ", H, " are not a multiple of kv heads ", Hkv);
        CONVEYOR_CHECK(window <= 0 || positions, "a sliding window needs every row's position (int64 [B])");
        const auto run = [&](auto* q_tag, auto* kv_tag) {
            using Q = std::remove_pointer_t<decltype(q_tag)>;
            using T = std::remove_pointer_t<decltype(kv_tag)>;
            const T* kp = static_cast<const T*>(kv);
            decode(static_cast<const Q*>(q), kp, kp + slots * Hkv * head_row<T>(D), tables, lens, positions,
                   std::max<int64_t>(window, 0), static_cast<Q*>(out), B, H, Hkv, D, max_blocks, page_size, scale, softcap,
                   sinks);
        };
        with_dtypes(dtype, kv_dtype, run);
    });
}

// Writes the attention output of every prefill chunk's rows into out [T, H, D] (contiguous): queries
// q [T, H, D] (`dtype`) and the batch's new keys and values k, v [T, Hkv, D] (token rows *_stride
// apart, heads contiguous), the cache [2, slots, Hkv, D], each chunk's context slots (all chunks'
// concatenated) and per chunk {q_start, q_len, offset into ctx_slots, n_ctx, start}. K, V and the cache
// are of `kv_dtype`: q's, or int8 rows with their scales (the new K/V quantized as the cache will hold
// them). `amx` != 0: bf16 over a bf16 cache may take the AMX tiles (prefill_amx.h). Call it before the
// pass writes the new K/V into the cache.
CONVEYOR_API int conveyor_paged_prefill_attention(int dtype, int kv_dtype, const void* q, const void* k, const void* v,
                                                  int64_t q_stride, int64_t k_stride, int64_t v_stride, const void* kv,
                                                  int64_t slots, const int64_t* ctx_slots, const int64_t* chunks,
                                                  int64_t num_chunks, int64_t H, int64_t Hkv, int64_t D, int64_t window,
                                                  float scale, float softcap, const float* sinks, void* out,
                                                  int amx, int threads) {
    return guarded(threads, [&] {
        CONVEYOR_CHECK(Hkv > 0 && H % Hkv == 0, "head counts or sizes disagree");
        for (int64_t i = 0; i < num_chunks; ++i)
            CONVEYOR_CHECK(chunks[i * 5 + 4] >= chunks[i * 5 + 3], "chunk ", i, " starts at position ", chunks[i * 5 + 4],
                           " after ", chunks[i * 5 + 3], " context positions: its context is the positions before it");
        const auto run = [&](auto* q_tag, auto* kv_tag) {
            using Q = std::remove_pointer_t<decltype(q_tag)>;
            using T = std::remove_pointer_t<decltype(kv_tag)>;
            const T* cp = static_cast<const T*>(kv);
            prefill_attention<Q, T>({static_cast<const Q*>(q), static_cast<const T*>(k), static_cast<const T*>(v), cp,
                                     cp + slots * Hkv * head_row<T>(D), q_stride, k_stride, v_stride, ctx_slots, chunks,
                                     num_chunks, H, Hkv, D, window, scale, softcap, sinks, static_cast<Q*>(out),
                                     amx != 0});
        };
        with_dtypes(dtype, kv_dtype, run);
    });
}

// out [rows, D + 4] = x [rows, D] (fp32 or bf16, contiguous) as int8 head rows with their scales: what an
// int8 KV cache holds (cache/kv_format.py's `quantize_kv`, bit for bit).
CONVEYOR_API int conveyor_quantize_kv(int dtype, const void* x, int64_t rows, int64_t D, void* out, int threads) {
    return guarded(threads, [&] {
        parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
            std::vector<float> row(D);
            for (int64_t r = r0; r < r1; ++r) {
                const float* src = row.data();
                if (dtype == kF32) {
                    src = static_cast<const float*>(x) + r * D;
                } else {
                    const bf16* b = static_cast<const bf16*>(x) + r * D;
                    for (int64_t d = 0; d < D; ++d) row[d] = static_cast<float>(b[d]);
                }
                quantize_head_row(src, D, static_cast<int8_t*>(out) + r * head_row<int8_t>(D));
            }
        });
    });
}

// The batch's new K and V rows into the cache at their slots: token t's rows of `row_bytes` (its heads
// together) at k + t * k_stride and v + t * v_stride bytes, to slot slots[t] of cache_k and cache_v: one
// parallel pass over both (two index_copy_ over the fused qkv output's strided views were slower).
CONVEYOR_API int conveyor_write_kv(const void* k, int64_t k_stride, const void* v, int64_t v_stride,
                                   const int64_t* slots, int64_t rows, int64_t row_bytes, int64_t num_slots,
                                   void* cache_k, void* cache_v, int threads) {
    return guarded(threads, [&] {
        for (int64_t t = 0; t < rows; ++t)
            CONVEYOR_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " of token ", t,
                           " outside the cache's ", num_slots);
        const auto* ks = static_cast<const char*>(k);
        const auto* vs = static_cast<const char*>(v);
        auto* ck = static_cast<char*>(cache_k);
        auto* cv = static_cast<char*>(cache_v);
        parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
            for (int64_t t = begin; t < end; ++t) {
                std::memcpy(ck + slots[t] * row_bytes, ks + t * k_stride, row_bytes);
                std::memcpy(cv + slots[t] * row_bytes, vs + t * v_stride, row_bytes);
            }
        });
    });
}

// Floats per vector register in the prefill kernel (16: AVX-512).
CONVEYOR_API int64_t conveyor_prefill_vector_width() { return prefill_vector_width(); }
