// Attention straight from the paged KV cache on CPU, fp32 or bf16 (bf16 widened to fp32 on load;
// scores, softmax and sums in fp32; bf16 output rounded once).
//
// Decode: one query token per request; every query head is scored against the request's cached
// keys, softmaxed and used to weight the values, K/V read from the pages in place.
// Prefill: prefill_attention_cpu.cpp.
// `softcap` > 0 caps the scores as Gemma 2 does: tanh(score / softcap) * softcap; 0 leaves them.
#include "attention_cpu.h"

#include <ATen/Parallel.h>

#include <type_traits>
#include <vector>

using namespace conveyor;

namespace {

// One task per request: its K/V row pointers are looked up once, then each kv head's G query heads
// go through `attend_group` together (AVX-512: every K and V row read and widened once for all of
// them; elsewhere head by head).
template <typename T>
void decode(const T* qp, const T* kp, const T* vp, const int64_t* bt, const int64_t* lens, T* op, int64_t B,
            int64_t H, int64_t Hkv, int64_t D, int64_t max_blocks, int64_t page_size, float scale, float cap) {
    constexpr bool fp32 = std::is_same_v<T, float>;
    const int64_t G = H / Hkv, row = Hkv * D;  // G query heads per kv head
    at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> scores, qf(fp32 ? 0 : H * D), of(fp32 ? 0 : H * D);
        std::vector<const T*> krows, vrows;
        for (int64_t b = begin; b < end; ++b) {
            const int64_t len = lens[b];
            scores.resize(G * len);
            context_rows<T>(kp, vp, bt + b * max_blocks, len, page_size, row, krows, vrows);
            const float* qb;
            float* ob;
            if constexpr (fp32) {
                qb = qp + b * H * D;
                ob = op + b * H * D;
            } else {
                for (int64_t i = 0; i < H * D; ++i) qf[i] = to_float(qp[b * H * D + i]);
                qb = qf.data();
                ob = of.data();
            }
            for (int64_t g = 0; g < Hkv; ++g)
                attend_group<T>(qb + g * G * D, krows.data(), vrows.data(), g * D, len, D, G, scale, cap, scores.data(),
                                ob + g * G * D);
            if constexpr (!fp32)
                for (int64_t i = 0; i < H * D; ++i) op[b * H * D + i] = bf16(of[i]);
        }
    });
}

void check_dtype(const torch::Tensor& t, at::ScalarType dtype, const char* name) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype, name, " must be a CPU tensor of the cache's dtype");
}

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor q,             // [B, H, D]
                                     torch::Tensor kv_cache,      // [2, slots, Hkv, D]
                                     torch::Tensor block_tables,  // [B, max_blocks] int64
                                     torch::Tensor context_lens,  // [B] int64
                                     int64_t page_size, double scale, double softcap) {
    const auto dtype = kv_cache.scalar_type();
    TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16, "fp32 or bf16 only");
    check_dtype(q, dtype, "q");
    TORCH_CHECK(q.is_contiguous() && kv_cache.is_contiguous() && block_tables.is_contiguous() &&
                context_lens.is_contiguous(), "contiguous inputs only");
    const int64_t B = q.size(0), H = q.size(1), D = q.size(2), slots = kv_cache.size(1), Hkv = kv_cache.size(2);
    auto out = torch::empty_like(q);
    const int64_t* bt = block_tables.data_ptr<int64_t>();
    const int64_t* lens = context_lens.data_ptr<int64_t>();
    const auto run = [&](auto* qp, auto* kp, auto* op) {
        decode(qp, kp, kp + slots * Hkv * D, bt, lens, op, B, H, Hkv, D, block_tables.size(1), page_size,
               static_cast<float>(scale), static_cast<float>(softcap));
    };
    if (dtype == torch::kFloat32)
        run(q.data_ptr<float>(), kv_cache.data_ptr<float>(), out.data_ptr<float>());
    else
        run(q.data_ptr<bf16>(), kv_cache.data_ptr<bf16>(), out.data_ptr<bf16>());
    return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("paged_decode_attention", &paged_decode_attention, "decode attention over the paged KV cache (CPU)");
    m.def("paged_prefill_attention", &conveyor::paged_prefill_attention, "prefill attention over the paged KV cache (CPU)");
    m.def("prefill_vector_width", &conveyor::prefill_vector_width,
          "floats per vector register in the prefill kernel (16: AVX-512)");
}
