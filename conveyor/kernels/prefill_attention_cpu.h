// Prefill attention over the paged KV cache on CPU (prefill_attention_cpu.cpp): what it takes.
#pragma once

#include <cstdint>

namespace conveyor {

// A batch's prefill chunks: queries (Q), new keys and values (T: Q's type, or int8 rows with their
// scales, attention_blocks.h) [tokens, heads, D] (rows `*_stride` apart in elements, heads contiguous),
// the cache's K and V rows (Hkv head rows a slot), each chunk's context slots
// (in order, all chunks' concatenated) and per chunk {q_start, q_len, offset into ctx_slots, n_ctx,
// start} (start: the position of its first query; its context is the n_ctx positions before it);
// out [tokens, heads, D] contiguous. `window` > 0: sliding-window attention; `softcap` > 0: scores
// capped as tanh(s / softcap) * softcap; `sinks` (nullptr: none) one attention-sink logit per query
// head (attention_blocks.h). `amx`: bf16 over a bf16 cache may take the AMX tiles where the CPU has
// them (prefill_amx.h: not the decode kernel's bits).
template <typename Q, typename T>
struct PrefillArgs {
    const Q* q;
    const T *k, *v, *cache_k, *cache_v;
    int64_t q_stride, k_stride, v_stride;
    const int64_t *ctx_slots, *chunks;
    int64_t num_chunks, heads, kv_heads, head_dim, window;
    float scale, softcap;
    const float* sinks;
    Q* out;
    bool amx;
};

// Writes every chunk's attention output; call it before the pass writes the chunks' own K/V into
// the cache (a sliding ring may reuse a context's slots for the chunk's tokens).
template <typename Q, typename T>
void prefill_attention(const PrefillArgs<Q, T>& args);

// Floats per vector register in the kernels (16: AVX-512, else 8).
int64_t prefill_vector_width();

}  // namespace conveyor
